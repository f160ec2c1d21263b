"""The grammar a tool call is held to once it begins, in each constrained format
(`call_grammar`): Lark for llguidance, with the tools' schemas as `%json`, the JSON spelled as a
template's `tojson` spells it and the markup as the model's own special tokens, so that a call
renders back to the very tokens it was generated as. The formats themselves, and how a reply
is read, are `tools.py`'s."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from quipu.sessions.tools import Format, ToolSpec

# JSON as a template's `tojson` writes it, so that a call the model wrote renders back to the
# very tokens it was generated as: nothing of it is read again on the next turn.
_AS_TOJSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CHOICES = ("auto", "required", "none")
MAX_PARALLEL = 8  # calls in one reply, where the format allows several


def _json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _AS_TOJSON}, ensure_ascii=False)


def _schema(tool: ToolSpec) -> dict[str, Any]:
    """A tool's arguments' schema (any object, where it gives none)."""
    return tool.parameters or {"type": "object"}


def _arguments(tool: ToolSpec) -> str:
    """A tool's arguments, as `tojson` writes them, in Lark."""
    return _json(_schema(tool))


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _one_of_calls(tools: Sequence[ToolSpec], name_key: str, args_key: str, extra: dict | None = None) -> str:
    """A JSON call object: `{name_key: one of the tools, args_key: its arguments}`, in that order."""
    shapes = []
    for tool in tools:
        props = {name_key: {"const": tool.name}, args_key: _schema(tool)}
        props.update(extra or {})
        shapes.append({"type": "object", "properties": props, "required": list(props), "additionalProperties": False})
    return _json(shapes[0] if len(shapes) == 1 else {"anyOf": shapes})


def _named_args(tools: Sequence[ToolSpec], between: str) -> str:
    """`NAME`, then `between` (a Lark expression), then the arguments, for one of the tools, as
    Lark alternatives."""
    return " | ".join(f"{_lark_string(t.name)} {between} {_arguments(t)}" for t in tools)


@dataclass(frozen=True)
class CallGrammar:
    """What holds a call to the offered tools: the texts that begin one (`triggers`), and the
    grammar (Lark, llguidance's) of what follows a trigger, to the call's end."""

    triggers: tuple[str, ...]
    lark: str
    force: str | None = None  # what a required call begins with (default: the first trigger)
    # A required call in a reply that begins inside reasoning: what follows the reasoning's end
    # (the call's trigger included), written once the model ends its reasoning.
    after_reasoning: str | None = None
    forced_lark: str | None = None  # the grammar of a required call, where it differs

    @property
    def forced(self) -> str:
        return self.triggers[0] if self.force is None else self.force


