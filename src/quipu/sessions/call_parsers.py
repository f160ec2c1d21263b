"""How a reply's tool calls are read, in each family's own format (`parse_*`, one a family;
the table that picks one for a template is `tools.py`'s). A reply is read with its control
tokens spelled out; a call that does not parse (cut short, broken JSON) stays text, never dropped."""

from __future__ import annotations

import ast
import json
import re
from typing import Any, Callable, Sequence

from quipu.sessions.toolspec import ToolCall


def _json_prefix(text: str) -> tuple[Any, str] | None:
    """The JSON value at the start of `text` (after blanks) and what follows it; None if none."""
    text = text.lstrip()
    try:
        value, end = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None
    return value, text[end:]


def _call_of(obj: Any, name_key: str = "name", args_keys: Sequence[str] = ("arguments", "parameters"),
             id_key: str = "id") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get(name_key), str):
        return None
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some formats write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    ident = obj.get(id_key)
    return ToolCall(obj[name_key], args, str(ident) if ident is not None else None)


def _tagged(text: str, open_: str, close: str, body: Callable[[str], list[ToolCall] | None],
            close_optional: bool = False) -> tuple[str, list[ToolCall]]:
    """Calls each between `open_` and `close`: content is the text before the first; a call
    that does not parse, and all after it, stays text."""
    first = text.find(open_)
    if first < 0:
        return text, []
    calls: list[ToolCall] = []
    at = first
    while True:
        start = text.find(open_, at)
        if start < 0:
            break
        if text[at:start].strip():
            break  # text between calls: the rest is content
        end = text.find(close, start + len(open_))
        if end < 0 and not close_optional:
            break
        inner = text[start + len(open_): end if end >= 0 else len(text)]
        made = body(inner)
        if not made:
            break
        calls += made
        at = end + len(close) if end >= 0 else len(text)
    if not calls:
        return text, []
    content, rest = text[:first].rstrip(), text[at:].strip()
    return (f"{content}\n{rest}".strip() if rest else content), calls


def _json_call(inner: str, **keys: Any) -> list[ToolCall] | None:
    got = _json_prefix(inner)
    if got is None or got[1].strip():
        return None
    call = _call_of(got[0], **keys)
    return [call] if call else None


def _json_calls(inner: str, **keys: Any) -> list[ToolCall] | None:
    """A JSON list of calls (or one call)."""
    got = _json_prefix(inner)
    if got is None or got[1].strip():
        return None
    items = got[0] if isinstance(got[0], list) else [got[0]]
    calls = [c for c in (_call_of(item, **keys) for item in items) if c is not None]
    return calls if calls and len(calls) == len(items) else None


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or several (Hermes 2 Pro,
    Hermes 3, Qwen 2.5, Qwen 3, Granite 4, SmolLM3, ...)."""
    return _tagged(text, "<tool_call>", "</tool_call>", _json_call)


def _xml_value(raw: str) -> Any:
    value = raw.strip("\n")
    try:
        return json.loads(value)
    except ValueError:
        return value


def _xml_function(inner: str) -> list[ToolCall] | None:
    m = re.fullmatch(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", inner, re.S)
    if not m:
        return None
    params = {}
    rest = m.group(2)
    for pm in re.finditer(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", rest, re.S):
        params[pm.group(1).strip()] = _xml_value(pm.group(2))
    leftover = re.sub(r"<parameter=([^>\n]+)>.*?</parameter>", "", rest, flags=re.S)
    if leftover.strip():
        return None
    return [ToolCall(m.group(1).strip(), params)]


def parse_qwen3_coder(text: str) -> tuple[str, list[ToolCall]]:
    """`<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`
    (Qwen3-Coder, Qwen 3.5); the opening `<tool_call>` may be missing."""
    if "<tool_call>" not in text and "<function=" in text:
        at = text.find("<function=")
        text = text[:at] + "<tool_call>" + text[at:]
    return _tagged(text, "<tool_call>", "</tool_call>", _xml_function)


def parse_llama3(text: str) -> tuple[str, list[ToolCall]]:
    """Llama 3.1-3.3: the whole reply is `{"name": ..., "parameters": {...}}` (a JSON call), or
    `<|python_tag|>` and a built-in tool's `name.call(key="value")` (or code, for `ipython`)."""
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
        m = re.fullmatch(r"([A-Za-z_][\w]*)\.call\((.*)\)", body, re.S)
        if m:
            args = _python_kwargs(m.group(2))
            if args is not None:
                return "", [ToolCall(m.group(1), args)]
        calls = _json_calls(body)
        if calls:
            return "", calls
        return "", [ToolCall("ipython", {"code": body})] if body else []
    if body.startswith("{"):
        calls = _json_calls(body)
        if calls:
            return "", calls
    return text, []


