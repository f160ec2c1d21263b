"""What the user's files give the tools and the loop: the JSON Schemas of a Python file's
functions (`--functions FILE.py`, from their type hints; read in the process that runs them,
`function_worker.py`), tool definitions the caller runs itself (`--tools FILE.json`), and a
conversation as OpenAI-style messages (`--messages FILE.json`)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Sequence

from quipu.app.user_files import lone_surrogate, read_json_file
from quipu.engine.base import defuse
from quipu.engine.grammar import MAX_DEPTH, depth, enforceable
from quipu.app.tooldefs import Tool
from quipu.errors import UsageError
from quipu.sessions.toolspec import ToolSpec

if typing.TYPE_CHECKING:
    from quipu.app.attachments import Attachment
    from quipu.sessions.base import Message

# ---- the schemas of a Python file's functions (read in the process that runs them) ---------------

def hints_of(fn: Callable[..., Any]) -> dict[str, Any]:
    """A function's type hints, resolved; {} where one does not resolve (its parameters are then
    taken as untyped)."""
    try:
        return typing.get_type_hints(fn)
    except Exception:
        return {}


def parameters_schema(fn: Callable[..., Any]) -> tuple[dict[str, Any], list[str]]:
    """The JSON Schema of a function's parameters, from its type hints and defaults; and the
    parameters that have no hint (taken as strings). A dataclass or TypedDict that holds
    itself, at any depth, is written once in `$defs` and referred to."""
    hints = hints_of(fn)
    props: dict[str, Any] = {}
    required: list[str] = []
    untyped: list[str] = []
    reader = _SchemaReader()
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if name in hints:
            props[name] = reader.schema(hints[name])
        else:
            props[name] = {"type": "string"}
            untyped.append(name)
        if param.default is param.empty:
            required.append(name)
        elif _jsonable(param.default):
            props[name]["default"] = param.default
    schema: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        schema["required"] = required
    if reader.defs:
        schema["$defs"] = reader.defs
    return schema, untyped


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError, RecursionError):
        return False


class _SchemaReader:
    """Type hints to JSON Schema; a class met again inside itself becomes a `$ref` to `$defs`."""

    def __init__(self) -> None:
        self.defs: dict[str, Any] = {}
        self._open: dict[Any, str] = {}  # the classes being read, by the name they have in $defs
        self._recursive: set[Any] = set()

    def schema(self, hint: Any) -> dict[str, Any]:
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if hint is Any or hint is inspect.Parameter.empty:
            return {}
        if hint is type(None):
            return {"type": "null"}
        if origin is Literal:
            return {"enum": [a for a in args if _jsonable(a)]}
        if origin in (typing.Union, types.UnionType):
            options = [self.schema(a) for a in args]
            return options[0] if len(options) == 1 else {"anyOf": options}
        if origin in (list, tuple, set, frozenset, Sequence) or hint in (list, tuple, set):
            items = args[0] if args else Any
            out: dict[str, Any] = {"type": "array"}
            if items is not Any and items is not Ellipsis:
                out["items"] = self.schema(items)
            return out
        if origin is dict or hint is dict:
            out = {"type": "object"}
            if len(args) == 2 and args[1] is not Any:
                out["additionalProperties"] = self.schema(args[1])
            return out
        if isinstance(hint, type) and (dataclasses.is_dataclass(hint) or typing.is_typeddict(hint)):
            return self._class(hint)
        simple = {str: "string", int: "integer", float: "number", bool: "boolean"}
        if hint in simple:
            return {"type": simple[hint]}
        return {"type": "string"}

    def _class(self, hint: type) -> dict[str, Any]:
        if hint in self._open:
            self._recursive.add(hint)
            return {"$ref": f"#/$defs/{self._open[hint]}"}
        name = hint.__name__
        while name in self.defs or name in self._open.values():
            name += "_"
        self._open[hint] = name
        try:
            hints = hints_of(hint)
            if dataclasses.is_dataclass(hint):
                fields = dataclasses.fields(hint)
                schema = {"type": "object",
                          "properties": {f.name: self.schema(hints.get(f.name, Any)) for f in fields},
                          "required": [f.name for f in fields if f.default is dataclasses.MISSING
                                       and f.default_factory is dataclasses.MISSING],
                          "additionalProperties": False}
            else:
                schema = {"type": "object", "properties": {k: self.schema(v) for k, v in hints.items()},
                          "required": sorted(getattr(hint, "__required_keys__", ())), "additionalProperties": False}
        finally:
            del self._open[hint]
        if hint in self._recursive:
            self.defs[name] = schema
            return {"$ref": f"#/$defs/{name}"}
        return schema


def to_python(value: Any, hint: Any) -> Any:
    """A JSON argument as the function's hint asks (a dataclass from its object)."""
    if hint is not None and isinstance(hint, type) and dataclasses.is_dataclass(hint) and isinstance(value, dict):
        hints = hints_of(hint)
        return hint(**{k: to_python(v, hints.get(k)) for k, v in value.items()})
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            if isinstance(arg, type) and dataclasses.is_dataclass(arg) and isinstance(value, dict):
                return to_python(value, arg)
    if origin is list and args and isinstance(value, list):
        return [to_python(v, args[0]) for v in value]
    return value


