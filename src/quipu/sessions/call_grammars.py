"""The grammar a tool call is held to once it begins, one builder a family (the table that
joins each family's builder to its detection, triggers and parser is `tools.py`'s): Lark for
llguidance, with the tools' schemas as `%json`, the JSON spelled as a template's `tojson` spells
it and the markup as the model's own special tokens (`Writing.lit`), so that a call renders back
to the very tokens it was generated as."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from quipu.sessions.toolspec import ToolSpec

# JSON as a template's `tojson` writes it, so that a call the model wrote renders back to the
# very tokens it was generated as: nothing of it is read again on the next turn.
_AS_TOJSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CHOICES = ("auto", "required", "none")
MAX_PARALLEL = 8  # calls in one reply, where the format allows several


def _json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _AS_TOJSON}, ensure_ascii=False)


def _schema(tool: ToolSpec) -> dict[str, Any]:
    """A tool's arguments' schema (any object, where it gives none). An object that names its
    properties and says nothing of others takes no others, as llama.cpp's tool-call grammars
    read it (common/json-schema.cpp): a call to a tool of no parameters is `{}`."""
    return _closed(tool.call_schema) if tool.call_schema else {"type": "object"}


def _closed(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (_closed(v) if k in ("items", "anyOf", "oneOf") else
               {n: _closed(s) for n, s in v.items()} if k in ("properties", "$defs", "definitions")
               and isinstance(v, dict) else v)
           for k, v in schema.items()}
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _arguments(tool: ToolSpec) -> str:
    """A tool's arguments, as `tojson` writes them, in Lark."""
    return _json(_schema(tool))


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _one_of_calls(tools: Sequence[ToolSpec], name_key: str, args_key: str, extra: dict[str, Any] | None = None) -> str:
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


@dataclass(frozen=True)
class Writing:
    """What a family's grammar is written with: `lit` writes markup (the model's special token
    where it has one, by its id, else the text); `template` (its source) tells the variants of a
    family apart where they write a call differently; `first_id` is the number of calls the
    conversation holds (where ids are counted)."""

    lit: Callable[[str], str]
    template: str = ""
    first_id: int = 0


def writing(specials: Mapping[str, int] | None, template: str = "", first_id: int = 0) -> Writing:
    """A `Writing` for a model whose special tokens are `specials` ({text: id})."""
    special = specials or {}
    return Writing(lambda text: f"<[{special[text]}]>" if text in special else _lark_string(text), template, first_id)


MORE = f"more~0..{MAX_PARALLEL - 1}"
Builder = Callable[[Sequence[ToolSpec], Writing], str]


def hermes(tools: Sequence[ToolSpec], w: Writing) -> str:
    call = _one_of_calls(tools, "name", "arguments")
    return (f'start: "\\n" call "\\n" {w.lit("</tool_call>")} {MORE}\n'
            f'more: "\\n" {w.lit("<tool_call>")} "\\n" call "\\n" {w.lit("</tool_call>")}\n'
            f'call: {call}\n')


def llama3(tools: Sequence[ToolSpec], w: Writing) -> str:
    rest = " | ".join(f'{_lark_string(f": {json.dumps(t.name)}, " + chr(34) + "parameters" + chr(34) + ": ")} '
                      f'{_arguments(t)} "}}"' for t in tools)
    return f"start: {rest}\n"


def mistral_nemo(tools: Sequence[ToolSpec], w: Writing) -> str:
    call = _one_of_calls(tools, "name", "arguments", {"id": {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}})
    return f'start: "[" call {MORE} "]"\nmore: ", " call\ncall: {call}\n'


def mistral_args(tools: Sequence[ToolSpec], w: Writing) -> str:
    # (Mistral Small 3.2's template writes each call's id, `[CALL_ID]` and nine letters or digits)
    lit = w.lit
    between = f'{lit("[CALL_ID]")} /[a-zA-Z0-9]{{9}}/ {lit("[ARGS]")}' if "[CALL_ID]" in w.template else lit("[ARGS]")
    return f'start: call {MORE}\nmore: {lit("[TOOL_CALLS]")} call\ncall: {_named_args(tools, between)}\n'


def json_list(tools: Sequence[ToolSpec], w: Writing) -> str:
    """A JSON list of {"name", "arguments"} (Granite 3, FireFunction v2)."""
    return f'start: "[" call {MORE} "]"\nmore: ", " call\ncall: {_one_of_calls(tools, "name", "arguments")}\n'


def command_r7b(tools: Sequence[ToolSpec], w: Writing) -> str:
    # `[`, the calls a line each, indented by four, `]`; each call's id is its number in the
    # conversation, counted from `first_id` (the calls before it), as the template writes them.
    def command_call(i: int) -> str:
        shapes = [{"type": "object", "properties": {"tool_call_id": {"const": str(w.first_id + i)},
                                                    "tool_name": {"const": t.name},
                                                    "parameters": _schema(t)},
                   "required": ["tool_call_id", "tool_name", "parameters"], "additionalProperties": False}
                  for t in tools]
        return _json(shapes[0] if len(shapes) == 1 else {"anyOf": shapes})

    return f'start: "[\\n    " calls "\\n]" {w.lit("<|END_ACTION|>")}\n' + _numbered(command_call, '",\\n    "')