def _python_kwargs(source: str) -> dict[str, Any] | None:
    """`a=1, b="x"` as a dict of literals (None when it is not that)."""
    try:
        call = ast.parse(f"f({source})", mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(call, ast.Call) or call.args:
        return None
    try:
        return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg}
    except ValueError:
        return None


def _marked_list(text: str, marker: str, skip: str) -> tuple[str, list[ToolCall]]:
    """Calls as a JSON list after `marker` (`skip` of it is markup; the rest belongs to the JSON)."""
    at = text.find(marker)
    if at < 0:
        return text, []
    calls = _json_calls(text[at + len(skip):])
    return (text[:at].strip(), calls) if calls else (text, [])


def parse_mistral_nemo(text: str) -> tuple[str, list[ToolCall]]:
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "..."}]` (Mistral Nemo, 7B v0.3)."""
    return _marked_list(text, "[TOOL_CALLS]", "[TOOL_CALLS]")


def parse_mistral_args(text: str) -> tuple[str, list[ToolCall]]:
    """`[TOOL_CALLS]NAME[ARGS]{...}`, or `[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}`, repeated
    (Mistral Small 3.2, Devstral, Ministral 3, Magistral)."""
    at = text.find("[TOOL_CALLS]")
    if at < 0:
        return text, []
    calls: list[ToolCall] = []
    rest = text[at:]
    while rest.startswith("[TOOL_CALLS]"):
        m = re.match(r"\[TOOL_CALLS\]([^\[\]\s]+)(?:\[CALL_ID\]([^\[\]]+))?\[ARGS\]", rest)
        if not m:
            return text, []
        got = _json_prefix(rest[m.end():])
        if got is None or not isinstance(got[0], dict):
            return text, []
        calls.append(ToolCall(m.group(1), got[0], m.group(2)))
        rest = got[1].lstrip()
    if rest.strip():
        return text, []
    return text[:at].strip(), calls


def parse_command_r7b(text: str) -> tuple[str, list[ToolCall]]:
    """`<|START_ACTION|>[{"tool_call_id": "0", "tool_name": ..., "parameters": {...}}]<|END_ACTION|>`,
    the answer in `<|START_RESPONSE|>...<|END_RESPONSE|>` (Command R7B)."""
    m = re.search(r"<\|START_RESPONSE\|>(.*?)(?:<\|END_RESPONSE\|>|$)", text, re.S)
    if "<|START_ACTION|>" not in text:
        return (m.group(1).strip() if m else text), []
    content, calls = _tagged(text, "<|START_ACTION|>", "<|END_ACTION|>",
                             lambda inner: _json_calls(inner, name_key="tool_name", args_keys=("parameters",),
                                                       id_key="tool_call_id"))
    return content, calls


def parse_deepseek_r1(text: str) -> tuple[str, list[ToolCall]]:
    """`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`."""
    def body(inner: str) -> list[ToolCall] | None:
        m = re.fullmatch(r"\s*(?:function)?<｜tool▁sep｜>([^\n]+)\n```(?:json)?\n(.*?)\n?```\s*", inner, re.S)
        if not m:
            return None
        got = _json_prefix(m.group(2))
        return [ToolCall(m.group(1).strip(), got[0])] if got and isinstance(got[0], dict) and not got[1].strip() else None

    return _deepseek(text, body)


def parse_deepseek_v3(text: str) -> tuple[str, list[ToolCall]]:
    """`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`
    (DeepSeek V3.1, V3.2)."""
    def body(inner: str) -> list[ToolCall] | None:
        name, sep, args = inner.partition("<｜tool▁sep｜>")
        got = _json_prefix(args) if sep else None
        return ([ToolCall(name.strip(), got[0])] if got and isinstance(got[0], dict) and not got[1].strip()
                and name.strip() else None)

    return _deepseek(text, body)


def _deepseek(text: str, body: Callable[[str], list[ToolCall] | None]) -> tuple[str, list[ToolCall]]:
    at = text.find("<｜tool▁calls▁begin｜>")
    if at < 0:
        return text, []
    inner = text[at + len("<｜tool▁calls▁begin｜>"):]
    inner = inner.split("<｜tool▁calls▁end｜>", 1)[0]
    content, calls = _tagged(inner, "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", body)
    if not calls or content.strip():
        return text, []
    return text[:at].strip(), calls


def parse_functionary_v3_1(text: str) -> tuple[str, list[ToolCall]]:
    """`<function=NAME>{...}</function>`, and code after `<|python_tag|>` (Functionary v3.1)."""
    if text.lstrip().startswith("<|python_tag|>"):
        return "", [ToolCall("python", {"code": text.lstrip()[len("<|python_tag|>"):]})]
    first = text.find("<function=")
    if first < 0:
        return text, []
    calls: list[ToolCall] = []
    rest = text[first:]
    pos = 0
    while True:
        m = re.compile(r"\s*<function=([^>]+)>").match(rest, pos)
        if not m:
            break
        got = _json_prefix(rest[m.end():])
        if got is None or not isinstance(got[0], dict) or not got[1].lstrip().startswith("</function>"):
            return text, []
        calls.append(ToolCall(m.group(1).strip(), got[0]))
        after = got[1].lstrip()[len("</function>"):]
        pos = len(rest) - len(after)
    if rest[pos:].strip():
        return text, []
    return text[:first].strip(), calls


def parse_functionary_v3_2(text: str) -> tuple[str, list[ToolCall]]:
    """`RECIPIENT\\nCONTENT` blocks joined by `>>>` (the first `>>>` is the prompt's): `all` is
    text, any other recipient a call with JSON arguments (Functionary v3.2)."""
    blocks = [b for b in re.split(r">>>", text)]
    content: list[str] = []
    calls: list[ToolCall] = []
    for block in blocks:
        if not block.strip():
            continue
        recipient, _, body = block.partition("\n")
        recipient = recipient.strip()
        if recipient == "all":
            content.append(body.strip())
            continue
        if recipient == "python":
            calls.append(ToolCall("python", {"code": body}))
            continue
        got = _json_prefix(body)
        if got is None or not isinstance(got[0], dict) or got[1].strip() or not re.fullmatch(r"[\w.-]+", recipient):
            return text, []
        calls.append(ToolCall(recipient, got[0]))
    return "\n".join(content).strip(), calls


def parse_firefunction(text: str) -> tuple[str, list[ToolCall]]:
    """` functools[{"name": ..., "arguments": {...}}]` (FireFunction v2)."""
    return _marked_list(text, "functools[", "functools")


def parse_gpt_oss(text: str) -> tuple[str, list[ToolCall]]:
    """Harmony channels: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`
    (the recipient may stand before `<|channel|>`), the answer in the `final` channel."""
    content: list[str] = []
    calls: list[ToolCall] = []
    for m in re.finditer(r"(?:<\|start\|>assistant)?(?P<head>.*?)<\|message\|>(?P<body>.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|$)",
                         text, re.S):
        head, body = m.group("head"), m.group("body")
        to = re.search(r"to=functions\.([\w.-]+)", head)
        if to:
            got = _json_prefix(body)
            if got is None or not isinstance(got[0], dict) or got[1].strip():
                return text, []
            calls.append(ToolCall(to.group(1), got[0]))
        elif "final" in head or "<|channel|>" not in head:
            content.append(body)
    if not calls and not content:
        return text, []
    return "".join(content).strip(), calls


def parse_granite(text: str) -> tuple[str, list[ToolCall]]:
    """`<|tool_call|>[{"name": ..., "arguments": {...}}]` (Granite 3.x; Phi-4-mini closes it
    with `<|/tool_call|>`)."""
    at = text.find("<|tool_call|>")
    if at < 0:
        return text, []
    body = text[at + len("<|tool_call|>"):].split("<|/tool_call|>", 1)[0]
    calls = _json_calls(body)
    return (text[:at].strip(), calls) if calls else (text, [])


def parse_lfm2(text: str) -> tuple[str, list[ToolCall]]:
    """`<|tool_call_start|>[name(a=1, b="x"), other()]<|tool_call_end|>`, Python calls (LFM2)."""
    def body(inner: str) -> list[ToolCall] | None:
        try:
            tree = ast.parse(inner.strip(), mode="eval").body
        except SyntaxError:
            return None
        items = tree.elts if isinstance(tree, ast.List) else [tree]
        calls = []
        for item in items:
            if not (isinstance(item, ast.Call) and isinstance(item.func, (ast.Name, ast.Attribute))) or item.args:
                return None
            name = ast.unparse(item.func)
            try:
                calls.append(ToolCall(name, {kw.arg: ast.literal_eval(_json_names(kw.value))
                                             for kw in item.keywords if kw.arg}))
            except ValueError:
                return None
        return calls or None

    return _tagged(text, "<|tool_call_start|>", "<|tool_call_end|>", body)


class _JsonNames(ast.NodeTransformer):
    """`true`, `false` and `null` as Python's constants (a dict argument is written as JSON)."""

    NAMES = {"true": True, "false": False, "null": None}

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.Constant(self.NAMES[node.id]) if node.id in self.NAMES else node