def call_grammar(fmt: Format, tools: Sequence[ToolSpec], specials: Mapping[str, int] | None = None,
                 template: str = "", first_id: int = 0) -> CallGrammar | None:
    """The grammar a call in `fmt` is held to once it begins (None: a format whose calls are
    read but not constrained). `specials` are the model's special tokens ({text: id}): markup
    that is one of them is written as that token, never spelled. `template` (its source) tells
    the variants of a family apart where they write a call differently (GLM 4.6 and 4.7);
    `first_id` is the number of calls the conversation holds (where ids are counted)."""
    if not tools:
        return None
    special = specials or {}

    def lit(text: str) -> str:
        """Markup in the grammar: the special token where the model has one (by its id), else the text."""
        return f"<[{special[text]}]>" if text in special else _lark_string(text)

    more = f"more~0..{MAX_PARALLEL - 1}"
    name = fmt.name
    glm_new_lines = "</arg_key>\n<arg_value>" in template
    if name in ("hermes", "granite-4"):
        call = _one_of_calls(tools, "name", "arguments")
        return CallGrammar(("<tool_call>",), f'start: "\\n" call "\\n" {lit("</tool_call>")} {more}\n'
                                              f'more: "\\n" {lit("<tool_call>")} "\\n" call "\\n" {lit("</tool_call>")}\n'
                                              f'call: {call}\n')
    if name == "llama3":
        rest = " | ".join(f'{_lark_string(f": {json.dumps(t.name)}, " + chr(34) + "parameters" + chr(34) + ": ")} '
                          f'{_arguments(t)} "}}"' for t in tools)
        return CallGrammar(('{"name"',), f"start: {rest}\n")
    if name == "mistral-nemo":
        call = _one_of_calls(tools, "name", "arguments", {"id": {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}})
        return CallGrammar(("[TOOL_CALLS]",), f'start: "[" call {more} "]"\nmore: ", " call\ncall: {call}\n')
    if name == "mistral-args":
        # (Mistral Small 3.2's template writes each call's id, `[CALL_ID]` and nine letters or digits)
        between = f'{lit("[CALL_ID]")} /[a-zA-Z0-9]{{9}}/ {lit("[ARGS]")}' if "[CALL_ID]" in template else lit("[ARGS]")
        return CallGrammar(("[TOOL_CALLS]",), f'start: call {more}\nmore: {lit("[TOOL_CALLS]")} call\n'
                                              f'call: {_named_args(tools, between)}\n')
    if name in ("granite", "firefunction-v2"):  # a JSON list of {"name", "arguments"}
        call = _one_of_calls(tools, "name", "arguments")
        trigger = "<|tool_call|>" if name == "granite" else " functools"
        return CallGrammar((trigger,), f'start: "[" call {more} "]"\nmore: ", " call\ncall: {call}\n')
    if name == "command-r7b":
        # `[`, the calls a line each, indented by four, `]`; each call's id is its number in the
        # conversation, counted from `first_id` (the calls before it), as the template writes them.
        def command_call(i: int) -> str:
            shapes = [{"type": "object", "properties": {"tool_call_id": {"const": str(first_id + i)},
                                                        "tool_name": {"const": t.name},
                                                        "parameters": _schema(t)},
                       "required": ["tool_call_id", "tool_name", "parameters"], "additionalProperties": False}
                      for t in tools]
            return _json(shapes[0] if len(shapes) == 1 else {"anyOf": shapes})

        return CallGrammar(("<|START_ACTION|>",), f'start: "[\\n    " calls "\\n]" {lit("<|END_ACTION|>")}\n'
                                                  + _numbered(command_call, '",\\n    "'))
    if name == "functionary-v3.1":
        return CallGrammar(("<function=",), f'start: call "</function>" {more}\n'
                                             f'more: "<function=" call "</function>"\ncall: {_named_args(tools, _lark_string(">"))}\n')
    if name == "functionary-v3.2":
        # (the generation prompt ends with `>>>`: a required call starts right there)
        return CallGrammar((">>>",), f'start: call {more}\nmore: ">>>" call\ncall: {_named_args(tools, _lark_string(chr(10)))}\n',
                           force="")
    if name in ("deepseek-v3", "deepseek-r1"):
        begin, sep, end = lit("<｜tool▁call▁begin｜>"), lit("<｜tool▁sep｜>"), lit("<｜tool▁call▁end｜>")
        if name == "deepseek-v3":
            body = " | ".join(f'{_lark_string(t.name)} {sep} {_arguments(t)}' for t in tools)
        else:
            body = " | ".join(f'"function" {sep} {_lark_string(t.name + chr(10) + "```json" + chr(10))} '
                              f'{_arguments(t)} "\\n```"' for t in tools)
        return CallGrammar(("<｜tool▁calls▁begin｜>",), f'start: call {more} {lit("<｜tool▁calls▁end｜>")}\n'
                                                        f'more: call\ncall: {begin} body {end}\nbody: {body}\n')
    if name == "kimi-k2":
        # (each call's id is `functions.NAME:I`, I its place in the reply, as the template writes it)
        def kimi_call(i: int) -> str:
            body = " | ".join(f'{_lark_string(f"functions.{t.name}:{i}")} {lit("<|tool_call_argument_begin|>")} '
                              f'{_arguments(t)}' for t in tools)
            return f'{lit("<|tool_call_begin|>")} ({body}) {lit("<|tool_call_end|>")}'

        return CallGrammar(("<|tool_calls_section_begin|>",),
                           f'start: calls {lit("<|tool_calls_section_end|>")}\n' + _numbered(kimi_call))
    if name == "gpt-oss":
        # The channel before the recipient (`<|channel|>commentary to=functions.NAME <|constrain|>json`,
        # as the model writes it), or after it, as the template writes a call
        # (`<|start|>assistant to=functions.NAME<|channel|>commentary json`): a required call is
        # written so, to render back as it was written. One call a reply: the template writes one.
        def calls_in(channel: str) -> str:
            return " | ".join(f'{_lark_string(t.name)} {channel} {lit("<|message|>")} '
                              f'{_arguments(t)}' for t in tools)

        written = f'" " {lit("<|constrain|>")} "json"'
        rendered = f'{lit("<|channel|>")} "commentary json"'
        return CallGrammar((" to=functions.",), f'start: body {lit("<|call|>")}\nbody: {calls_in(f"({written} | {rendered})")}\n',
                           force=" to=functions.", forced_lark=f'start: body {lit("<|call|>")}\nbody: {calls_in(rendered)}\n')
    if name == "qwen3-coder":
        fns, rules = _each(tools, _xml_call)
        return CallGrammar(("<tool_call>",), f'start: "\\n" fn "\\n" {lit("</tool_call>")} {more}\n'
                                              f'more: "\\n" {lit("<tool_call>")} "\\n" fn "\\n" {lit("</tool_call>")}\n'
                                              f'fn: {fns}\n{rules}TEXT: /[^<]*/\n')
    if name == "glm":
        nl = "\\n" if glm_new_lines else ""
        fns, rules = _each(tools, lambda tool, rule: _glm_call(tool, rule, nl, lit))
        gap = f' "{nl}"' if nl else ""
        return CallGrammar(("<tool_call>",), f'start: fn {lit("</tool_call>")} {more}\n'
                                              f'more:{gap} {lit("<tool_call>")} fn {lit("</tool_call>")}\n'
                                              f'fn: {fns}\n{rules}TEXT: /[^<]*/\n')
    if name == "lfm2":
        fns, rules = _each(tools, _python_call)
        return CallGrammar(("<|tool_call_start|>",), f'start: "[" fn {more} "]" {lit("<|tool_call_end|>")}\n'
                                                      f'more: ", " fn\nfn: {fns}\n{rules}')
    if name == "generic":
        call = _one_of_calls(tools, "name", "arguments")
        return CallGrammar(('{"tool_call": ',), f'start: call "}}"\ncall: {call}\n')
    return None