def functionary_v3_1(tools: Sequence[ToolSpec], w: Writing) -> str:
    return (f'start: call "</function>" {MORE}\n'
            f'more: "<function=" call "</function>"\ncall: {_named_args(tools, _lark_string(">"))}\n')


def functionary_v3_2(tools: Sequence[ToolSpec], w: Writing) -> str:
    return f'start: call {MORE}\nmore: ">>>" call\ncall: {_named_args(tools, _lark_string(chr(10)))}\n'


def _deepseek(body: str, w: Writing) -> str:
    begin, end = w.lit("<｜tool▁call▁begin｜>"), w.lit("<｜tool▁call▁end｜>")
    return (f'start: call {MORE} {w.lit("<｜tool▁calls▁end｜>")}\n'
            f'more: call\ncall: {begin} body {end}\nbody: {body}\n')


def deepseek_v3(tools: Sequence[ToolSpec], w: Writing) -> str:
    sep = w.lit("<｜tool▁sep｜>")
    return _deepseek(" | ".join(f'{_lark_string(t.name)} {sep} {_arguments(t)}' for t in tools), w)


def deepseek_r1(tools: Sequence[ToolSpec], w: Writing) -> str:
    sep = w.lit("<｜tool▁sep｜>")
    return _deepseek(" | ".join(f'"function" {sep} {_lark_string(t.name + chr(10) + "```json" + chr(10))} '
                                f'{_arguments(t)} "\\n```"' for t in tools), w)


def kimi_k2(tools: Sequence[ToolSpec], w: Writing) -> str:
    # (each call's id is `functions.NAME:I`, I its place in the reply, as the template writes it)
    lit = w.lit

    def kimi_call(i: int) -> str:
        body = " | ".join(f'{_lark_string(f"functions.{t.name}:{i}")} {lit("<|tool_call_argument_begin|>")} '
                          f'{_arguments(t)}' for t in tools)
        return f'{lit("<|tool_call_begin|>")} ({body}) {lit("<|tool_call_end|>")}'

    return f'start: calls {lit("<|tool_calls_section_end|>")}\n' + _numbered(kimi_call)


# GPT-OSS: the channel before the recipient (`<|channel|>commentary to=functions.NAME
# <|constrain|>json`, as the model writes it), or after it, as the template writes a call
# (`<|start|>assistant to=functions.NAME<|channel|>commentary json`): a required call is written
# so, to render back as it was written. One call a reply: the template writes one.
def _gpt_oss(tools: Sequence[ToolSpec], w: Writing, channel: str) -> str:
    body = " | ".join(f'{_lark_string(t.name)} {channel} {w.lit("<|message|>")} {_arguments(t)}' for t in tools)
    return f'start: body {w.lit("<|call|>")}\nbody: {body}\n'


def gpt_oss(tools: Sequence[ToolSpec], w: Writing) -> str:
    written, rendered = f'" " {w.lit("<|constrain|>")} "json"', f'{w.lit("<|channel|>")} "commentary json"'
    return _gpt_oss(tools, w, f"({written} | {rendered})")


def gpt_oss_required(tools: Sequence[ToolSpec], w: Writing) -> str:
    return _gpt_oss(tools, w, f'{w.lit("<|channel|>")} "commentary json"')


def qwen3_coder(tools: Sequence[ToolSpec], w: Writing) -> str:
    fns, rules = _each(tools, _xml_call)
    return (f'start: "\\n" fn "\\n" {w.lit("</tool_call>")} {MORE}\n'
            f'more: "\\n" {w.lit("<tool_call>")} "\\n" fn "\\n" {w.lit("</tool_call>")}\n'
            f'fn: {fns}\n{rules}TEXT: /[^<]*/\n')


def glm(tools: Sequence[ToolSpec], w: Writing) -> str:
    nl = "\\n" if "</arg_key>\n<arg_value>" in w.template else ""  # GLM 4.6's new lines; 4.7 has none
    fns, rules = _each(tools, lambda tool, rule: _glm_call(tool, rule, nl, w.lit))
    gap = f' "{nl}"' if nl else ""
    return (f'start: fn {w.lit("</tool_call>")} {MORE}\n'
            f'more:{gap} {w.lit("<tool_call>")} fn {w.lit("</tool_call>")}\n'
            f'fn: {fns}\n{rules}TEXT: /[^<]*/\n')


def lfm2(tools: Sequence[ToolSpec], w: Writing) -> str:
    fns, rules = _each(tools, _python_call)
    return f'start: "[" fn {MORE} "]" {w.lit("<|tool_call_end|>")}\nmore: ", " fn\nfn: {fns}\n{rules}'


def generic(tools: Sequence[ToolSpec], w: Writing) -> str:
    return f'start: call "}}"\ncall: {_one_of_calls(tools, "name", "arguments")}\n'


def _in_order(tool: ToolSpec, rule: str, param: Callable[[str, Any], str], sep: str = "") -> tuple[str, list[str]]:
    """A tool's parameters in the order of its schema, each written by `param(key, schema)`,
    `sep` between two; a parameter not required may be left out. Returns the expression and
    the Lark rules it needs (named from `rule`)."""
    props = list(((tool.call_schema or {}).get("properties") or {}).items())
    required = set((tool.call_schema or {}).get("required") or [])
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