def _json_names(node: ast.AST) -> ast.AST:
    named: ast.AST = _JsonNames().visit(node)
    return named


def parse_kimi_k2(text: str) -> tuple[str, list[ToolCall]]:
    """`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|><|tool_calls_section_end|>`."""
    at = text.find("<|tool_calls_section_begin|>")
    if at < 0:
        return text, []
    inner = text[at + len("<|tool_calls_section_begin|>"):].split("<|tool_calls_section_end|>", 1)[0]

    def body(call: str) -> list[ToolCall] | None:
        head, sep, args = call.partition("<|tool_call_argument_begin|>")
        m = re.fullmatch(r"\s*(?:functions\.)?([\w.-]+?)(?::(\d+))?\s*", head)
        got = _json_prefix(args) if sep else None
        if not m or got is None or not isinstance(got[0], dict) or got[1].strip():
            return None
        return [ToolCall(m.group(1), got[0], head.strip())]

    content, calls = _tagged(inner, "<|tool_call_begin|>", "<|tool_call_end|>", body)
    if not calls or content.strip():
        return text, []
    return text[:at].strip(), calls


def parse_glm(text: str) -> tuple[str, list[ToolCall]]:
    """`<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>...</tool_call>` (GLM 4.5-4.7)."""
    def body(inner: str) -> list[ToolCall] | None:
        m = re.match(r"\s*([\w.-]+)\s*", inner)  # GLM 4.6 puts a new line after the name, 4.7 nothing
        if not m:
            return None
        name, rest = m.group(1), inner[m.end():]
        if not rest.startswith("<arg_key>") and rest.strip():
            return None
        pairs = re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", rest, re.S)
        if re.sub(r"<arg_key>.*?</arg_key>\s*<arg_value>.*?</arg_value>", "", rest, flags=re.S).strip():
            return None
        return [ToolCall(name, {k.strip(): _xml_value(v) for k, v in pairs})]

    return _tagged(text, "<tool_call>", "</tool_call>", body)


def parse_generic(text: str) -> tuple[str, list[ToolCall]]:
    """A template quipu does not know: `{"tool_calls": [{"name": ..., "arguments": {...}}]}` (or
    `{"tool_call": {...}}`), the whole reply; anything else is text."""
    got = _json_prefix(text)
    if got is None or got[1].strip() or not isinstance(got[0], dict):
        return text, []
    obj = got[0]
    if isinstance(obj.get("tool_calls"), list):
        calls = [c for c in (_call_of(item) for item in obj["tool_calls"]) if c is not None]
        return ("", calls) if calls and len(calls) == len(obj["tool_calls"]) else (text, [])
    if isinstance(obj.get("tool_call"), dict):
        call = _call_of(obj["tool_call"])
        return ("", [call]) if call else (text, [])
    if isinstance(obj.get("response"), str):
        return obj["response"], []
    return text, []
