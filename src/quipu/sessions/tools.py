"""Tool calls in each model family's own format, one entry a family (`FORMATS`): how its
template is known, the texts that begin a call, the grammar a call is held to once it begins
(`call_grammars.py`'s builders), and how a reply's calls are read (`call_parsers.py`'s).

How the format is found: by the template's source. Each family's template spells its call
markup literally (`<tool_call>`, `[TOOL_CALLS]`, `<|python_tag|>`, `<｜tool▁sep｜>`, ...), so a
table of those spellings, most specific first, names the format; a template with a tools path
that matches none gets the generic JSON format, with a warning (`Format.generic`). The other
way, rendering the template with and without a call and reading the difference (llama.cpp's
newer parser), needs no table but cannot tell a format's separators from its content; the
table is tested on every shipped template (tests/test_tools.py).

A reply is parsed on its text with control tokens spelled out (`[TOOL_CALLS]` is a control
token in Mistral's vocabulary). Reasoning (in its format, `reasoning.py`'s) is set apart
first: what looks like a call inside reasoning is not one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from quipu.sessions import call_grammars as g
from quipu.sessions import call_parsers as p
from quipu.sessions.call_grammars import CallGrammar
from quipu.sessions.reasoning import BY_DEFAULT, ReasoningFormat
from quipu.sessions.toolspec import ParsedReply, ToolCall, ToolSpec


@dataclass(frozen=True)
class Format:
    """One family's tool-call format: how its template is known, the texts that begin a call,
    the grammar of what follows one, and how its replies are read."""

    name: str
    families: str
    detect: Callable[[str], bool]
    triggers: tuple[str, ...]
    grammar: g.Builder
    parse: Callable[[str], tuple[str, list[ToolCall]]]
    force: str | None = None  # what a required call begins with (default: the first trigger)
    required: g.Builder | None = None  # the grammar of a required call, where it differs
    generic: bool = False

    def call_grammar(self, tools: Sequence[ToolSpec], specials: Mapping[str, int] | None = None,
                     template: str = "", first_id: int = 0) -> CallGrammar | None:
        """What holds a call to `tools` once it begins (None: no tools). `specials` are the
        model's special tokens ({text: id}): markup that is one of them is written as that
        token, never spelled; `template` and `first_id` as `call_grammars.Writing` says."""
        if not tools:
            return None
        w = g.writing(specials, template, first_id)
        return CallGrammar(self.triggers, self.grammar(tools, w), force=self.force,
                           forced_lark=self.required(tools, w) if self.required is not None else None)


def _has(*needles: str, without: Sequence[str] = ()) -> Callable[[str], bool]:
    return lambda src: all(n in src for n in needles) and not any(w in src for w in without)


# Most specific first: a template is the first whose spellings it has.
FORMATS: tuple[Format, ...] = (
    Format("gpt-oss", "GPT-OSS (harmony)", _has("<|channel|>", "<|call|>"), (" to=functions.",), g.gpt_oss,
           p.parse_gpt_oss, required=g.gpt_oss_required),
    Format("kimi-k2", "Kimi K2", _has("<|tool_calls_section_begin|>"), ("<|tool_calls_section_begin|>",), g.kimi_k2,
           p.parse_kimi_k2),
    Format("deepseek-r1", "DeepSeek R1", _has("<｜tool▁sep｜>", "```json"), ("<｜tool▁calls▁begin｜>",), g.deepseek_r1,
           p.parse_deepseek_r1),
    Format("deepseek-v3", "DeepSeek V3.1, V3.2", _has("<｜tool▁sep｜>"), ("<｜tool▁calls▁begin｜>",), g.deepseek_v3,
           p.parse_deepseek_v3),
    Format("command-r7b", "Command R7B", _has("<|START_ACTION|>"), ("<|START_ACTION|>",), g.command_r7b,
           p.parse_command_r7b),
    Format("mistral-args", "Mistral Small 3.2, Devstral, Ministral 3", _has("[TOOL_CALLS]", "[ARGS]"),
           ("[TOOL_CALLS]",), g.mistral_args, p.parse_mistral_args),
    Format("mistral-nemo", "Mistral Nemo, Mistral 7B v0.3", _has("[TOOL_CALLS]"), ("[TOOL_CALLS]",), g.mistral_nemo,
           p.parse_mistral_nemo),
    # (the generation prompt ends with `>>>`: a required call starts right there)
    Format("functionary-v3.2", "Functionary v3.2", _has(">>>all"), (">>>",), g.functionary_v3_2,
           p.parse_functionary_v3_2, force=""),
    Format("functionary-v3.1", "Functionary v3.1", _has("<function=", "<|python_tag|>", without=("<parameter=",)),
           ("<function=",), g.functionary_v3_1, p.parse_functionary_v3_1),
    Format("qwen3-coder", "Qwen3-Coder, Qwen 3.5", _has("<function=", "<parameter="), ("<tool_call>",),
           g.qwen3_coder, p.parse_qwen3_coder),
    Format("firefunction-v2", "FireFunction v2", _has("functools["), (" functools",), g.json_list,
           p.parse_firefunction),
    Format("lfm2", "LFM2", lambda src: "<|tool_call_start|>" in src or "<|tool_list_start|>" in src,
           ("<|tool_call_start|>",), g.lfm2, p.parse_lfm2),
    Format("glm", "GLM 4.5-4.7", _has("<tool_call>", "<arg_key>"), ("<tool_call>",), g.glm, p.parse_glm),
    Format("granite", "Granite 3.x, Phi-4-mini", _has("<|tool_call|>"), ("<|tool_call|>",), g.json_list,
           p.parse_granite),
    Format("hermes", "Hermes 2 Pro, Hermes 3, Qwen 2.5, Qwen 3, Granite 4", _has("<tool_call>"),
           ("<tool_call>",), g.hermes, p.parse_hermes),
    Format("llama3", "Llama 3.1-3.3", _has("<|python_tag|>"), ('{"name"',), g.llama3, p.parse_llama3),
    Format("llama3", "Llama 3.2 (JSON calls)", _has('"parameters": dictionary of argument name'), ('{"name"',),
           g.llama3, p.parse_llama3),
)
GENERIC = Format("generic", "any other template", lambda src: True, ('{"tool_call": ',), g.generic, p.parse_generic,
                 generic=True)


def format_of(template: str | None) -> Format:
    """The tool-call format a chat template speaks (GENERIC when it is none quipu knows)."""
    source = template or ""
    return next((f for f in FORMATS if f.detect(source)), GENERIC)


def parse_reply(template: str | None, text: str, reasoning: ReasoningFormat | None = None, *,
                inside: bool = False) -> ParsedReply:
    """A reply's answer, reasoning and tool calls, read in the format of `template` (its Jinja
    source) and its reasoning's format (`<think>` by default; `inside`: the reply began inside
    reasoning). `text` is
    the reply with control tokens spelled out: calls are read outside the reasoning."""
    thought, rest = (reasoning or BY_DEFAULT).set_apart(text, inside)
    content, calls = format_of(template).parse(rest)
    return ParsedReply(content, thought, calls, rest)


def generic_system_prompt(tools: Sequence[ToolSpec]) -> str:
    """What a model whose template has no tools path is told, in the system prompt."""
    listed = json.dumps([t.to_openai()["function"] for t in tools], ensure_ascii=False)
    return (f"You can call these tools: {listed}\nTo call one, reply with nothing but the JSON "
            '{"tool_call": {"name": "<tool name>", "arguments": {...}}}; its result comes back in the next '
            "message. Otherwise, answer in plain text.")
