"""Every thinking model's reasoning, as its template writes it: found from the template, split
from the answer as it streams (markup as control tokens or as text), kept in the field the
template reads, rendered into the next turn, and held to a budget. The tiny model's vocabulary
has each family's markup as special tokens, and a Lark grammar holds its reply to the family's
format, as a trained model of that family writes it."""

from __future__ import annotations

import functools
import json
import random
import re
from pathlib import Path

import pytest

from quipu.sessions.base import Message, ReplySink, common_prefix
from quipu.sessions.conversation import Conversation, TurnSettings
from quipu.sessions.inference import InferenceSession
from quipu.sessions.params import SamplingParams
from quipu.sessions.reasoning import TABLE
from quipu.sessions.template import ChatTemplate

TEMPLATES = Path(__file__).parent / "templates"
EXTRA = ["<|open|>", "<|close|>", "<|sep|>", "<|eom|>", "<|eot|>"]

# family: (template, variables, what the model writes after its prompt: R for the reasoning, A
# for the answer), each format as that family's model writes it.
FAMILIES = {
    "qwen3": ("Qwen-Qwen3-0.6B", {}, "<think>\nR\n</think>\n\nA"),
    "deepseek-r1 (the prompt opens it)": ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", {"enable_thinking": True}, "R\n</think>\n\nA"),
    "qwen3.5 (the prompt opens it)": ("Qwen3.5-4B", {}, "R\n</think>\n\nA"),
    "gpt-oss": ("openai-gpt-oss-120b", {},
                "<|channel|>analysis<|message|>R<|end|><|start|>assistant<|channel|>final<|message|>A"),
    "gemma-4": ("google-gemma-4-31B-it", {"enable_thinking": True}, "<|channel>thought\nR<channel|>A"),
    "command-r7b": ("CohereForAI-c4ai-command-r7b-12-2024-tool_use", {"enable_thinking": True},
                    "<|START_THINKING|>R<|END_THINKING|><|START_RESPONSE|>A<|END_RESPONSE|>"),
    "cohere2 (the prompt opens it)": ("Cohere2MoE", {}, "R<|END_THINKING|><|START_TEXT|>A<|END_TEXT|>"),
    "seed-oss": ("ByteDance-Seed-OSS", {}, "<seed:think>R</seed:think>A"),
    "ministral-3-reasoning": ("mistralai-Ministral-3-14B-Reasoning-2512", {}, "[THINK]R[/THINK]A"),
    "apertus": ("Apertus-8B-Instruct", {"enable_thinking": True}, "<|inner_prefix|>R<|inner_suffix|>A"),
    # beyond the table: found by rendering the template
    "minimax-m3": ("MiniMax-M3", {}, "<mm:think>R</mm:think>A"),
    "solar-open": ("upstage-Solar-Open-100B", {}, "<|think|>R<|end|><|begin|>assistant<|content|>A"),
    "kimi-k3": ("Kimi-K3", {}, "R<|close|>think<|sep|><|open|>response<|sep|>A"),
}
# The families whose templates render an earlier reply's reasoning: the next turn reads only what is new.
KEEPS_REASONING = {"minimax-m3"}


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    from tinymodel import REASONING_SPECIALS, write_tiny_gguf

    from quipu.engine.settings import ContextSettings
    from quipu.engine.llama import LlamaBackend

    path = write_tiny_gguf(tmp_path_factory.mktemp("reasoning") / "r.gguf", tool_specials=True, tokenizer="bpe",
                           extra_specials=REASONING_SPECIALS + EXTRA)
    made = LlamaBackend(path, ContextSettings(n_ctx=8192, n_threads=2))
    yield made
    made.close()


def held_to(backend, shape: str) -> str:
    """A Lark grammar for a reply of `shape`: its markup as the model's tokens, R a few words in
    a to m, A a few words in n to z."""
    special = backend.vocab.special_tokens()
    parts = []
    for piece in re.split(r"(R|A|<[^<>\s]+>|\[/?THINK\])", shape):
        if piece == "R":
            parts.append("reasoning")
        elif piece == "A":
            parts.append("answer")
        elif piece in special:
            parts.append(f"<[{special[piece]}]>")
        elif piece:
            parts.append(json.dumps(piece))
    return (f"start: {' '.join(parts)}\nreasoning: /[a-m]{{1,6}}( [a-m]{{1,6}}){{2,5}}/\n"
            "answer: /[n-z]{1,6}( [n-z]{1,6}){2,5}/\n")