def _in_order(tool: ToolSpec, rule: str, param: Callable[[str, Any], str], sep: str = "") -> tuple[str, list[str]]:
    """A tool's parameters in the order of its schema, each written by `param(key, schema)`,
    `sep` between two; a parameter not required may be left out. Returns the expression and
    the Lark rules it needs (named from `rule`)."""
    props = list(((tool.parameters or {}).get("properties") or {}).items())
    required = set((tool.parameters or {}).get("required") or [])
    rules = []
    # {rule}_{i}_{f}: the parameters from the i-th on; f=1 while none has been written yet.
    for i in range(len(props), -1, -1):
        for first in (1, 0):
            if i == len(props):
                rules.append(f'{rule}_{i}_{first}: ""')
                continue
            key, schema = props[i]
            lead = "" if first or not sep else f"{_lark_string(sep)} "
            written = f"{lead}{param(key, schema)} {rule}_{i + 1}_0"
            rules.append(f"{rule}_{i}_{first}: {written}" if key in required
                         else f"{rule}_{i}_{first}: {written} | {rule}_{i + 1}_{first}")
    return f"{rule}_0_1", rules


def _xml_call(tool: ToolSpec, rule: str) -> tuple[str, list[str]]:
    """`<function=NAME>` and its parameters, as Qwen3-Coder's template writes them: a string as
    it is, anything else as JSON."""
    def param(key: str, schema: Any) -> str:
        return (f'{_lark_string(f"<parameter={key}>" + chr(10))} {_bare_value(schema)} '
                f'{_lark_string(chr(10) + "</parameter>" + chr(10))}')

    args, rules = _in_order(tool, rule, param)
    return f'({_lark_string(f"<function={tool.name}>" + chr(10))} {args} "</function>")', rules


