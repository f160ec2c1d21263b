"""Tools end to end on the real engine: a call held to the tools' schemas in each family's
format, the loop that runs it and gives the result back, approvals, a loop that stops at a call
the caller runs and resumes exactly, and the bad input a user can give."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

TEMPLATES = Path(__file__).parent / "templates"
FUNCTIONS = '''
from dataclasses import dataclass
from typing import Literal, Optional


@dataclass
class Place:
    city: str
    country: Optional[str] = None


def get_weather(city: str, unit: Literal["C", "F"] = "C") -> dict:
    """The weather in a city, today."""
    return {"city": city[:3], "temperature": 21, "unit": unit}


def distance(a: Place, b: Place, roads: list[str] = []) -> float:
    """How far apart two places are, in km."""
    return 42.0


def _private():
    pass
'''
# The tiny random model writes long strings: bounded here, so that a call ends.
BOUNDED = FUNCTIONS.replace("def get_weather(city: str,", "def get_weather(city: Literal['Paris', 'Rome'],")


def write(tmp_path, text: str = BOUNDED, name: str = "fns.py") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def transcript(home, name: str) -> dict:
    return json.loads((home / "data" / "sessions" / f"{name}.json").read_text())


@pytest.mark.parametrize("template", ["Qwen-Qwen2.5-7B-Instruct", "meta-llama-Llama-3.1-8B-Instruct",
                                      "mistralai-Mistral-Nemo-Instruct-2407", "Mistral-Small-3.2-24B-Instruct-2506"])
def test_a_call_in_the_family_s_format_runs_and_its_result_is_read(quipu, tiny_model, tmp_path, home, template):
    fns = write(tmp_path)
    args = ("-m", tiny_model, "--chat-template", str(TEMPLATES / f"{template}.jinja"), "--functions", fns,
            "--tool-choice", "get_weather", "--yes", "-t", "1.0", "--seed", "3", "-n", "400", "--ctx", "8192")
    r = quipu("run", *args, "--json", "-S", "w", "What is the weather in Paris?")
    assert r.returncode == 0, r.stderr.decode()
    out = json.loads(r.stdout)
    first = out["tool_calls"][0]
    assert first["name"] == "get_weather" and first["arguments"]["city"] in ("Paris", "Rome")
    assert json.loads(first["result"]) == {"city": first["arguments"]["city"][:3], "temperature": 21,
                                           "unit": first["arguments"].get("unit", "C")}
    saved = transcript(home, "w")["messages"]
    calls = [m for m in saved if m["role"] == "assistant" and m.get("tool_calls")]
    results = [m for m in saved if m["role"] == "tool"]
    assert calls[0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert results[0]["content"] == first["result"] and results[0]["tool_call_id"] == first["id"]
    assert saved[-1]["role"] == "assistant"  # the model went on after the result
    # The markup of a call never reaches stdout.
    plain = quipu("run", *args, "What is the weather in Paris?")
    assert plain.returncode == 0, plain.stderr.decode()
    for markup in ("<tool_call>", "[TOOL_CALLS]", '"parameters"', '"arguments"', "get_weather"):
        assert markup not in plain.stdout.decode()


def test_the_result_is_read_as_new_tokens_only(make_backend):
    # After a call, only the result and the template's few tokens around it are read again.
    from quipu.sessions.conversation import Conversation
    from quipu.sessions.inference import InferenceSession
    from quipu.sessions.params import SamplingParams
    from quipu.sessions.toolspec import ToolSpec

    backend = make_backend(n_ctx=2048)
    session = InferenceSession(backend, SamplingParams(seed=3, temperature=1.0))
    conv = Conversation.start(session, template=(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text())
    conv.update(tools=[ToolSpec("get_weather", "w", {"type": "object", "properties": {"city": {"enum": ["Paris"]}},
                                                     "required": ["city"], "additionalProperties": False})])
    conv.update(tool_choice="required")
    gen = conv.send("weather?", max_tokens=800)
    assert gen.finish_reason == "stop" and {c.name for c in gen.tool_calls} == {"get_weather"}
    assert all(c.arguments == {"city": "Paris"} for c in gen.tool_calls)
    held = len(session.tokens)
    conv.add_tool_results([(call, "sunny") for call in gen.tool_calls])
    conv.update(tool_choice="auto")
    conv.reply_to_tools(max_tokens=4)
    # (The tiny model ends a reply with </s>, where the template writes <|im_end|>: that one token.)
    assert session.stats.cached_tokens >= held - 1


def test_a_call_begins_where_the_model_writes_its_trigger(make_backend):
    # With tool_choice auto nothing is constrained until the model writes `<tool_call>`; from
    # there the call keeps to the tools' schema, and none of it reaches the sink.
    import numpy as np

    from quipu.sessions.base import ReplySink
    from quipu.sessions.conversation import Conversation
    from quipu.sessions.inference import InferenceSession
    from quipu.sessions.params import SamplingParams
    from quipu.sessions.toolspec import ToolSpec

    backend = make_backend(n_ctx=2048)
    session = InferenceSession(backend, SamplingParams(seed=5, temperature=1.0))
    conv = Conversation.start(session, template=(TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text())
    conv.update(tools=[ToolSpec("lookup", "l", {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1,
                                                                                      "maximum": 9}},
                                                "required": ["n"], "additionalProperties": False})])
    wanted = backend.vocab.tokenize("Sure.<tool_call>", add_special=False, parse_special=True)
    if backend.vocab.token_text(wanted[0]) == b" ":
        wanted = wanted[1:]
    forced = []

    def write_the_trigger(tokens, logits):  # the model "decides" to call: its first tokens forced
        if len(forced) < len(wanted):
            logits[:] = -np.inf
            logits[wanted[len(forced)]] = 0.0
            forced.append(1)

    session.logits_processors.append(write_the_trigger)

    class Seen(ReplySink):
        def __init__(self):
            self.shown = ""

        def text(self, piece):
            self.shown += piece

    seen = Seen()
    gen = conv.send("look it up", max_tokens=600, sink=seen)
    assert {c.name for c in gen.tool_calls} == {"lookup"} and all(1 <= c.arguments["n"] <= 9 for c in gen.tool_calls)
    assert seen.shown == "Sure." and gen.answer == "Sure."


@pytest.mark.model
def test_smollm2_calls_a_function_when_it_is_required(quipu, tmp_path):
    fns = write(tmp_path, FUNCTIONS)
    r = quipu("run", "--functions", fns, "--tool-choice", "required", "--yes", "--json", "-t", "0", "-n", "80",
              "What is the weather in Paris?")
    assert r.returncode == 0, r.stderr.decode()
    out = json.loads(r.stdout)
    assert "no tool-call format quipu knows" in r.stderr.decode()  # SmolLM2's template has no tools path
    assert out["tool_calls"][0]["name"] in ("get_weather", "distance")
    assert out["tool_calls"][0]["result"] and out["finish_reason"] in ("stop", "length")


def test_a_call_the_caller_runs_stops_the_turn_and_its_result_resumes_it_exactly(quipu, tiny_model, tmp_path,
                                                                                 home):
    # --tools FILE.json: the reply stops at the call; `--tool-result` gives what it returned and
    # the model goes on. With the same seed that is the very loop --functions runs in one go.
    from quipu.app.functions import functions_from_files

    fns = write(tmp_path)
    tools, _, worker = functions_from_files([fns])
    worker.close()
    specs = [t.spec.to_openai() for t in tools]
    (tmp_path / "tools.json").write_text(json.dumps(specs))
    common = ("-m", tiny_model, "--chat-template", str(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"),
              "--tool-choice", "get_weather", "-t", "1.0", "--seed", "11", "-n", "400", "--json")
    whole = json.loads(quipu("run", *common, "--functions", fns, "--yes", "-S", "whole", "Weather?").stdout)
    stopped = json.loads(quipu("run", *common, "--tools", str(tmp_path / "tools.json"), "-S", "half",
                               "Weather?").stdout)
    assert stopped["finish_reason"] == "tool_calls" and "result" in stopped["tool_calls"][0]
    call = stopped["tool_calls"][0]
    assert call["result"] is None and call["arguments"] == whole["tool_calls"][0]["arguments"]
    result = whole["tool_calls"][0]["result"]
    resumed = quipu("run", "-S", "half", "--json", "--tool-result", f"{call['id']}={result}")
    assert resumed.returncode == 0, resumed.stderr.decode()
    assert json.loads(resumed.stdout)["text"] == whole["text"]
    assert transcript(home, "half")["tokens"] == transcript(home, "whole")["tokens"]
    assert transcript(home, "half")["tools"] == specs  # definitions only: nothing that runs them


def test_with_no_terminal_and_no_yes_a_call_is_refused_and_the_model_told(quipu, tiny_model, tmp_path, home):
    fns = write(tmp_path)
    r = quipu("run", "-m", tiny_model, "--chat-template", str(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"),
              "--functions", fns, "--tool-choice", "get_weather", "-S", "no", "-n", "400", "Weather?")
    assert r.returncode == 0, r.stderr.decode()
    assert "refused get_weather: no terminal to ask and no --yes" in r.stderr.decode()
    told = [m for m in transcript(home, "no")["messages"] if m["role"] == "tool"]
    assert told and "did not approve" in told[0]["content"]


def test_undo_after_a_loop_leaves_the_context_as_before_it(make_backend):
    from quipu.sessions.conversation import Conversation
    from quipu.sessions.inference import InferenceSession
    from quipu.sessions.params import SamplingParams
    from quipu.sessions.toolspec import ToolSpec

    session = InferenceSession(make_backend(n_ctx=2048), SamplingParams(seed=2, temperature=1.0))
    conv = Conversation.start(session, template=(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text())
    conv.update(tools=[ToolSpec("f", "", {"type": "object", "properties": {}, "additionalProperties": False})])
    conv.update(tool_choice="none")
    end = session.backend.vocab.tokenize("<|im_end|>", add_special=False, parse_special=True)[-1]

    def answer_at_once(tokens, logits):  # a first exchange that ends as the template ends it
        logits[:] = float("-inf")
        logits[end] = 0.0

    session.logits_processors.append(answer_at_once)
    conv.send("hello", max_tokens=8)
    session.logits_processors.clear()
    before, messages = list(session.tokens), len(conv.messages)
    conv.update(tool_choice="required")
    gen = conv.send("call it", max_tokens=400)
    conv.add_tool_results([(gen.tool_calls[0], "done")])
    conv.update(tool_choice="auto")
    conv.reply_to_tools(max_tokens=8)
    assert conv.undo()
    assert session.tokens == before and len(conv.messages) == messages


@pytest.mark.parametrize("case, words", [
    ("raises", "error: ValueError: no such city"),
    ("hangs", "error: the tool did not answer within 1 s"),
])
def test_a_tool_that_fails_gives_its_error_to_the_model(quipu, tiny_model, tmp_path, home, case, words):
    body = {"raises": "raise ValueError('no such city')", "hangs": "import time; time.sleep(30)"}[case]
    fns = write(tmp_path, "from typing import Literal\n\n\ndef get_weather(city: Literal['Paris']) -> str:\n"
                          f"    \"\"\"Weather.\"\"\"\n    {body}\n")
    r = quipu("run", "-m", tiny_model, "--chat-template", str(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"),
              "--functions", fns, "--tool-choice", "required", "--yes", "--tool-timeout", "1", "-S", "f", "-n", "400",
              "--json", "-t", "0", "Weather?")
    assert r.returncode == 0, r.stderr.decode()
    told = [m for m in transcript(home, "f")["messages"] if m["role"] == "tool"]
    assert told and told[0]["content"].startswith(words)
    assert ("error: " + json.loads(r.stdout)["tool_calls"][0]["error"]).startswith(words)


@pytest.mark.parametrize("files, args, words", [
    ({"bad.py": "def f(:\n"}, ["--functions", "bad.py"], "does not import (line 1): SyntaxError"),
    ({"boom.py": "x = 1\nraise RuntimeError('no')\n"}, ["--functions", "boom.py"], "does not import (line 2)"),
    ({"none.py": "X = 1\n"}, ["--functions", "none.py"], "defines no public function"),
    ({"a.py": "def f(x: int): return x\n", "b.py": "def f(y: str): return y\n"},
     ["--functions", "a.py", "--functions", "b.py"], "two tools are named 'f': in a.py and in b.py"),
    ({"t.json": "[{\"type\": \"function\""}, ["--tools", "t.json"], "is not valid JSON"),
    ({"t.json": "[{\"type\": \"function\", \"function\": {}}]"}, ["--tools", "t.json"], "tool 0 of"),
    ({"a.py": "def f(x: int): return x\n"}, ["--functions", "a.py", "--schema", "{}"], "not both"),
    ({"a.py": "def f(x: int): return x\n"}, ["--functions", "a.py", "--tool-choice", "g"], "not 'g'"),
    ({"a.py": "def f(x: int): return x\n"}, ["--functions", "a.py", "--chain-limit", "0"], "--chain-limit must be"),
    ({}, ["--tool-result", "x=1"], "--tool-result cannot be used with a one-shot run (-S NAME goes on"),
    ({}, ["--continue"], "--continue cannot be used with a one-shot run"),
])
def test_bad_tools_are_one_line_usage_errors(quipu, tiny_model, tmp_path, files, args, words):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    given = [str(tmp_path / a) if a in files else a for a in args]
    r = quipu("run", "-m", tiny_model, *given, "hi")
    err = r.stderr.decode()
    assert r.returncode == 2 and words in err and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_a_tool_result_for_a_call_never_made_is_refused(quipu, tiny_model, tmp_path, home):
    (tmp_path / "t.json").write_text(json.dumps([{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}]))
    common = ("-m", tiny_model, "--chat-template", str(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"))
    r = quipu("run", *common, "--tools", str(tmp_path / "t.json"), "--tool-choice", "required", "-S", "s", "--json",
              "-n", "400", "go")
    call = json.loads(r.stdout)["tool_calls"][0]
    bad = quipu("run", "-S", "s", "--tool-result", "nope=1")
    err = bad.stderr.decode()
    assert bad.returncode == 2 and "'nope', which the last reply did not call" in err and call["id"] in err
    missing = quipu("run", "-S", "s", "--tool-result", f"{call['id']}=1", "--tool-result", f"{call['id']}x=2")
    assert missing.returncode == 2
    twice = quipu("run", "-S", "s", "--tool-result", f"{call['id']}=1", "--tool-result", f"{call['id']}=2")
    err = twice.stderr.decode()
    assert twice.returncode == 2 and f"gives '{call['id']}' twice" in err and "(it called: )" not in err, err


def test_a_function_s_type_hints_become_its_schema(tmp_path):
    from quipu.app.functions import functions_from_files

    untyped = FUNCTIONS + "\ndef shout(text, times: int = 2):\n    return text * times\n"
    tools, notices, worker = functions_from_files([write(tmp_path, untyped)])
    by_name = {t.spec.name: t for t in tools}
    assert set(by_name) == {"get_weather", "distance", "shout"}
    weather = by_name["get_weather"].spec
    assert weather.description == "The weather in a city, today."
    assert weather.parameters["properties"]["unit"] == {"enum": ["C", "F"], "default": "C"}
    assert weather.parameters["required"] == ["city"]
    place = by_name["distance"].spec.parameters["properties"]["a"]
    assert place["properties"]["country"] == {"anyOf": [{"type": "string"}, {"type": "null"}]}
    assert place["required"] == ["city"]
    assert by_name["distance"].spec.parameters["properties"]["roads"]["items"] == {"type": "string"}
    assert by_name["shout"].spec.parameters["properties"]["text"] == {"type": "string"}
    assert notices == ["fns.py: shout(text) has no type hint; the model gives it as a string"]
    # The model's JSON arguments reach the function as its hints ask: a dataclass from an object.
    try:
        out = by_name["distance"].run({"a": {"city": "Paris"}, "b": {"city": "Rome"}}, 60, lambda: False)
    finally:
        worker.close()
    assert out.text == "42.0"
    for tool in tools:
        jsonschema.Draft202012Validator.check_schema(tool.spec.parameters)


def mcp_config(tmp_path, **extra) -> str:
    import sys

    server = {"command": sys.executable, "args": [str(Path(__file__).parent / "mcp_server.py")], **extra}
    (tmp_path / "mcp.json").write_text(json.dumps({"mcpServers": {"demo": server}}))
    return str(tmp_path / "mcp.json")



@pytest.mark.parametrize("tool, words, seed", [
    ("demo_add", None, 2),
    ("demo_crash", "error: the MCP server 'demo' died", 3),  # (a draw whose call ends within -n: the model is random)
])
def test_an_mcp_server_s_tools_are_called_over_stdio(quipu, tiny_model, tmp_path, home, tool, words, seed):
    r = quipu("run", "-m", tiny_model, "--chat-template", str(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"),
              "--mcp", "demo", "--mcp-config", mcp_config(tmp_path), "--tool-choice", tool, "--yes", "--json",
              "-S", "m", "-n", "400", "-t", "1.0", "--seed", str(seed), "Use the tool.")
    assert r.returncode == 0, r.stderr.decode()
    call = json.loads(r.stdout)["tool_calls"][0]
    told = [m for m in transcript(home, "m")["messages"] if m["role"] == "tool"][0]["content"]
    if words is None:
        assert call["name"] == "demo_add" and call["result"] == str(call["arguments"]["a"] + call["arguments"]["b"])
        assert told == call["result"]
    else:
        assert told.startswith(words) and call["error"]


def test_an_image_an_mcp_tool_returns_reaches_a_text_model_as_a_short_note(quipu, tiny_model, tmp_path, home):
    r = quipu("run", "-m", tiny_model, "--chat-template", str(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"),
              "--mcp", "demo", "--mcp-config", mcp_config(tmp_path), "--tool-choice", "demo_picture", "--yes",
              "--json", "-S", "m", "-n", "400", "-t", "1.0", "--seed", "2", "Show me.")
    assert r.returncode == 0, r.stderr.decode()
    told = [m for m in transcript(home, "m")["messages"] if m["role"] == "tool"][0]["content"]
    assert re.fullmatch(r"\[image: PNG, \d+ B\]", told) and "iVBOR" not in told


def test_an_mcp_server_s_tools_may_be_named_as_the_config_says(quipu, tiny_model, tmp_path, home):
    import sys

    config = home / "config" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(f'[mcp.calc]\ncommand = {json.dumps(sys.executable)}\n'
                      f'args = [{json.dumps(str(Path(__file__).parent / "mcp_server.py"))}]\nprefix = ""\n')
    r = quipu("run", "-m", tiny_model, "--chat-template", str(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"),
              "--mcp", "calc", "--tool-choice", "add", "--yes", "--json", "-n", "400", "-t", "1.0", "--seed", "2",
              "Add.")
    assert r.returncode == 0, r.stderr.decode()
    call = json.loads(r.stdout)["tool_calls"][0]
    assert call["name"] == "add" and call["result"] == str(call["arguments"]["a"] + call["arguments"]["b"])


def test_an_mcp_server_that_never_answers_times_out(quipu, tiny_model, tmp_path, home):
    r = quipu("run", "-m", tiny_model, "--chat-template", str(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"),
              "--mcp", "demo", "--mcp-config", mcp_config(tmp_path, timeout=1), "--tool-choice", "demo_stall",
              "--yes", "-S", "m", "-n", "400", "--json", "-t", "1.0", "--seed", "2", "Use the tool.")
    assert r.returncode == 0, r.stderr.decode()
    told = [m for m in transcript(home, "m")["messages"] if m["role"] == "tool"][0]["content"]
    assert told == "error: the MCP server 'demo' did not answer within 1 s"


def test_an_mcp_server_from_the_config_that_cannot_start_is_one_line(quipu, tiny_model, home):
    config = home / "config" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text('[mcp.broken]\ncommand = "/no/such/server"\n\n[mcp.dies]\ncommand = "false"\n')
    for name, words in (("broken", "the MCP server 'broken' did not start"),
                        ("dies", "the MCP server 'dies' did not start"), ("nope", "no MCP server named 'nope'")):
        r = quipu("run", "-m", tiny_model, "--mcp", name, "hi")
        err = r.stderr.decode()
        assert r.returncode in (1, 2) and words in err and len(err.splitlines()) == 1, err


MESSAGES = [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call12345", "type": "function", "function": {
        "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": "{\"temperature\": 21}"},
]


def test_messages_from_a_file_are_the_conversation_a_run_goes_on_from(quipu, tiny_model, tmp_path, make_backend):
    from chat_reference import reference_tokens, render_reference

    (tmp_path / "m.json").write_text(json.dumps(MESSAGES))
    template = TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"
    args = ("-m", tiny_model, "--chat-template", str(template), "--messages", str(tmp_path / "m.json"))
    shown = quipu("run", *args, "--show-prompt", "--json")
    assert shown.returncode == 0, shown.stderr.decode()
    wire = [dict(m) for m in MESSAGES]
    wire[2] = {**wire[2], "tool_calls": [{**wire[2]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]}
    backend = make_backend(n_ctx=1024)
    expected = render_reference(template.read_text(), wire, add_generation_prompt=True,
                                bos_token=backend.vocab.special_token_text("bos"), eos_token=backend.vocab.special_token_text("eos"))
    assert json.loads(shown.stdout)["tokens"] == reference_tokens(backend, expected)
    reply = quipu("run", *args, "-n", "5", "--json")
    assert reply.returncode == 0 and json.loads(reply.stdout)["usage"]["completion_tokens"] >= 1
    more = quipu("run", *args, "-n", "5", "--json", "And in Rome?")  # a prompt is the next user message
    assert more.returncode == 0 and "Rome" in quipu("run", *args, "--show-prompt", "And in Rome?").stdout.decode()
    (tmp_path / "bad.json").write_text('[{"role": "robot", "content": "x"}]')
    bad = quipu("run", "-m", tiny_model, "--messages", str(tmp_path / "bad.json"))
    assert bad.returncode == 2 and "messages[0].role is not" in bad.stderr.decode()
    with_session = quipu("run", *args, "-S", "x")
    assert with_session.returncode == 2 and "--session cannot be used with --messages" in with_session.stderr.decode()
    with_results = quipu("run", *args, "--tool-result", "x=1")  # (the results go in the file's messages)
    assert with_results.returncode == 2 and "--tool-result cannot be used with --messages" in with_results.stderr.decode()


CONSTRAINED_FAMILIES = {
    "hermes": "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use", "qwen3": "Qwen-Qwen3-0.6B",
    "qwen3-coder": "Qwen3-Coder", "qwen3.5": "Qwen3.5-4B", "llama3.1": "meta-llama-Llama-3.1-8B-Instruct",
    "mistral-nemo": "mistralai-Mistral-Nemo-Instruct-2407", "mistral-small-3.2": "Mistral-Small-3.2-24B-Instruct-2506",
    "command-r7b": "CohereForAI-c4ai-command-r7b-12-2024-tool_use", "deepseek-v3.1": "deepseek-ai-DeepSeek-V3.1", "functionary-v3.1": "meetkai-functionary-medium-v3.1",
    "functionary-v3.2": "meetkai-functionary-medium-v3.2", "gpt-oss": "openai-gpt-oss-120b", "granite-3.3": "ibm-granite-granite-3.3-2B-Instruct",
    "granite-4": "ibm-granite-granite-4.0", "kimi-k2": "moonshotai-Kimi-K2", "glm-4.6": "GLM-4.6",
    "glm-4.7": "GLM-4.7-Flash", "lfm2": "LFM2-8B-A1B", "lfm2.5": "LFM2.5-8B-A1B",
}


@pytest.mark.parametrize("family", CONSTRAINED_FAMILIES)
def test_a_required_call_keeps_to_the_tool_s_schema_in_every_constrained_format(make_backend, tmp_path, family):
    # The random tiny model, under the call's grammar, writes a call that parses in the family's
    # own format, names the tool and keeps to its schema: every seed. Its vocabulary has the
    # families' markup as special tokens, as theirs do, which the grammar writes as those tokens.
    # The call renders back to the very text it was written as, so the next turn reads the
    # result alone. (Where the prompt opens reasoning, the model reasons first: a bias on
    # `</think>` ends that soon.)
    from tinymodel import write_tiny_gguf

    from quipu.sessions.conversation import Conversation
    from quipu.sessions.inference import InferenceSession
    from quipu.sessions.params import SamplingParams
    from quipu.sessions.toolspec import ToolSpec

    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                               "note": {"type": "string", "maxLength": 6}},
              "required": ["city"], "additionalProperties": False}
    backend = make_backend(write_tiny_gguf(tmp_path / "tools.gguf", tool_specials=True, tokenizer="bpe"), n_ctx=8192)
    source = (TEMPLATES / f"{CONSTRAINED_FAMILIES[family]}.jinja").read_text()
    close = backend.vocab.special_tokens()["</think>"]
    for seed in range(3):
        session = InferenceSession(backend, SamplingParams(seed=seed, temperature=1.0, logit_bias=[(close, 6.0)]))
        conv = Conversation.start(session, template=source)
        conv.update(tools=[ToolSpec("get_weather", "The weather.", schema)], tool_choice="required")
        gen = conv.send("What is the weather?", max_tokens=600)
        reply = session.tokens[session.reply_start:]
        assert gen.tool_calls, (family, seed, session.spell(reply))
        spelled = session.spell(reply)
        for text, ident in session.special_tokens().items():  # markup is its token, never spelled out
            assert spelled.count(text) == reply.count(ident), (family, text)
        for call in gen.tool_calls:
            assert call.name == "get_weather"
            jsonschema.validate(call.arguments, schema)
        fmt = conv.reasoning
        thinking = fmt is not None and fmt.starts_inside(session.spell(session.tokens[:session.reply_start]))
        held, start = len(session.tokens), session.reply_start
        if thinking:  # the model reasoned first; the call came once its reasoning ended
            assert "</think>" in spelled and spelled.index("</think>") < spelled.index(gen.tool_calls[0].name)
        conv.add_tool_results([(call, "sunny") for call in gen.tool_calls])
        conv.update(tool_choice="auto")
        conv.reply_to_tools(max_tokens=2)
        # (The model's end-of-reply token may not be the template's: that one token. A template
        # that writes reasoning its own way, Qwen 3.5's new lines around it, reads the reply again
        # unless the model wrote them so, as a real one does and this random one need not.)
        assert session.stats.cached_tokens >= (start if thinking else held - 1), (family, seed, spelled)


def test_a_required_call_after_reasoning_comes_even_from_a_model_that_would_end_its_reply(make_backend, tmp_path):
    # Qwen 3.5's prompt opens the reasoning; the model, pushed hard toward ending its reply,
    # may not end it inside the reasoning: once it closes it, the call comes.
    from tinymodel import write_tiny_gguf

    from quipu.sessions.conversation import Conversation
    from quipu.sessions.inference import InferenceSession
    from quipu.sessions.params import SamplingParams
    from quipu.sessions.toolspec import ToolSpec

    backend = make_backend(write_tiny_gguf(tmp_path / "tools.gguf", tool_specials=True, tokenizer="bpe"), n_ctx=4096)
    specials = backend.vocab.special_tokens()
    ends = [t for t in specials.values() if backend.vocab.is_eog(t)]
    bias = [(t, 12.0) for t in ends] + [(specials["</think>"], 4.0)]
    session = InferenceSession(backend, SamplingParams(seed=5, temperature=1.0, logit_bias=bias))
    conv = Conversation.start(session, template=(TEMPLATES / "Qwen3.5-4B.jinja").read_text())
    conv.update(tools=[ToolSpec("get_weather", "w", {"type": "object", "properties": {"city": {"enum": ["Paris"]}},
                                                     "required": ["city"]})])
    conv.update(tool_choice="required")
    gen = conv.send("Weather?", max_tokens=400)
    spelled = session.spell(session.tokens[session.reply_start:])
    assert [c.arguments for c in gen.tool_calls] == [{"city": "Paris"}] * len(gen.tool_calls) and gen.tool_calls, spelled
    assert spelled.index("</think>") < spelled.index("<tool_call>")


def _stopped_at_approval(quipu, common, home, name):
    """A run whose loop stopped at its approval ("s"): the session's last reply has calls waiting."""
    import os
    import sys

    import pexpect

    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ.update(QUIPU_HOME=str(home), TERM="xterm")
    child = pexpect.spawn(sys.executable, ["-m", "quipu", "run", *common, "--tool-choice", "get_weather", "-S", name,
                                           "Weather?"], env=environ, encoding="utf-8", timeout=120)
    child.expect(r"\[s\]top here: ")
    child.sendline("s")
    child.expect(pexpect.EOF)
    child.close()
    assert transcript(home, name)["messages"][-1]["tool_calls"]
    return environ


