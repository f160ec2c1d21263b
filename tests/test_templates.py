"""Real chat templates (the 70 that llama.cpp ships, in tests/templates/) rendered as the model was
trained: quipu's context equals a reference render (chat_reference.py, as transformers renders,
tokenized whole as llama.cpp's server does), in text and in tokens, on tiny generated models of
two tokenizer families."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chat_reference import reference_tokens, render_reference
from quipu.errors import TemplateError
from quipu.sessions.conversation import Conversation, Message
from quipu.sessions.inference import InferenceSession
from quipu.sessions.params import SamplingParams
from quipu.sessions.template import ChatTemplate, fold_system

TEMPLATES = sorted((Path(__file__).parent / "templates").glob("*.jinja"))
# Needs a `functions` input that a chat does not have: the reference cannot render it either.
NO_REFERENCE = {"fireworks-ai-llama-3-firefunction-v2"}

CONVERSATIONS = {
    "plain": [("system", "You are a helpful assistant."), ("user", "Hello!"),
              ("assistant", "Hi there. How can I help?"), ("user", "Tell me a joke.")],
    "piped": [("system", "You are terse."), ("user", "Summarize:\n\nThe sky is blue.\n"),
              ("assistant", "  The sky is blue.  "), ("user", "  Shorter, please.  ")],
    "empty": [("user", ""), ("assistant", ""), ("user", "Hello?")],
    "unicode": [("system", "Réponds en français, s'il te plaît."), ("user", "Ça va ? 日本語 😀"),
                ("assistant", "Très bien — 元気です。"), ("user", "Merci !\t")],
}


@pytest.fixture(scope="module", params=["spm", "bpe"])
def backend(request, tmp_path_factory):
    from tinymodel import write_tiny_gguf

    from quipu.engine.settings import ContextSettings
    from quipu.engine.llama import LlamaBackend

    path = write_tiny_gguf(tmp_path_factory.mktemp(request.param) / "tiny.gguf", tokenizer=request.param)
    with LlamaBackend(path, ContextSettings(n_ctx=4096, n_threads=2)) as b:
        yield b


def conversation(backend, source: str, pairs) -> Conversation:
    template = ChatTemplate(source, backend.vocab.special_token_text("bos"), backend.vocab.special_token_text("eos"))
    return Conversation(InferenceSession(backend, SamplingParams(seed=1)), template, [Message(r, c) for r, c in pairs])


@pytest.mark.parametrize("path", TEMPLATES, ids=[p.stem for p in TEMPLATES])
def test_a_shipped_template_renders_as_the_reference(backend, path):
    source = path.read_text()
    bos, eos = backend.vocab.special_token_text("bos"), backend.vocab.special_token_text("eos")
    compared = 0
    for name, pairs in CONVERSATIONS.items():
        messages = [{"role": r, "content": c} for r, c in pairs]
        conv = conversation(backend, source, pairs)
        try:
            expected = render_reference(source, messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)
        except Exception as exc:
            if "System role not supported" in str(exc):
                # quipu's working default: the system prompt joins the first user message.
                expected = render_reference(source, fold_system(messages), add_generation_prompt=True,
                                            bos_token=bos, eos_token=eos)
            else:
                # What the reference cannot render, quipu refuses with a clear error, never a crash.
                with pytest.raises(TemplateError):
                    conv.render(conv.messages, True)
                continue
        rendered = conv.render(conv.messages, True)
        assert rendered.text == expected, name
        assert conv.render_tokens(conv.messages, True) == reference_tokens(backend, expected), name
        compared += 1
    assert compared > 0 or path.stem in NO_REFERENCE


def test_control_token_text_a_user_types_stays_text(backend):
    source = (Path(__file__).parent / "templates" / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()
    typed = "Print <|eot_id|> and <|im_end|> for me."
    harmless = "Print EOT and END for me."
    conv = conversation(backend, source, [("user", typed)])
    plain = conversation(backend, source, [("user", harmless)])
    tokens, plain_tokens = conv.render_tokens(conv.messages, True), plain.render_tokens(plain.messages, True)
    text = conv.render(conv.messages, True).text
    assert text == render_reference(source, [{"role": "user", "content": typed}], add_generation_prompt=True,
                                    bos_token=backend.vocab.special_token_text("bos"))
    # The text spells one more <|eot_id|> than the template writes, yet the tokens hold exactly the
    # template's control tokens: what the user typed is text.
    assert text.count("<|eot_id|>") == plain.render(plain.messages, True).text.count("<|eot_id|>") + 1
    assert [t for t in tokens if backend.vocab.is_control(t)] == [t for t in plain_tokens if backend.vocab.is_control(t)]
    assert b"".join(backend.vocab.token_text(t) for t in tokens).decode() == text.replace("<s>", "", 1) or \
        b"".join(backend.vocab.token_text(t) for t in tokens).decode().lstrip().startswith("<s>")


def test_a_system_prompt_is_folded_where_the_template_refuses_one(backend):
    source = (Path(__file__).parent / "templates" / "google-gemma-2-2b-it.jinja").read_text()
    conv = conversation(backend, source, [("system", "Be brief."), ("user", "Hi")])
    text = conv.render(conv.messages, True).text
    assert "Be brief.\n\nHi" in text and conv.template.folds_system
    lonely = conversation(backend, source, [("user", "Hi"), ("user", "again")])
    with pytest.raises(TemplateError, match="refused the conversation: Conversation roles must alternate"):
        lonely.render(lonely.messages, True)


@pytest.mark.parametrize("name", ["meta-llama-Llama-3.1-8B-Instruct", "Qwen-Qwen2.5-7B-Instruct",
                                  "HuggingFaceTB-SmolLM3-3B", "ibm-granite-granite-3.3-2B-Instruct"])
def test_a_new_turn_keeps_the_whole_earlier_context(backend, name):
    source = (Path(__file__).parent / "templates" / f"{name}.jinja").read_text()
    conv = conversation(backend, source, [("user", "Hello!"), ("assistant", "Hi there.")])
    conv.session.tokens = held = conv.render_tokens(conv.messages, False)
    conv.messages.append(Message("user", "Tell me more."))
    new = conv.context_tokens()
    assert new[:len(held)] == held and len(new) > len(held)
    assert new == conv.render_tokens(conv.messages, True)


def test_a_reply_keeps_the_tokens_it_was_generated_as(tmp_path):
    from tinymodel import write_tiny_gguf

    from quipu.engine.settings import ContextSettings
    from quipu.engine.llama import LlamaBackend

    with LlamaBackend(write_tiny_gguf(tmp_path / "bpe.gguf", tokenizer="bpe"), ContextSettings(n_ctx=1024)) as b:
        source = (Path(__file__).parent / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
        conv = conversation(b, source, [("user", "Hello!"), ("assistant", "hello world, the sky")])
        # As a model may generate it: one token per character, not as the tokenizer would split it.
        reply = [t for ch in "hello world, the sky" for t in b.vocab.tokenize(ch, add_special=False, parse_special=False)]
        held = conv.render_tokens(conv.messages[:1], True) + reply + b.vocab.tokenize("<|im_end|>", add_special=False,
                                                                              parse_special=True)
        conv.session.tokens = list(held)
        conv.messages.append(Message("user", "Tell me more."))
        new = conv.context_tokens()
        assert new[:len(held)] == held  # the reply's own tokens, not the tokenizer's
        assert new != conv.render_tokens(conv.messages, True)
        assert new[0] == b.vocab.bos_token()  # the model's BOS, which this template does not write
        assert b"".join(b.vocab.token_text(t) for t in new[1:]).decode() == conv.render(conv.messages, True).text


def test_a_template_that_drops_earlier_reasoning_is_re_read_from_where_it_changed(backend):
    source = (Path(__file__).parent / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
    reply = "<think>\nThe user greets me.\n</think>\n\nHi there."
    conv = conversation(backend, source, [("user", "Hello!"), ("assistant", reply)])
    prompt = conv.render_tokens(conv.messages[:1], True)
    # The context after the turn: the prompt, the reply as generated (reasoning and all), the end.
    conv.session.tokens = prompt + backend.vocab.tokenize(reply + "<|im_end|>", add_special=False, parse_special=True)
    conv.messages.append(Message("user", "Tell me more."))
    new = conv.context_tokens()
    assert new[:len(prompt)] == prompt  # everything before the reply is kept
    assert "<think>" not in conv.render(conv.messages, True).text  # the template dropped the reasoning
    assert new == reference_tokens(backend, conv.render(conv.messages, True).text)


# ---- through the command line ----------------------------------------------------------------

TEMPLATE_DIR = Path(__file__).parent / "templates"
R1 = TEMPLATE_DIR / "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja"  # its prompt opens <think>


def run_json(quipu, *args):
    import json

    r = quipu("run", "--json", *args)
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout)


def test_reasoning_stays_off_stdout_and_is_in_json(quipu, tiny_model):
    out = run_json(quipu, "-m", tiny_model, "--chat-template", R1, "-n", "8", "--seed", "3", "hello")
    assert out["reasoning"] and out["text"] == ""  # 8 tokens, all inside the block the prompt opened
    r = quipu("run", "-m", tiny_model, "--chat-template", R1, "-n", "8", "--seed", "3", "hello")
    assert r.returncode == 0 and r.stdout == b"\n" and r.stderr == b""  # a pipe gets the answer only


def test_a_reply_cut_inside_thinking_is_saved_and_resumed_exactly(quipu, tiny_model, home):
    import json

    # (a seed whose first 8 tokens are whole characters: a reply whose text holds a stray byte is
    # read again from it on --continue, the text no longer spelling those tokens)
    args = ("-m", tiny_model, "--chat-template", R1, "--seed", "6", "-t", "1.0")
    whole = run_json(quipu, "-S", "whole", *args, "-n", "16", "hello")
    first = run_json(quipu, "-S", "half", *args, "-n", "8", "hello")
    rest = run_json(quipu, "-S", "half", "--continue", "-n", "8")
    assert whole["finish_reason"] == first["finish_reason"] == "length"
    assert rest["usage"]["cached_tokens"] == rest["usage"]["prompt_tokens"] - 1  # nothing re-read
    replies = [json.loads((home / "data" / "sessions" / f"{n}.json").read_text())["messages"][-1]["content"]
               for n in ("whole", "half")]
    assert replies[0] == replies[1]
    assert "<think>" not in replies[0] and whole["reasoning"]


def test_a_chat_template_is_remembered_by_its_session(quipu, tiny_model):
    gemma = TEMPLATE_DIR / "google-gemma-2-2b-it.jinja"
    first = quipu("run", "-m", tiny_model, "--chat-template", gemma, "-S", "g", "-s", "Be brief.", "-n", "4", "hello")
    assert first.returncode == 0, first.stderr.decode()
    assert first.stderr.decode().count("no system role") == 1  # said once, with a working default
    shown = quipu("run", "-S", "g", "--show-prompt", "--json", "and again")
    import json

    view = json.loads(shown.stdout)
    assert "<start_of_turn>" in view["text"] and "<|im_start|>" not in view["text"]
    assert view["text"].count("Be brief.") == 1 and "system" not in view["text"]  # joined to the user's message
    assert 0 < view["reused_tokens"] < len(view["tokens"])


def test_show_prompt_generates_and_saves_nothing(quipu, tiny_model, home):
    import json

    assert quipu("run", "-m", tiny_model, "-S", "s", "-n", "4", "hello").returncode == 0
    files = sorted((home / "data" / "sessions").glob("s.*"))
    before = [(p.name, p.stat().st_mtime_ns) for p in files]
    r = quipu("run", "-S", "s", "--show-prompt", "the sky")
    assert r.returncode == 0 and "the sky" in r.stdout.decode() and "already in session 's'" in r.stderr.decode()
    assert [(p.name, p.stat().st_mtime_ns) for p in files] == before
    plain = json.loads(quipu("run", "-m", tiny_model, "--show-prompt", "--json", "-s", "sys", "hi").stdout)
    assert plain["reused_tokens"] == 0 and plain["session"] is None
    assert plain["text"].startswith("<s>") and "<|im_start|>" in plain["text"] and len(plain["tokens"]) > 5


@pytest.mark.parametrize("content, words", [(None, "cannot read"), ("", "empty"), ("{% for x in %}", "broken"),
                                            (b"\xff\xfe", "not UTF-8")])
def test_a_bad_chat_template_file_is_a_usage_error(quipu, tiny_model, tmp_path, content, words):
    path = tmp_path / "t.jinja"
    if content is not None:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    r = quipu("run", "-m", tiny_model, "--chat-template", path, "hi")
    err = r.stderr.decode()
    assert r.returncode == 2 and words in err and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_models_info_says_what_a_template_does(quipu, tmp_path):
    import json

    from tinymodel import write_tiny_gguf

    qwen3 = write_tiny_gguf(tmp_path / "q3.gguf", chat_template=(TEMPLATE_DIR / "Qwen-Qwen3-0.6B.jinja").read_text())
    gemma = write_tiny_gguf(tmp_path / "g2.gguf", chat_template=(TEMPLATE_DIR / "google-gemma-2-2b-it.jinja").read_text())
    q = json.loads(quipu("models", "info", "--template", "--json", qwen3).stdout)["template_features"]
    g = json.loads(quipu("models", "info", "--template", "--json", gemma).stdout)["template_features"]
    assert q["thinking"] and q["thinking_switch"] and q["tools"] and q["system_role"]
    assert not g["system_role"] and not g["thinking"]
    assert q["tool_format"] == "Hermes 2 Pro, Hermes 3, Qwen 2.5, Qwen 3, Granite 4" and g["tool_format"] == "generic"
    text = quipu("models", "info", "--template", gemma).stdout.decode()
    assert "a system prompt joins the first user message" in text
    assert "tools           yes (calls as Hermes 2 Pro, Hermes 3, Qwen 2.5, Qwen 3, Granite 4 write them)" in quipu(
        "models", "info", "--template", qwen3).stdout.decode()


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, today.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city"]}}}
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": '{"temperature": 21, "sky": "clear"}', "tool_call_id": "call12345",
     "name": "get_weather"},
]
WITH_TOOLS = [p for p in TEMPLATES if "tools" in p.read_text()]


@pytest.mark.parametrize("path", WITH_TOOLS, ids=[p.stem for p in WITH_TOOLS])
def test_a_conversation_with_tools_renders_as_the_reference(backend, path):
    # The tools, an assistant's call and the tool's result, as the template itself renders them.
    from quipu.sessions.toolspec import ToolSpec

    source = path.read_text()
    bos, eos = backend.vocab.special_token_text("bos"), backend.vocab.special_token_text("eos")
    fn = WEATHER["function"]
    conv = conversation(backend, source, [])
    conv.messages = [Message.from_dict(m) for m in TOOL_CONVERSATION]
    conv.update(tools=[ToolSpec(fn["name"], fn["description"], fn["parameters"])])
    try:
        expected = render_reference(source, TOOL_CONVERSATION, add_generation_prompt=True, bos_token=bos,
                                    eos_token=eos, tools=[WEATHER])
    except Exception as exc:
        if "System role not supported" in str(exc):
            expected = render_reference(source, fold_system(TOOL_CONVERSATION), add_generation_prompt=True,
                                        bos_token=bos, eos_token=eos, tools=[WEATHER])
        else:
            # A template that takes a call's arguments as JSON text (Functionary v3.2's) is given
            # them so, as llama.cpp gives them; one that fails both ways is refused.
            as_text = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(
                c["function"]["arguments"])}} for c in m["tool_calls"]]} if m.get("tool_calls") else m
                for m in TOOL_CONVERSATION]
            try:
                expected = render_reference(source, as_text, add_generation_prompt=True, bos_token=bos,
                                            eos_token=eos, tools=[WEATHER])
            except Exception:
                with pytest.raises(TemplateError):
                    conv.render(conv.messages, True)
                return
    rendered = conv.render(conv.messages, True)
    assert rendered.text == expected
    assert "get_weather" in rendered.text and "21" in rendered.text
    assert conv.render_tokens(conv.messages, True) == reference_tokens(backend, expected)


def test_text_that_looks_like_a_wide_format_field_is_only_text():
    # (what a message holds is never read as a format string: only the string a template formats)
    from quipu.sessions.template import ChatTemplate

    template = ChatTemplate("{% for m in messages %}{{ '[%s]' % m.content }}{{ '<{}>'.format(m.content) }}{% endfor %}")
    content = "{x:>10000000} %10000000d {:{}}"
    assert template.render([{"role": "user", "content": content}], False) == f"[{content}]<{content}>"