# ---- tools the caller runs ---------------------------------------------------------------------

def kind(value: Any) -> str:
    """What a JSON value is, in words ("a number", "a list", ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true or false"
    return {str: "text", int: "a number", float: "a number", list: "a list", dict: "an object"}.get(type(value),
                                                                                                  type(value).__name__)


def _text(value: Any, where: str, file: Path, optional: bool = True) -> str | None:
    """A JSON value that must be text (or absent, where `optional`)."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise UsageError(f"{file}: {where} is {kind(value)}, not text")
    return value


def tools_in_messages(path: str) -> list[Tool]:
    """The `tools` of a messages file in the shape of a chat request (`{"messages", "tools"}`),
    which the caller runs; none where it has none."""
    data = read_json_file(path, "messages file")
    if not isinstance(data, dict) or data.get("tools") in (None, []):
        return []
    return tools_from_json(path, data)


def tools_from_json(path: str, data: Any = None) -> list[Tool]:
    """Tool definitions in OpenAI's `tools` shape, which the caller runs (`--tool-result`)."""
    file = Path(path).expanduser()
    if data is None:
        data = read_json_file(path, "tools file")
    if isinstance(data, dict) and "tools" in data:
        data = data["tools"]
    if not isinstance(data, list) or not data:
        raise UsageError(f"the tools file {file} must be a list of tools ({{\"type\": \"function\", \"function\": ...}})")
    tools = []
    for i, item in enumerate(data):
        fn = item.get("function") if isinstance(item, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise UsageError(f"tool {i} of {file} has no function name ({{\"type\": \"function\", \"function\": "
                             "{\"name\": ...}})")
        description = _text(fn.get("description"), f"tools[{i}].function.description", file) or ""
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise UsageError(f"the parameters of tool {fn['name']!r} in {file} are not a JSON Schema")
        tools.append(Tool(ToolSpec(fn["name"], description, params), None, file.name))
    return tools


def held_to_what_holds(tool: Tool) -> Tool:
    """`tool` with its calls held to what the constraint engine can enforce of its parameters
    (`ToolSpec.held`), where they use a keyword it cannot (a server's client, which checks the
    calls it runs, gives it: Claude Code's `propertyNames`); the model is told them whole."""
    if depth(tool.spec.parameters) > MAX_DEPTH:
        return tool  # (refused by check_tool_schemas)
    held, removed = enforceable(tool.spec.parameters)
    return dataclasses.replace(tool, spec=dataclasses.replace(tool.spec, held=held)) if removed else tool


def unenforced(tool: Tool) -> list[str]:
    """The keywords of `tool`'s parameters its calls are not held to."""
    return enforceable(tool.spec.parameters)[1] if tool.spec.held is not None else []


def check_tool_schemas(tools: Iterable[Tool]) -> None:
    """Each tool's parameters as --schema checks a schema: a call is held to them."""
    from quipu.engine.constraint import compile_grammar
    from quipu.engine.grammar import schema_grammar
    from quipu.errors import InvalidParameter

    for tool in tools:
        if depth(tool.spec.parameters) > MAX_DEPTH:  # (before anything walks it by recursion)
            raise UsageError(f"the parameters of tool {tool.spec.name!r} ({tool.source}) nest deeper than "
                             f"{MAX_DEPTH} levels")
        try:
            compile_grammar(schema_grammar(json.dumps(tool.spec.call_schema)))
        except InvalidParameter as exc:
            raise UsageError(f"the parameters of tool {tool.spec.name!r} ({tool.source}): {exc}") from None


# ---- a conversation from a file -----------------------------------------------------------------

def messages_from_file(path: str, media: list[Attachment] | None = None) -> list[Message]:
    """An OpenAI-style message list (`[{"role", "content", "tool_calls"?, "tool_call_id"?}]`, or
    `{"messages": [...]}`) as the conversation's messages, each field checked: a one-line error
    names the place (`messages[3].content[0].text is a number, not text`). With `media`, a
    part that is an image (`image_url`: a data URL, or an http(s) one) or a recording
    (`input_audio`) is read into it (`attachments.Attachment`), and the text holds
    `media_placeholder(n)` where the n-th goes."""
    return messages_of(read_json_file(path, "messages file"), Path(path).expanduser(), media)


def messages_of(data: Any, file: Path, media: list[Attachment] | None = None, fetch: bool = True) -> list[Message]:
    """`messages_from_file` of what a file (or a request, `file` naming it in errors) holds;
    `fetch` False (a server's request): a medium given as a link is refused, never fetched."""
    from quipu.sessions.base import Message
    from quipu.sessions.reasoning import FIELDS

    if isinstance(data, dict):
        data = data.get("messages")
    if not isinstance(data, list) or not data:
        raise UsageError(f"{file} must hold a list of messages ({{\"role\", \"content\"}})")
    out = []
    for i, m in enumerate(data):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise UsageError(f"{file}: {where} is {kind(m)}, not a message ({{\"role\", \"content\"}})")
        if m.get("role") not in ("system", "user", "assistant", "tool"):
            raise UsageError(f"{file}: {where}.role is not system, user, assistant or tool")
        content = _content(m.get("content"), f"{where}.content", file, media, fetch)
        calls = _calls(m.get("tool_calls"), f"{where}.tool_calls", file) if m.get("tool_calls") else None
        ident = _text(m.get("tool_call_id"), f"{where}.tool_call_id", file)
        name = _text(m.get("name"), f"{where}.name", file)
        # (an assistant's reasoning, in whichever field the file's writer used)
        key = next((k for k in FIELDS if m.get(k) is not None), None) if m["role"] == "assistant" else None
        reasoning = _text(m.get(key), f"{where}.{key}", file) if key else None
        out.append(Message(m["role"], content, tool_calls=calls, tool_call_id=ident,
                           name=name if m["role"] == "tool" else None, reasoning=reasoning or None))
    return out


def media_placeholder(n: int) -> str:
    """Where the n-th medium of a messages file goes in its text, until it is made ready."""
    return f"\ue004{n}\ue005"


def placed(messages: Sequence[Message], marks: Sequence[str]) -> list[Message]:
    """`messages` with each medium's placeholder (`media_placeholder`) made its marker, ready."""
    def marked(text: str) -> str:
        for n, mark in enumerate(marks):
            text = text.replace(media_placeholder(n), mark)
        return text

    return [dataclasses.replace(m, content=marked(m.content)) for m in messages]


def _content(content: Any, where: str, file: Path, media: list[Any] | None = None, fetch: bool = True) -> str:
    """A message's content: text, or a list of parts (text joined; media, with `media`, read
    there: see `messages_from_file`)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return defuse(content)  # (a text of its own is never taken for a marker)
    if not isinstance(content, list):
        raise UsageError(f"{file}: {where} is {kind(content)}, not text or a list of parts")
    texts: list[str | None] = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise UsageError(f"{file}: {where}[{j}] is {kind(part)}, not a part ({{\"type\": \"text\", \"text\"}})")
        kind_of = part.get("type", "text")
        if kind_of in ("image_url", "input_audio") and media is not None:
            from quipu.app.attachments import check_room, check_total

            check_room(media, f"{file}: a messages file")
            media.append(_medium(part, kind_of, f"{where}[{j}]", file, fetch))
            check_total(media, f"{file}: a messages file")
            texts.append(media_placeholder(len(media) - 1))
            continue
        if kind_of != "text":
            raise UsageError(f"{file}: {where}[{j}] is a {str(kind_of)[:40]!r} part; quipu reads text, image_url and "
                             "input_audio parts")
        texts.append(defuse(_text(part.get("text"), f"{where}[{j}].text", file, optional=False) or ""))
    return "".join(t for t in texts if t)


def _medium(part: dict[str, Any], kind_of: str, where: str, file: Path, fetch: bool = True) -> Attachment:
    """An image or a recording of a messages file: a data URL's bytes, base64 ones, or (`fetch`)
    what an http(s) URL serves."""
    import base64
    import binascii

    from quipu.app.attachments import MAX_ATTACHMENT_BYTES, attachment_of, read_attachment

    given = part.get(kind_of)
    value = (given.get("url") if kind_of == "image_url" else given.get("data") or given.get("url")) \
        if isinstance(given, dict) else given
    if not isinstance(value, str) or not value:
        raise UsageError(f"{file}: {where}.{kind_of} has no url or data")
    if "://" in value[:40] and not fetch:
        raise UsageError(f"{file}: {where}.{kind_of} is a link; give the {'image' if kind_of == 'image_url' else 'recording'}'s bytes as a data "
                         "URL (data:...;base64,...) or base64: no link is fetched")
    if value.startswith(("http://", "https://")):
        found = read_attachment(value)
    else:
        encoded = value.split(",", 1)[1] if value.startswith("data:") and "," in value else value
        if len(encoded) // 4 * 3 > MAX_ATTACHMENT_BYTES + 3:  # (said before it is decoded)
            raise UsageError(f"{file}: {where}.{kind_of} holds more than {MAX_ATTACHMENT_BYTES >> 20} MB")
        try:
            data = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise UsageError(f"{file}: {where}.{kind_of} is neither an http(s) URL nor base64 data") from None
        if len(data) > MAX_ATTACHMENT_BYTES:
            raise UsageError(f"{file}: {where}.{kind_of} holds more than {MAX_ATTACHMENT_BYTES >> 20} MB")
        found = attachment_of(f"{where} of {file.name}", data)
    wanted = "image" if kind_of == "image_url" else "audio"
    if found.kind.kind != wanted:
        raise UsageError(f"{file}: {where} is an {kind_of} part, but what it gives is {found.kind.format}, not "
                         f"{'an image' if wanted == 'image' else 'a recording'}")
    return found


def _calls(given: Any, where: str, file: Path) -> list[dict[str, Any]]:
    """An assistant message's tool calls, as the conversation keeps them."""

    if not isinstance(given, list):
        raise UsageError(f"{file}: {where} is {kind(given)}, not a list of calls")
    calls = []
    for j, call in enumerate(given):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise UsageError(f"{file}: {where}[{j}] has no function name")
        args = fn.get("arguments") or {}
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except (ValueError, RecursionError):
                raise UsageError(f"{file}: {where}[{j}].function.arguments are not JSON") from None
        if not isinstance(args, dict):
            raise UsageError(f"{file}: {where}[{j}].function.arguments are {kind(args)}, not an object")
        if depth(args) > MAX_DEPTH:
            raise UsageError(f"{file}: {where}[{j}].function.arguments nest deeper than {MAX_DEPTH} levels")
        if lone_surrogate(args):
            raise UsageError(f"{file}: {where}[{j}].function.arguments hold a lone surrogate (\\ud800-\\udfff), "
                             "which is no text")
        made: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        ident = _text(call.get("id"), f"{where}[{j}].id", file)
        if ident is not None:
            made = {"id": ident, **made}
        calls.append(made)
    return calls