def test_a_loop_stopped_at_its_approval_resumes_in_a_new_process_as_if_never_stopped(quipu, tiny_model, tmp_path,
                                                                                     home):
    # On a terminal the approval is asked; "stop" leaves the calls waiting in the session. The
    # next run with the tools (and no prompt) runs them and goes on: the very tokens of a loop
    # that never stopped, with the same seed; so does a chat on the session, which says calls
    # wait, with /continue. A new message instead answers each "not run".
    import sys

    import pexpect

    fns = write(tmp_path)
    common = ["-m", str(tiny_model), "--chat-template", str(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"),
              "--functions", fns, "-t", "1.0", "--seed", "13", "-n", "400"]
    whole = quipu("run", *common, "--tool-choice", "get_weather", "--yes", "--json", "-S", "whole", "Weather?")
    assert whole.returncode == 0, whole.stderr.decode()
    _stopped_at_approval(quipu, common, home, "half")
    assert transcript(home, "half")["messages"][-1]["role"] == "assistant"
    resumed = quipu("run", "-S", "half", "--functions", fns, "--yes", "--json")
    assert resumed.returncode == 0, resumed.stderr.decode()
    assert json.loads(resumed.stdout)["text"] == json.loads(whole.stdout)["text"]
    assert transcript(home, "half")["tokens"] == transcript(home, "whole")["tokens"]
    nothing = quipu("run", "-S", "half", "--functions", fns, "--yes")
    assert nothing.returncode == 2 and "has no calls waiting to run" in nothing.stderr.decode()

    environ = _stopped_at_approval(quipu, common, home, "in-chat")
    environ["PROMPT_TOOLKIT_NO_CPR"] = "1"
    child = pexpect.spawn(sys.executable, ["-m", "quipu", "chat", "-S", "in-chat", "--functions", fns, "-n", "400"],
                          env=environ, encoding="utf-8", dimensions=(30, 200), timeout=120)
    child.expect("wait to run \\(get_weather\\): /continue runs them")
    child.expect("›")
    child.send("/continue\r")
    child.expect(r"\[s\]top here:")
    child.send("a\r")  # (always: the loop goes on for rounds, as the run with --yes did)
    child.expect("›")
    child.sendeof()
    child.expect(pexpect.EOF)
    assert transcript(home, "in-chat")["tokens"] == transcript(home, "whole")["tokens"]

    _stopped_at_approval(quipu, common, home, "passed")
    went_on = quipu("run", "-S", "passed", "-n", "5", "And Rome?")
    assert went_on.returncode == 0, went_on.stderr.decode()
    messages = transcript(home, "passed")["messages"]
    answered = [m for m in messages if m["role"] == "tool"]
    assert answered and all("not run" in m["content"] for m in answered)
    assert messages[-2] == {**messages[-2], "role": "user", "content": "And Rome?"}
    assert messages[-3]["role"] == "tool"


def test_sessions_show_and_export_show_the_calls_and_results(quipu, tiny_model, tmp_path, home):
    fns = write(tmp_path)
    r = quipu("run", "-m", tiny_model, "--chat-template", str(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"),
              "--functions", fns, "--tool-choice", "get_weather", "--yes", "-S", "shown", "-n", "400", "--seed", "3",
              "-t", "1.0", "Weather?")
    assert r.returncode == 0, r.stderr.decode()
    shown = quipu("sessions", "show", "shown").stdout.decode()
    assert '→ get_weather({"city": ' in shown and "tool (get_weather)" in shown and '"temperature": 21' in shown
    markdown = quipu("sessions", "export", "shown", "--format", "markdown").stdout.decode()
    assert "Calls `get_weather(" in markdown and "## Tool result (get_weather)" in markdown
    exported = json.loads(quipu("sessions", "export", "shown", "--format", "json").stdout)
    assert any(m.get("tool_calls") for m in exported["messages"]) and any(m["role"] == "tool"
                                                                         for m in exported["messages"])


def test_a_call_cut_short_is_shown_and_kept_as_text(quipu, tiny_model, tmp_path, home):
    fns = write(tmp_path)
    r = quipu("run", "-m", tiny_model, "--chat-template", str(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"),
              "--functions", fns, "--tool-choice", "get_weather", "-S", "cut", "-n", "12", "Weather?")
    assert r.returncode == 0, r.stderr.decode()
    kept = transcript(home, "cut")["messages"][-1]
    assert not kept.get("tool_calls") and '{"name": "g' in kept["content"]
    assert '{"name": "g' in r.stdout.decode()  # never dropped: what came is on stdout too
