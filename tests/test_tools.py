"""Tool calls in each family's own format: the format found from the template, and raw replies
read into content, reasoning and calls (`quipu.sessions.tools.parse_reply`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quipu.sessions.tools import format_of, parse_reply
from quipu.sessions.toolspec import ToolCall

TEMPLATES = Path(__file__).parent / "templates"

# Arguments that a careless parser breaks: quotes, a new line, non-ASCII, nesting.
HARD = {"text": 'say "hi"\nthen «bye» 日本', "n": 2, "opts": {"deep": [1, {"a": None}]}}
EASY = {"city": "Paris"}


def j(value) -> str:
    return json.dumps(value, ensure_ascii=False)


# Each family: its template, and how its replies spell calls (a list of (name, arguments)).
FAMILIES = {
    "hermes": ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
               lambda calls: "".join(f"<tool_call>\n{j({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)),
    "qwen3": ("Qwen-Qwen3-0.6B",
              lambda calls: "\n".join(f"<tool_call>\n{j({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)),
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct",
                lambda calls: "\n".join(f"<tool_call>\n{j({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)),
    "qwen3-coder": ("Qwen3-Coder", lambda calls: "\n".join(
        "<tool_call>\n<function=" + n + ">\n" + "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else j(v)}\n</parameter>\n" for k, v in a.items())
        + "</function>\n</tool_call>" for n, a in calls)),
    "qwen3.5": ("Qwen3.5-4B", lambda calls: "\n".join(
        "<tool_call>\n<function=" + n + ">\n" + "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else j(v)}\n</parameter>\n" for k, v in a.items())
        + "</function>\n</tool_call>" for n, a in calls)),
    "llama3.1": ("meta-llama-Llama-3.1-8B-Instruct",
                 lambda calls: j({"name": calls[0][0], "parameters": calls[0][1]}) if len(calls) == 1 else None),
    "llama3.3": ("meta-llama-Llama-3.3-70B-Instruct",
                 lambda calls: j({"name": calls[0][0], "parameters": calls[0][1]}) if len(calls) == 1 else None),
    "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407", lambda calls: "[TOOL_CALLS]" + j(
        [{"name": n, "arguments": a, "id": f"abcdefgh{i}"} for i, (n, a) in enumerate(calls)])),
    "mistral-small-3.2": ("Mistral-Small-3.2-24B-Instruct-2506",
                          lambda calls: "".join(f"[TOOL_CALLS]{n}[ARGS]{j(a)}" for n, a in calls)),
    "devstral": ("unsloth-mistral-Devstral-Small-2507",
                 lambda calls: "".join(f"[TOOL_CALLS]{n}[CALL_ID]id{i}[ARGS]{j(a)}" for i, (n, a) in enumerate(calls))),
    "command-r7b": ("CohereForAI-c4ai-command-r7b-12-2024-tool_use", lambda calls: "<|START_ACTION|>" + j(
        [{"tool_call_id": str(i), "tool_name": n, "parameters": a} for i, (n, a) in enumerate(calls)])
        + "<|END_ACTION|>"),
    "deepseek-r1": ("llama-cpp-deepseek-r1", lambda calls: "<｜tool▁calls▁begin｜>" + "".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{j(a)}\n```<｜tool▁call▁end｜>" for n, a in calls)
        + "<｜tool▁calls▁end｜>"),
    "deepseek-v3.1": ("deepseek-ai-DeepSeek-V3.1", lambda calls: "<｜tool▁calls▁begin｜>" + "".join(
        f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{j(a)}<｜tool▁call▁end｜>" for n, a in calls) + "<｜tool▁calls▁end｜>"),
    "functionary-v3.1": ("meetkai-functionary-medium-v3.1",
                         lambda calls: "".join(f"<function={n}>{j(a)}</function>" for n, a in calls)),
    "functionary-v3.2": ("meetkai-functionary-medium-v3.2",
                         lambda calls: ">>>".join(f"{n}\n{j(a)}" for n, a in calls)),
    "firefunction-v2": ("fireworks-ai-llama-3-firefunction-v2", lambda calls: " functools" + j(
        [{"name": n, "arguments": a} for n, a in calls])),
    "gpt-oss": ("openai-gpt-oss-120b", lambda calls: "".join(
        f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{j(a)}<|call|>" for n, a in calls)),
    "granite-3.3": ("ibm-granite-granite-3.3-2B-Instruct", lambda calls: "<|tool_call|>" + j(
        [{"name": n, "arguments": a} for n, a in calls])),
    "granite-4": ("ibm-granite-granite-4.0",
                  lambda calls: "".join(f"<tool_call>\n{j({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)),
    "lfm2": ("LFM2-8B-A1B", lambda calls: "<|tool_call_start|>[" + ", ".join(
        f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")" for n, a in calls) + "]<|tool_call_end|>"),
    "kimi-k2": ("moonshotai-Kimi-K2", lambda calls: "<|tool_calls_section_begin|>" + "".join(
        f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{j(a)}<|tool_call_end|>"
        for i, (n, a) in enumerate(calls)) + "<|tool_calls_section_end|>"),
    "glm": ("GLM-4.6", lambda calls: "".join(
        f"<tool_call>{n}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else j(v)}"
                                      "</arg_value>\n" for k, v in a.items()) + "</tool_call>" for n, a in calls)),
    "glm-4.7": ("GLM-4.7-Flash", lambda calls: "".join(
        f"<tool_call>{n}" + "".join(f"<arg_key>{k}</arg_key><arg_value>{v if isinstance(v, str) else j(v)}"
                                    "</arg_value>" for k, v in a.items()) + "</tool_call>" for n, a in calls)),
    "lfm2.5": ("LFM2.5-8B-A1B", lambda calls: "<|tool_call_start|>[" + ", ".join(  # (a dict's values in JSON)
        f"{n}(" + ", ".join(f"{k}={j(v) if isinstance(v, dict) else repr(v)}" for k, v in a.items()) + ")"
        for n, a in calls) + "]<|tool_call_end|>"),
}
# Where a family writes text before a call its own way.
BEFORE = {"functionary-v3.2": lambda text, calls: f"all\n{text}>>>" + calls,
          "gpt-oss": lambda text, calls: f"<|channel|>final<|message|>{text}<|end|><|start|>assistant" + calls}
NO_TEXT_BEFORE = {"llama3.1", "llama3.3"}  # the whole reply is the call
PARALLEL = set(FAMILIES) - {"llama3.1", "llama3.3"}


def template(family: str) -> str:
    return (TEMPLATES / f"{FAMILIES[family][0]}.jinja").read_text()


def calls_of(reply) -> list[tuple[str, dict]]:
    return [(c.name, c.arguments) for c in reply.tool_calls]


@pytest.mark.parametrize("family", FAMILIES)
def test_one_call(family):
    spell = FAMILIES[family][1]
    for args in (EASY, HARD):
        if family == "lfm2" and args is HARD:
            args = {"text": HARD["text"], "n": 2}  # (Python literals: no null)
        reply = parse_reply(template(family), spell([("get_weather", args)]))
        assert calls_of(reply) == [("get_weather", args)] and reply.content == "", (family, reply)


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - NO_TEXT_BEFORE))
def test_text_then_a_call(family):
    spell = FAMILIES[family][1]
    calls = spell([("lookup", EASY)])
    text = BEFORE[family]("Let me check.", calls) if family in BEFORE else "Let me check.\n" + calls
    reply = parse_reply(template(family), text)
    assert calls_of(reply) == [("lookup", EASY)] and reply.content == "Let me check.", (family, reply)


@pytest.mark.parametrize("family", sorted(PARALLEL))
def test_two_calls(family):
    spell = FAMILIES[family][1]
    reply = parse_reply(template(family), spell([("first", {"a": 1}), ("second", {"b": "x"})]))
    assert calls_of(reply) == [("first", {"a": 1}), ("second", {"b": "x"})], (family, reply)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_truncated_call_stays_text(family):
    spell = FAMILIES[family][1]
    whole = spell([("get_weather", {"city": "Paris", "days": 3})])
    cut = whole[: whole.index("Paris") + 3]
    reply = parse_reply(template(family), cut)
    assert reply.tool_calls == [] and reply.content == cut, (family, reply)


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_text_and_reasoning_that_look_like_calls_are_not_calls(family):
    spell = FAMILIES[family][1]
    markup = spell([("get_weather", EASY)])
    plain = "No tools needed; the answer is 42."
    assert parse_reply(template(family), plain).tool_calls == []
    reply = parse_reply(template(family), f"<think>Maybe {markup}? No.</think>{plain}")
    assert reply.tool_calls == [] and reply.content == plain and markup in reply.reasoning, (family, reply)


def test_ids_are_kept_where_the_format_has_them():
    nemo = parse_reply(template("mistral-nemo"), FAMILIES["mistral-nemo"][1]([("f", {})]))
    assert nemo.tool_calls == [ToolCall("f", {}, "abcdefgh0")]
    devstral = parse_reply(template("devstral"), FAMILIES["devstral"][1]([("f", {"a": 1})]))
    assert devstral.tool_calls[0].id == "id0"
    r7b = parse_reply(template("command-r7b"), FAMILIES["command-r7b"][1]([("f", {})]))
    assert r7b.tool_calls[0].id == "0"


def test_llama_3_1_built_in_tools_come_after_the_python_tag():
    reply = parse_reply(template("llama3.1"), '<|python_tag|>brave_search.call(query="weather in Paris")')
    assert calls_of(reply) == [("brave_search", {"query": "weather in Paris"})]


# Every shipped template's tool-call format, as its markup says (one whose markup is none quipu
# knows, or that has no tools path, gets the generic JSON format).
SHIPPED_FORMATS = {
    "command-r7b": ("Cohere2MoE", "CohereForAI-c4ai-command-r7b-12-2024-tool_use"),
    "deepseek-r1": ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
                    "llama-cpp-deepseek-r1"),
    "deepseek-v3": ("deepseek-ai-DeepSeek-V3.1",),
    "firefunction-v2": ("fireworks-ai-llama-3-firefunction-v2",),
    "functionary-v3.1": ("meetkai-functionary-medium-v3.1",),
    "functionary-v3.2": ("meetkai-functionary-medium-v3.2",),
    "generic": ("Apertus-8B-Instruct", "Apriel-1.6-15b-Thinker-fixed",
                "CohereForAI-c4ai-command-r-plus-tool_use", "GigaChat3-10B-A1.8B", "GigaChat3.1-10B-A1.8B",
                "HuggingFaceTB-SmolLM3-3B", "Kimi-K3", "LFM2.5-Instruct", "MiniMax-M1", "MiniMax-M2",
                "NVIDIA-Nemotron-Nano-v2", "deepseek-ai-DeepSeek-V3.2", "deepseek-ai-DeepSeek-V4-Flash-0731",
                "deepseek-ai-DeepSeek-V4", "google-gemma-2-2b-it", "google-gemma-4-31B-it-interleaved",
                "google-gemma-4-31B-it", "llama-cpp-rwkv-world", "microsoft-Phi-3.5-mini-instruct",
                "muse-glimmer", "openbmb-MiniCPM5-1B", "tencent-Hy3", "upstage-Solar-Open-100B"),
    "glm": ("GLM-4.6", "GLM-4.7-Flash", "Spark2.5", "inclusionai-ling-3.0-flash", "poolside-Laguna-S-2.1",
            "poolside-Laguna-XS-2.1", "poolside-Laguna-XS.2"),
    "gpt-oss": ("openai-gpt-oss-120b",),
    "granite": ("ibm-granite-granite-3.3-2B-Instruct",),
    "hermes": ("Bielik-11B-v3.0-Instruct", "MiMo-VL", "MiniMax-M3",
               "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
               "Qwen-QwQ-32B", "Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "Reka-Edge",
               "ibm-granite-granite-4.0", "ibm-granite-granite-4.1", "unsloth-Apriel-1.5"),
    "kimi-k2": ("Kimi-K2-Instruct", "Kimi-K2-Thinking", "moonshotai-Kimi-K2"),
    "lfm2": ("LFM2-8B-A1B", "LFM2.5-8B-A1B"),
    "llama3": ("meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct",
               "meta-llama-Llama-3.3-70B-Instruct"),
    "mistral-args": ("Mistral-Small-3.2-24B-Instruct-2506", "mistralai-Ministral-3-14B-Reasoning-2512",
                     "unsloth-mistral-Devstral-Small-2507"),
    "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407",),
    "qwen3-coder": ("ByteDance-Seed-OSS", "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "Qwen3-Coder", "Qwen3.5-4B",
                    "StepFun3.5-Flash"),
}


def test_every_shipped_template_gets_the_format_its_markup_says():
    found: dict[str, list[str]] = {}
    for path in sorted(TEMPLATES.glob("*.jinja")):
        found.setdefault(format_of(path.read_text()).name, []).append(path.stem)
    assert {name: tuple(stems) for name, stems in found.items()} == SHIPPED_FORMATS
    assert "generic" not in {format_of(template(f)).name for f in FAMILIES}


def test_an_unknown_template_gets_the_generic_json_format():
    fmt = format_of("{{ messages }}")
    assert fmt.generic
    reply = parse_reply("{{ messages }}", '{"tool_call": {"name": "f", "arguments": {"a": 1}}}')
    assert calls_of(reply) == [("f", {"a": 1})]
    assert parse_reply("{{ messages }}", '{"response": "hello"}').content == "hello"


def test_every_format_holds_a_call_to_a_grammar_llguidance_takes():
    # Each shipped template's grammar (its required call's too, where it differs), for one tool
    # and for two, is one llguidance compiles; every format in the table is among them.
    from quipu.engine.constraint import compile_grammar
    from quipu.engine.grammar import Grammar
    from quipu.sessions.tools import FORMATS
    from quipu.sessions.toolspec import ToolSpec

    one = ToolSpec("f", "", {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]})
    two = [one, ToolSpec("g", "", {"type": "object", "properties": {"n": {"type": "integer"}, "b": {"enum": ["x"]}}})]
    assert {f.name for f in FORMATS} <= SHIPPED_FORMATS.keys()
    for path in sorted(TEMPLATES.glob("*.jinja")):
        fmt = format_of(path.read_text())
        assert fmt.call_grammar([]) is None
        for tools in ([one], two):
            grammar = fmt.call_grammar(tools, template=path.read_text())
            assert grammar is not None and grammar.triggers == fmt.triggers, fmt.name
            for lark in filter(None, (grammar.lark, grammar.forced_lark)):
                compile_grammar(Grammar("lark", lark))
