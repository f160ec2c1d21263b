"""GBNF, llama.cpp's grammar format, for what a server must constrain itself.

On a local model llguidance holds a reply to a Lark grammar. llama-server samples its own
tokens, so a grammar must go to it as GBNF: `lark_to_gbnf` writes the Lark that quipu itself
makes for a tool call (rules of literals, special tokens `<[id]>`, character classes,
alternatives, groups, `?`, `~m..n` repetitions and `%json` schemas) as GBNF. It is not a
translator of Lark at large: anything outside that subset is refused. A `%json` schema becomes
rules by llama-cpp-python's port of llama.cpp's own schema converter, with the blanks a
template's `tojson` writes (`{"a": 1, "b": [2, 3]}`), so that a call renders back as written.
"""

from __future__ import annotations

from typing import Any

import json
import re

from quipu.errors import InvalidParameter

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TOKEN = re.compile(r"<\[\d+\]>")
_REPEAT = re.compile(r"~(\d+)\.\.(\d+)")
# A regex terminal quipu writes: character classes (or one literal character) with quantifiers.
_CLASSES = re.compile(r"(?:\[(?:\\.|[^\]\\])+\](?:\*|\+|\?|\{\d+(?:,\d*)?\})?)+")


def literal(text: str) -> str:
    """`text` as a GBNF string literal."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def spelled(text: str, specials: dict[str, int]) -> str:
    """`text` as GBNF: the model's special tokens it spells as those tokens, the rest literal."""
    if not text:
        return '""'
    known = sorted((s for s in specials if s and s in text), key=len, reverse=True)
    if not known:
        return literal(text)
    parts = re.split("(" + "|".join(re.escape(s) for s in known) + ")", text)
    return " ".join(f"<[{specials[p]}]>" if p in specials else literal(p) for p in parts if p)


class _Schemas:
    """The rules of the `%json` schemas of one grammar, spelled as `tojson` spells JSON."""

    def __init__(self) -> None:
        from llama_cpp.llama_grammar import SchemaConverter

        converter: Any = SchemaConverter  # (llama-cpp-python's converter is unannotated: its values are Any here)
        self.converter = converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
        self.count = 0

    def rule(self, schema: dict[str, Any]) -> str:
        schema = _small_ranges({k: v for k, v in schema.items() if k != "x-guidance"})
        name = f"json-{self.count}"
        self.count += 1
        try:
            resolved = self.converter.resolve_refs(schema, name)
            return str(self.converter.visit(resolved, name))
        except Exception as exc:  # (the converter's errors are of many kinds)
            raise InvalidParameter(f"a tool's schema cannot be written as GBNF for the server: {exc}") from exc

    def rules(self) -> str:
        if not self.count:
            return ""
        text: str = self.converter.format_grammar()
        # tojson's blanks: none after `{` or `[` or at the end, one after `,` and `:`.
        text = text.replace('"," space', '", "').replace('":" space', '": "')
        return re.sub(r"^space ::= .*$", 'space ::= ""', text, flags=re.M)


def _small_ranges(schema: Any) -> Any:
    """The schema with each integer range of at most 256 values as the list of them (the
    converter keeps no bounds)."""
    if isinstance(schema, list):
        return [_small_ranges(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _small_ranges(v) for k, v in schema.items()}
    low, high = out.get("minimum"), out.get("maximum")
    if out.get("type") == "integer" and isinstance(low, int) and isinstance(high, int) and 0 <= high - low < 256 \
            and not set(out) - {"type", "minimum", "maximum", "description", "title", "default"}:
        return {"enum": list(range(low, high + 1))}
    return out


def lark_to_gbnf(lark: str, root_prefix: str = "") -> str:
    """The GBNF of `lark` (quipu's own call grammars), its `start` rule as `root`, after
    `root_prefix` (GBNF: what must come before it)."""
    schemas = _Schemas()
    rules = []
    for line in lark.splitlines():
        if not line.strip():
            continue
        name, sep, body = line.partition(":")
        if not sep or not _NAME.fullmatch(name.strip()):
            raise InvalidParameter(f"not a rule of quipu's grammars: {line[:60]!r}")
        rules.append((_rule_name(name.strip()), _body(body, schemas)))
    out = []
    for name, body in rules:
        if name == "root":
            body = f"{root_prefix} ( {body} )" if root_prefix else body
        out.append(f"{name} ::= {body}")
    return "\n".join(out) + "\n" + schemas.rules()


def _rule_name(name: str) -> str:
    return "root" if name == "start" else "q-" + name.replace("_", "-").lower()


def _body(text: str, schemas: _Schemas) -> str:
    out, at = [], 0
    decoder = json.JSONDecoder()
    while at < len(text):
        ch = text[at]
        if ch.isspace():
            at += 1
        elif ch == '"':
            value, end = decoder.raw_decode(text, at)
            out.append(literal(value) if value else '""')
            at = end
        elif text.startswith("%json", at):
            start = text.index("{", at)
            schema, at = decoder.raw_decode(text, start)
            out.append(schemas.rule(schema))
        elif (m := _TOKEN.match(text, at)):
            out.append(m.group(0))
            at = m.end()
        elif ch == "/":
            end = _regex_end(text, at)
            pattern = text[at + 1:end]
            if not _CLASSES.fullmatch(pattern):
                raise InvalidParameter(f"a regular expression GBNF cannot take: /{pattern}/")
            out.append(pattern)
            at = end + 1
        elif (m := _REPEAT.match(text, at)):
            out.append(f"{{{m.group(1)},{m.group(2)}}}")
            at = m.end()
        elif ch in "()|?":
            out.append(ch)
            at += 1
        elif (m := _NAME.match(text, at)):
            out.append(_rule_name(m.group(0)))
            at = m.end()
        else:
            raise InvalidParameter(f"not of quipu's grammars: {text[at:at + 20]!r}")
    return " ".join(out)


def _regex_end(text: str, start: int) -> int:
    at = start + 1
    while at < len(text):
        if text[at] == "\\":
            at += 2
            continue
        if text[at] == "/":
            return at
        at += 1
    raise InvalidParameter("a regular expression that does not end")