class Collect(ReplySink):
    def __init__(self):
        self.answer, self.thought = [], []

    def text(self, piece):
        self.answer.append(piece)

    def reasoning(self, piece):
        self.thought.append(piece)


def session_for(backend, family, seed):
    from quipu.engine.grammar import Grammar

    name, variables, shape = FAMILIES[family]
    session = InferenceSession(backend, SamplingParams(seed=seed, temperature=1.0,
                                                       grammar=Grammar("lark", held_to(backend, shape))))
    conv = Conversation.start(session, template=(TEMPLATES / f"{name}.jinja").read_text(),
                              settings=TurnSettings().but(variables=variables))
    return session, conv


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_s_reasoning_is_split_from_its_answer_and_its_next_turn_renders(backend, family):
    for seed in range(2):
        session, conv = session_for(backend, family, seed)
        sink = Collect()
        gen = conv.send("Why is the sky blue?", max_tokens=120, sink=sink)
        spelled = session.spell(session.tokens[session.reply_start:])
        assert gen.finish_reason == "stop", (family, spelled)
        # the answer alone, as streamed and as kept; the reasoning apart
        assert re.fullmatch(r"[n-z ]+", gen.answer), (family, gen.answer, spelled)
        assert re.fullmatch(r"[a-m ]+", gen.reasoning), (family, gen.reasoning, spelled)
        assert "".join(sink.answer) == gen.answer and "".join(sink.thought).strip() == gen.reasoning
        reply = conv.messages[-1]
        assert reply.content == gen.answer and reply.reasoning.strip() == gen.reasoning
        held = list(session.tokens)
        # the next turn renders (GPT-OSS refused its own analysis in the content), and reads
        # again only from where the template changed what the context holds
        gen2 = conv.send("And at night?", max_tokens=120)
        assert gen2.finish_reason == "stop" and re.fullmatch(r"[n-z ]+", gen2.answer), family
        new = conv.render_tokens(conv.messages[:-1], add_generation_prompt=False)
        assert session.stats.cached_tokens >= min(common_prefix(held, new), len(held) - 1) - 1, family
        if family in KEEPS_REASONING:  # the first reply's reasoning kept, not read again
            close = backend.vocab.special_tokens()[conv.template.reasoning.close]
            assert session.stats.cached_tokens > len(held) - 1 - held[::-1].index(close), family


def test_a_gpt_oss_chat_goes_on_for_many_turns(backend):
    session, conv = session_for(backend, "gpt-oss", 7)
    for turn in range(5):
        gen = conv.send(f"question {turn}", max_tokens=120)
        assert gen.finish_reason == "stop" and gen.reasoning and gen.answer
    text = conv.render(conv.messages, True).text
    assert text.count("<|channel|>final<|message|>") == 5 and "<|channel|>analysis" not in text


@pytest.mark.parametrize("family", ["qwen3", "gpt-oss", "command-r7b"])
def test_a_reply_cut_inside_its_reasoning_continues_exactly(backend, family):
    session, conv = session_for(backend, family, 3)
    whole = conv.send("Why?", max_tokens=120)
    expected = list(session.tokens)
    # (the longest cut of at most 14 tokens inside the reasoning: where a random model closes its
    # reasoning is its draws' doing)
    for n in range(14, 1, -1):
        session, conv = session_for(backend, family, 3)
        cut = conv.send("Why?", max_tokens=n)
        if cut.reasoning and not cut.answer:
            break
    assert cut.finish_reason == "length" and cut.reasoning and not cut.answer
    conv.continue_reply(max_tokens=120)
    assert session.tokens == expected
    assert conv.messages[-1].content == whole.answer
    assert conv.messages[-1].reasoning.strip() == whole.reasoning