def _glm_call(tool: ToolSpec, rule: str, nl: str, lit: Callable[[str], str]) -> tuple[str, list[str]]:
    """`NAME`, then `<arg_key>K</arg_key><arg_value>V</arg_value>` for each parameter (a string
    as it is, anything else as JSON), with GLM 4.6's new lines (`nl`) or GLM 4.7's none."""
    gap = f' "{nl}"' if nl else ""

    def param(key: str, schema: Any) -> str:
        return (f'{lit("<arg_key>")} {_lark_string(key)} {lit("</arg_key>")}{gap} {lit("<arg_value>")} '
                f'{_bare_value(schema)} {lit("</arg_value>")}{gap}')

    args, rules = _in_order(tool, rule, param)
    return f"({_lark_string(tool.name)}{gap} {args})", rules


def _python_value(schema: Any) -> str:
    """A keyword argument's value in a Python call, as LFM2.5's template writes it: a string in
    single quotes, True, False and None as Python spells them, a dict as JSON; numbers and lists
    as JSON (which Python reads alike; `parse_lfm2` reads JSON's true, false and null too)."""
    if not isinstance(schema, dict):
        return _json({})
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(choices, list) and choices and all(isinstance(c, str) and "'" not in c and "\\" not in c
                                                     for c in choices):
        return "(" + " | ".join(_lark_string(f"'{c}'") for c in choices) + ")"
    kind = schema.get("type")
    if kind == "string" and not schema.get("pattern") and not schema.get("format"):
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        # (no quote, backslash, line break or NUL inside: Python's reading would change it)
        return f"\"'\" /[^'\\\\\\r\\n\\x00]{{{low},{high if isinstance(high, int) else ''}}}/ \"'\""
    if kind == "boolean":
        return '("True" | "False")'
    if kind == "null":
        return '"None"'
    return _json(schema)


def _python_call(tool: ToolSpec, rule: str) -> tuple[str, list[str]]:
    args, rules = _in_order(tool, rule, lambda key, schema: f'"{key}=" {_python_value(schema)}', ", ")
    return f'({_lark_string(tool.name + "(")} {args} ")")', rules


def _bare_value(schema: Any) -> str:
    """A parameter's value as a template writes it bare: a string (or a choice of strings) as it
    is, up to its maxLength; anything else as JSON."""
    if not isinstance(schema, dict):
        return _json({})
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
        return "(" + " | ".join(_lark_string(c) for c in choices) + ")"
    if schema.get("type") == "string":
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        return f"/[^<]{{{low},{high}}}/" if isinstance(high, int) else (f"/[^<]{{{low},}}/" if low else "TEXT")
    return _json(schema)


def _numbered(call: Callable[[int], str], sep: str = "") -> str:
    """Lark rules for `calls`: one to MAX_PARALLEL calls, the i-th written by `call(i)`, `sep`
    (a Lark expression) between two."""
    lines = ["calls: call_0 rest_1"]
    for i in range(1, MAX_PARALLEL):
        lines.append(f'rest_{i}: {sep} call_{i} rest_{i + 1} | ""')
    lines.append(f'rest_{MAX_PARALLEL}: ""')
    lines += [f"call_{i}: {call(i)}" for i in range(MAX_PARALLEL)]
    return "".join(line + "\n" for line in lines)


def _each(tools: Sequence[ToolSpec], call: Callable[[ToolSpec, str], tuple[str, list[str]]]) -> tuple[str, str]:
    """One of the tools, each written by `call(tool, its rule prefix)`: the alternatives, and
    the rules they need, as Lark lines."""
    shapes, rules = [], []
    for i, tool in enumerate(tools):
        shape, more = call(tool, f"t{i}")
        shapes.append(shape)
        rules += more
    return " | ".join(shapes), "".join(line + "\n" for line in rules)


CONSTRAINED = ("hermes", "granite-4", "llama3", "mistral-nemo", "mistral-args", "granite", "firefunction-v2",
               "command-r7b", "functionary-v3.1", "functionary-v3.2", "deepseek-v3", "deepseek-r1", "kimi-k2",
               "gpt-oss", "qwen3-coder", "glm", "lfm2", "generic")