def test_a_template_spells_its_markup_and_a_new_model_in_a_known_style_needs_no_new_row():
    found = {name: ChatTemplate((TEMPLATES / f"{t}.jinja").read_text()).reasoning
             for name, (t, _, _) in FAMILIES.items()}
    for name, fmt in found.items():
        assert fmt is not None, name
    assert found["gpt-oss"].field == "thinking" and found["qwen3"].field == "reasoning_content"
    # (templates that render reasoning only in a turn's tool loop: found there)
    assert found["gemma-4"].field == found["command-r7b"].field == "reasoning_content"
    assert found["minimax-m3"].opens == ("<mm:think>",) and found["minimax-m3"].name == "template"
    # a template no one has seen, in the `<tag>` style, with its own field
    source = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and m.reason %}"
              "<deliberate>{{ m.reason }}</deliberate>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert ChatTemplate(source).reasoning is None  # (`reason` is no field templates read)
    fmt = ChatTemplate(source.replace("m.reason", "m.reasoning_content")).reasoning
    assert fmt is not None and (fmt.opens, fmt.close, fmt.field) == (("<deliberate>",), "</deliberate>",
                                                                       "reasoning_content")
    # an unknown style is plain answer text
    assert ChatTemplate((TEMPLATES / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()).reasoning is None


SPLITS = [
    ("think", "<think>\nI think.\n</think>\n\nThe answer.", False, "\nI think.\n", "The answer."),
    ("think", "  <think>a</think>b", False, "a", "b"),
    ("think", "The <think> tag is HTML-like.", False, "", "The <think> tag is HTML-like."),
    ("think", "reasoning here</think>\n\nanswer", True, "reasoning here", "answer"),
    ("think", "<think>cut inside", False, "cut inside", ""),
    ("think", "<thin", False, "", "<thin"),
    ("think", "  Hello", False, "", "  Hello"),
    ("harmony", "<|channel|>analysis<|message|>R1<|end|><|start|>assistant<|channel|>final<|message|>A1",
     False, "R1", "A1"),
    ("harmony", "<|channel|>final<|message|>Only the answer.", False, "", "Only the answer."),
    ("harmony", "<|channel|>analysis<|message|>one<|end|><|start|>assistant<|channel|>analysis<|message|>two"
                "<|end|><|start|>assistant<|channel|>final<|message|>A", False, "onetwo", "A"),
    ("command-r", "<|START_THINKING|>plan<|END_THINKING|><|START_RESPONSE|>Hi.<|END_RESPONSE|>", False,
     "plan", "Hi."),
    ("gemma-4", "<|channel>thought\nwhy<channel|>Because.", False, "\nwhy", "Because."),
    ("mistral", "[THINK]hm[/THINK]Yes.", False, "hm", "Yes."),
]


@pytest.mark.parametrize("name, text, inside, reasoning, answer", SPLITS)
def test_reasoning_splits_from_the_answer_however_the_text_streams(name, text, inside, reasoning, answer):
    # Markup may come as control tokens (apart from the text) or as text, in any pieces.
    fmt = next(f for f in TABLE if f.name == name)
    markers = {*fmt.opens, fmt.close, *fmt.answer_opens, *fmt.answer_closes, *(fmt.headers[0] if fmt.headers else ()),
               *(fmt.headers[1:] if fmt.headers else ())}
    markup = re.compile("(" + "|".join(re.escape(m) for m in sorted(markers, key=len, reverse=True)) + ")")
    for seed in range(30):
        rng = random.Random(seed)
        splitter, pieces = fmt.splitter(inside), []
        for part in markup.split(text):
            if part in markers and part not in answer and rng.random() < 0.5:
                pieces += splitter.feed(part, control=True)
                continue
            at = 0
            while at < len(part):
                step = rng.randint(1, 4)
                pieces += splitter.feed(part[at:at + step])
                at += step
        pieces += splitter.flush()
        got = ("".join(t for r, t in pieces if r), "".join(t for r, t in pieces if not r))
        assert got == (reasoning, answer), (name, seed)


def test_a_stray_control_token_in_an_answer_is_not_shown():
    fmt = next(f for f in TABLE if f.name == "think")
    splitter = fmt.splitter()
    pieces = splitter.feed("Hello ") + splitter.feed("<|eot_id|>", control=True) + splitter.feed("world")
    assert "".join(t for _, t in pieces + splitter.flush()) == "Hello world"


def test_a_reasoning_budget_closes_the_reasoning_and_the_model_answers(backend):
    # Qwen 3.5's prompt opens the reasoning; the model may not close it itself (its close banned):
    # after the budget, the close comes, as the template writes it, and the model goes on.
    close = backend.vocab.special_tokens()["</think>"]
    banned = [(close, float("-inf"))] + [(t, float("-inf")) for t in backend.vocab.special_tokens().values()
                                         if backend.vocab.is_eog(t)]
    session = InferenceSession(backend, SamplingParams(seed=2, temperature=1.0, logit_bias=banned))
    conv = Conversation.start(session, template=(TEMPLATES / "Qwen3.5-4B.jinja").read_text())
    conv.set_reasoning(budget=8)
    gen = conv.send("Why?", max_tokens=40)
    reply = session.tokens[session.reply_start:]
    # (eight tokens of reasoning, then the close as the template writes it, then the model's answer)
    spelled = session.spell(reply)
    assert spelled.startswith(session.spell(reply[:8]) + "\n</think>\n\n")
    # Reasoning the model opens again later draws on the same budget, spent: it is closed at once.
    opener = backend.vocab.special_tokens()["<think>"]
    again = [i for i, t in enumerate(reply) if t == opener]
    assert reply.count(close) == 1 + len(again)
    assert all(session.spell(reply[i + 1:]).startswith("\n</think>") for i in again)
    assert gen.answer and gen.reasoning and len(spelled) > spelled.index("</think>") + 12


def test_a_budget_of_0_answers_without_reasoning(backend):
    close = backend.vocab.special_tokens()["</think>"]
    for template, switch in (("Qwen3.5-4B", True), ("llama-cpp-deepseek-r1", False)):
        banned = [(t, float("-inf")) for t in backend.vocab.special_tokens().values() if backend.vocab.is_eog(t) or t == close]
        session = InferenceSession(backend, SamplingParams(seed=1, temperature=1.0, logit_bias=banned))
        conv = Conversation.start(session, template=(TEMPLATES / f"{template}.jinja").read_text())
        conv.set_reasoning(budget=0)
        gen = conv.send("Why?", max_tokens=12)
        assert gen.reasoning == "" and gen.answer, template
        if switch:  # the template's own switch: the prompt closes the reasoning itself
            assert session.spell(session.tokens[:session.reply_start]).endswith("<think>\n\n</think>\n\n")
        else:  # the close written at once
            assert session.spell(session.tokens[session.reply_start:]).startswith("</think>")


def test_reasoning_effort_and_budget_are_refused_in_one_line_where_they_cannot_be(backend):
    from quipu.errors import UsageError

    session = InferenceSession(backend, SamplingParams(seed=0))
    conv = Conversation.start(session, template=(TEMPLATES / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text())
    with pytest.raises(UsageError, match="takes no reasoning effort"):
        conv.set_reasoning(effort="high")
    with pytest.raises(UsageError, match="writes no reasoning"):
        conv.set_reasoning(budget=10)
    gpt = Conversation.start(session, template=(TEMPLATES / "openai-gpt-oss-120b.jinja").read_text())
    with pytest.raises(UsageError, match="low, medium, high"):
        gpt.set_reasoning(effort="max")
    gpt.set_reasoning(effort="high")
    assert "Reasoning: high" in gpt.render([Message("user", "hi")], True).text


def write_model(tmp_path) -> Path:
    from tinymodel import REASONING_SPECIALS, write_tiny_gguf

    return write_tiny_gguf(tmp_path / "r.gguf", tool_specials=True, tokenizer="bpe",
                           extra_specials=REASONING_SPECIALS + EXTRA,
                           chat_template=(TEMPLATES / "openai-gpt-oss-120b.jinja").read_text())


def test_a_gpt_oss_session_on_the_command_line(quipu, tmp_path, backend):
    # The answer alone on stdout and in --json's text, the reasoning apart; the session's second
    # turn renders; sessions show and export show the reasoning beside the answer.
    model = write_model(tmp_path)
    grammar = tmp_path / "harmony.lark"
    grammar.write_text(held_to(backend, FAMILIES["gpt-oss"][2]))
    common = ["-m", model, "--grammar", grammar, "-t", "1", "-n", "120", "-S", "oss"]
    first = quipu("run", *common, "--seed", "4", "--json", "Why?")
    assert first.returncode == 0, first.stderr
    data = json.loads(first.stdout)
    assert re.fullmatch(r"[n-z ]+", data["text"]) and re.fullmatch(r"[a-m ]+", data["reasoning"])
    second = quipu("run", *common, "--seed", "5", "And?")
    assert second.returncode == 0, second.stderr
    assert re.fullmatch(r"[n-z ]+\n?", second.stdout.decode()), second.stdout
    shown = quipu("sessions", "show", "oss")
    assert data["reasoning"] in shown.stdout.decode() and "<|channel|>" not in shown.stdout.decode()
    exported = json.loads(quipu("sessions", "export", "oss", "--format", "json").stdout)
    replies = [m for m in exported["messages"] if m["role"] == "assistant"]
    assert replies[0]["content"] == data["text"] and replies[0]["reasoning"] == data["reasoning"]
    effort = quipu("run", "-m", model, "--reasoning-effort", "low", "--show-prompt", "-n", "1", "hi")
    assert "Reasoning: low" in effort.stdout.decode() + effort.stderr.decode(), effort.stderr


def test_a_reasoning_budget_is_kept_by_a_session_and_refused_by_batch(quipu, tiny_model, tmp_path, home):
    model = write_model(tmp_path)
    r = quipu("run", "-m", model, "--reasoning-budget", "16", "-S", "b", "-n", "4", "hi")
    assert r.returncode == 0, r.stderr
    record = json.loads((home / "data" / "sessions" / "b.json").read_text())
    assert record["limits"]["reasoning_budget"] == 16
    bad = quipu("run", "-m", tiny_model, "--reasoning-budget", "16", "hi")  # ChatML: no reasoning
    assert bad.returncode == 2 and len(bad.stderr.decode().strip().splitlines()) == 1
    batch = tmp_path / "rows.jsonl"
    batch.write_text('{"prompt": "hi"}\n')
    refused = quipu("run", "-m", model, "--batch", batch, "--reasoning-budget", "3")
    assert refused.returncode == 2 and "--reasoning-budget" in refused.stderr.decode()


def test_a_gpt_oss_call_after_its_analysis_is_read_and_its_markup_never_shown(backend):
    # Tools offered: the model reasons in the analysis channel, then calls in the commentary
    # channel; the call is read, its markup never shown, the analysis kept as its reasoning.
    from quipu.engine.grammar import Grammar
    from quipu.sessions.toolspec import ToolSpec

    special = backend.vocab.special_tokens()
    head = held_to(backend, "<|channel|>analysis<|message|>R<|end|><|start|>assistant<|channel|>").split("\n")[0]
    lark = head + ' "commentary to=functions." rest\nrest: /[a-z_]*/\n' + "\n".join(
        held_to(backend, "R").split("\n")[1:])
    session = InferenceSession(backend, SamplingParams(seed=3, temperature=1.0, grammar=Grammar("lark", lark)))
    conv = Conversation.start(session, template=(TEMPLATES / "openai-gpt-oss-120b.jinja").read_text())
    conv.update(tools=[ToolSpec("get_weather", "The weather.", {"type": "object", "properties": {
        "city": {"enum": ["Paris"]}}, "required": ["city"], "additionalProperties": False})])
    sink = Collect()
    gen = conv.send("Weather in Paris?", max_tokens=200, sink=sink)
    assert [(c.name, c.arguments) for c in gen.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert re.fullmatch(r"[a-m ]+", gen.reasoning) and "".join(sink.thought).strip() == gen.reasoning
    assert "".join(sink.answer).strip() == "" and special["<|call|>"] == session.tokens[-1]
    reply = conv.messages[-1]
    assert reply.reasoning.strip() == gen.reasoning and reply.tool_calls and reply.content == ""
    conv.add_tool_results([(gen.tool_calls[0], "sunny")])
    text = conv.render(conv.messages, True).text  # the analysis renders where the template keeps it
    assert f"<|channel|>analysis<|message|>{reply.reasoning}<|end|>" in text


def test_a_batch_splits_each_row_s_reasoning(quipu, tmp_path, backend):
    model = write_model(tmp_path)
    grammar = tmp_path / "harmony.lark"
    grammar.write_text(held_to(backend, FAMILIES["gpt-oss"][2]))
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "Why?"}\n{"prompt": "How?"}\n')
    r = quipu("run", "-m", model, "--grammar", grammar, "-t", "1", "-n", "120", "--seed", "1", "--batch", rows)
    assert r.returncode == 0, r.stderr
    outs = [json.loads(line) for line in r.stdout.decode().splitlines()]
    assert len(outs) == 2
    for out in outs:
        assert re.fullmatch(r"[n-z ]+", out["text"]) and re.fullmatch(r"[a-m ]+", out["reasoning"]), out


def test_reasoning_the_model_opens_after_some_answer_is_split_and_held_to_the_budget(backend):
    # The reply's first tokens are answer; then the model opens its reasoning (a control token):
    # what follows is reasoning, closed after the budget, and the model answers again.
    opener, close = backend.vocab.special_tokens()["<think>"], backend.vocab.special_tokens()["</think>"]
    banned = [(close, float("-inf"))] + [(t, float("-inf")) for t in backend.vocab.special_tokens().values()
                                         if backend.vocab.is_eog(t)]
    session = InferenceSession(backend, SamplingParams(seed=4, temperature=1.0, logit_bias=banned))

    def think_third(tokens, logits) -> None:
        if len(tokens) - session.reply_start == 2:
            logits[:] = float("-inf")
            logits[opener] = 0.0

    session.logits_processors.append(think_third)
    conv = Conversation.start(session, template=(TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text())
    conv.set_reasoning(budget=5)
    gen = conv.send("Why?", max_tokens=24)
    reply = session.tokens[session.reply_start:]
    assert reply[2] == opener and reply.count(close) == 1
    assert session.spell(reply[8:]).startswith("\n</think>")  # (five tokens of reasoning, then the close)
    shown = [t for t in reply[3:8] if not backend.vocab.is_control(t)]  # (a control token's spelling is not shown)
    assert gen.reasoning == session.spell(shown).strip()
    assert gen.answer.startswith(session.spell(reply[:2]).strip()) and "<think>" not in gen.answer


def test_a_reply_cut_in_its_reasoning_and_continued_closes_where_the_whole_one_does(quipu, tmp_path):
    from tinymodel import REASONING_SPECIALS, write_tiny_gguf

    model = write_tiny_gguf(tmp_path / "q.gguf", tool_specials=True, tokenizer="bpe",
                            extra_specials=REASONING_SPECIALS + EXTRA,
                            chat_template=(TEMPLATES / "Qwen3.5-4B.jinja").read_text())
    common = ("-m", model, "--reasoning-budget", "9", "--seed", "7", "-t", "0.9", "--logit-bias", "</think>=-inf",
              "--logit-bias", "<|im_end|>=-inf", "--logit-bias", "<|endoftext|>=-inf", "--json")

    def turn(*args):
        r = quipu("run", *common, *args)
        assert r.returncode == 0, r.stderr.decode()
        return json.loads(r.stdout)

    whole = turn("-S", "whole", "-n", "20", "Why?")
    cut = turn("-S", "cut", "-n", "4", "Why?")  # (inside its reasoning)
    # what --show-prompt says the continue reads is what the session holds: the reply's reasoning too
    shown = turn("-S", "cut", "--continue", "--show-prompt")
    # (a marker the random model drew inside its reasoning is in the context, not in the reasoning's text)
    plain = functools.reduce(lambda text, special: text.replace(special, ""), REASONING_SPECIALS + EXTRA, shown["text"])
    assert shown["reused_tokens"] == len(shown["tokens"]) and cut["reasoning"] in plain
    more = turn("-S", "cut", "--continue", "-n", "16")
    assert cut["reasoning"] and not cut["text"]
    assert (cut["reasoning"] + more["reasoning"], more["text"]) == (whole["reasoning"], whole["text"])
    kept = json.loads(quipu("sessions", "export", "cut", "--format", "json").stdout)["messages"][-1]
    assert kept["reasoning"] == whole["reasoning"] and kept["content"] == whole["text"]


def test_no_stray_harmony_markup_reaches_stdout(quipu, tmp_path):
    # GPT-OSS's markup reaches a reply as text (llama.cpp does not mark it as control tokens):
    # wherever the model writes it out of its place, it is not shown, as the <think> families'
    # control tokens are not.
    model = write_model(tmp_path)
    markup = ("<|message|>", "<|constrain|>", "<|call|>", "<|channel|>", "<|start|>", "<|end|>", "<|return|>")
    favoured = [a for m in ("<|message|>", "<|constrain|>") for a in ("--logit-bias", f"{m}=4")]
    for seed in range(6):
        r = quipu("run", "-m", model, "-n", "40", "--seed", str(seed), "-t", "1.0", *favoured, "--json", "hi")
        assert r.returncode == 0, r.stderr.decode()
        data = json.loads(r.stdout)
        shown = data["text"] + (data["reasoning"] or "")
        assert not any(m in shown for m in markup), (seed, shown)
        plain = quipu("run", "-m", model, "-n", "40", "--seed", str(seed), "-t", "1.0", *favoured, "hi")
        assert not any(m in plain.stdout.decode() for m in markup), (seed, plain.stdout)
