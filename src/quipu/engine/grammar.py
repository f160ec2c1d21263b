"""Grammars: llama.cpp's GBNF, and JSON Schema turned into GBNF by llama-cpp-python's own
converter. A schema keyword the converter would silently ignore is refused by name, so that
what is generated always validates."""

from __future__ import annotations

import json
import os
import re
import tempfile
from typing import Any

from quipu.errors import InvalidParameter

# Keywords llama-cpp-python's converter (0.3.36) does not enforce: a schema using them is refused.
UNSUPPORTED = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "uniqueItems",
               "minProperties", "maxProperties", "not", "if", "then", "else", "contains", "patternProperties",
               "dependentRequired", "dependentSchemas", "unevaluatedProperties", "unevaluatedItems")
# Keywords whose values are schemas (or lists or maps of them): where a schema's keywords are.
_ONE = ("items", "additionalProperties", "additionalItems", "propertyNames")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions")


def parse_schema(text: str) -> dict[str, Any]:
    """A JSON Schema from its text, with the JSON parser's own message when it is not JSON."""
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise InvalidParameter(f"the schema is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidParameter(f"the schema nests deeper than {MAX_DEPTH} levels") from None
    if not isinstance(schema, dict):
        raise InvalidParameter("the schema must be a JSON object")
    if depth(schema) > MAX_DEPTH:
        raise InvalidParameter(f"the schema nests deeper than {MAX_DEPTH} levels")
    return schema


def depth(value: Any) -> int:
    """How deep JSON nests (counted without recursion)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        deepest = max(deepest, level)
        if isinstance(item, dict):
            todo += [(v, level + 1) for v in item.values()]
        elif isinstance(item, list):
            todo += [(v, level + 1) for v in item]
    return deepest


def unsupported_keywords(schema: Any, path: str = "") -> list[str]:
    """Where the schema uses a keyword the converter does not enforce, as 'keyword at path'."""
    found: list[str] = []
    if not isinstance(schema, dict):
        return found
    for key in UNSUPPORTED:
        if key in schema:
            found.append(f"{key} at {path or '/'}")
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            found += unsupported_keywords(schema[key], f"{path}/{key}")
    for key in _MANY:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                found += unsupported_keywords(sub, f"{path}/{key}/{i}")
    for key in _MAP:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                found += unsupported_keywords(sub, f"{path}/{key}/{name}")
    return found


# The most a length or a count may bound: each unit of it is a rule of the grammar.
MAX_BOUND = 1000
# The deepest a schema or a grammar may nest: llama.cpp's grammar parser recurses once a level,
# and a deep enough nesting overflows its stack (a segmentation fault, not an error).
MAX_DEPTH = 100
MAX_GRAMMAR_DEPTH = 2000  # (a bound of MAX_BOUND nests about that deep; measured here, 20,000 crashed)
_BOUNDS = (("minLength", "maxLength"), ("minItems", "maxItems"))


def subschemas(schema: Any, path: str = ""):
    """Every schema object within `schema`, with the place it stands (a JSON pointer)."""
    if not isinstance(schema, dict):
        return
    yield path or "/", schema
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            yield from subschemas(schema[key], f"{path}/{key}")
    for key in _MANY:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                yield from subschemas(sub, f"{path}/{key}/{i}")
    for key in _MAP:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                yield from subschemas(sub, f"{path}/{key}/{name}")


def check_values(schema: dict[str, Any]) -> None:
    """Refuses, by place, values no JSON could satisfy or no grammar should be made of: an empty
    `enum`, a length or count that is not a whole number from 0 to MAX_BOUND, a minimum above
    its maximum. Whole numbers written as floats (`2.0`) become integers."""
    for where, sub in subschemas(schema):
        if "enum" in sub and (not isinstance(sub["enum"], list) or not sub["enum"]):
            raise InvalidParameter(f"enum at {where} must list at least one value: no JSON could validate")
        for pair in _BOUNDS:
            for key in pair:
                if key not in sub:
                    continue
                value = sub[key]
                if isinstance(value, float) and value.is_integer():
                    sub[key] = value = int(value)
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise InvalidParameter(f"{key} at {where} must be a whole number of 0 or more, not {value!r}")
                if value > MAX_BOUND:
                    raise InvalidParameter(f"{key} at {where} is {value}; quipu's grammars bound a length or a "
                                           f"count to at most {MAX_BOUND} (leave {key} out for no bound)")
            low, high = sub.get(pair[0]), sub.get(pair[1])
            if low is not None and high is not None and low > high:
                raise InvalidParameter(f"{pair[0]} at {where} ({low}) is more than {pair[1]} ({high}): no value "
                                       "could validate")


def schema_to_gbnf(text: str) -> str:
    """GBNF for a JSON Schema, through llama-cpp-python's converter."""
    schema = parse_schema(text)
    check_values(schema)
    missing = unsupported_keywords(schema)
    if missing:
        raise InvalidParameter(f"the schema uses {', '.join(missing)}, which quipu's JSON Schema converter "
                               "cannot enforce; remove it or write a --grammar")
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        gbnf = json_schema_to_gbnf(json.dumps(schema))
    except (AssertionError, ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as exc:
        # The converter asserts on what it cannot read: a $ref to nowhere, an unknown type, a pattern.
        said = str(exc).replace("stdin#", "#").splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise InvalidParameter(f"the schema cannot be turned into a grammar: {said}") from None
    # The converter's `char` lets raw control characters into strings, which JSON forbids; this
    # is llama.cpp's own rule for it (common/json-schema-to-grammar.cpp).
    return re.sub(r"(?m)^char ::= .*$", lambda _: JSON_CHAR, gbnf)


JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] | [\\] (["\\bfnrt] | "u" [0-9a-fA-F]{4})'


def grammar_depth(gbnf: str) -> int:
    """How deep a GBNF grammar's groups nest, outside its strings, character classes and comments."""
    deepest = level = 0
    i, n = 0, len(gbnf)
    while i < n:
        c = gbnf[i]
        if c == "#":
            while i < n and gbnf[i] != "\n":
                i += 1
        elif c in "\"[":
            end = '"' if c == '"' else "]"
            i += 1
            while i < n and gbnf[i] != end:
                i += 2 if gbnf[i] == "\\" else 1
        elif c == "(":
            level += 1
            deepest = max(deepest, level)
        elif c == ")":
            level = max(0, level - 1)
        i += 1
    return deepest


_DEFINES = re.compile(r"[ \t]*::=")


def rule_names(gbnf: str) -> tuple[dict[str, int], dict[str, int]]:
    """({rule defined: its line}, {rule used: the line of its first use}), outside strings,
    character classes and comments."""
    defined: dict[str, int] = {}
    used: dict[str, int] = {}
    i, n, line = 0, len(gbnf), 1
    while i < n:
        c = gbnf[i]
        if c == "\n":
            line += 1
        elif c == "#":
            while i < n and gbnf[i] != "\n":
                i += 1
            continue
        elif c in "\"[":
            end = '"' if c == '"' else "]"
            i += 1
            while i < n and gbnf[i] != end:
                if gbnf[i] == "\n":
                    line += 1
                i += 2 if gbnf[i] == "\\" else 1
        elif c.isalnum() or c in "-_":
            start = i
            while i < n and (gbnf[i].isalnum() or gbnf[i] in "-_"):
                i += 1
            name = gbnf[start:i]
            if _DEFINES.match(gbnf, i):
                defined.setdefault(name, line)
            elif not name.isdigit():
                used.setdefault(name, line)
            continue
        i += 1
    return defined, used


def check_grammar_depth(gbnf: str) -> None:
    """What llama.cpp's grammar parser would crash on, refused before it sees it: groups nested
    too deep, and a rule that is used but never defined (root included)."""
    if grammar_depth(gbnf) > MAX_GRAMMAR_DEPTH:
        raise InvalidParameter(f"the grammar is invalid: its groups nest deeper than {MAX_GRAMMAR_DEPTH} levels")
    defined, used = rule_names(gbnf)
    if "root" not in defined:
        raise InvalidParameter("the grammar is invalid: it has no 'root' rule")
    missing = sorted((line, name) for name, line in used.items() if name not in defined)
    if missing:
        line, name = missing[0]
        raise InvalidParameter(f"the grammar is invalid: rule '{name}' is used but never defined (line {line})")


def init_grammar_sampler(lc, vocab, gbnf: str):
    """llama.cpp's grammar sampler for `gbnf` (root rule `root`); a grammar it cannot parse is
    refused with the parser's own message and the line it points at, and one that nests too deep
    for its parser before the parser sees it."""
    check_grammar_depth(gbnf)
    with _CapturedStderr() as captured:
        sampler = lc.llama_sampler_init_grammar(vocab, gbnf.encode("utf-8"), b"root")
    if sampler:
        return sampler
    said = [line.strip() for line in captured.text.splitlines() if line.strip()]
    message = next((line.split("error parsing grammar:", 1)[1].strip() for line in said
                    if "error parsing grammar:" in line), None)
    if message is None:
        has_root = re.search(r"^\s*root\s*::=", gbnf, re.M)
        message = "llama.cpp cannot parse it" if has_root else "it has no 'root' rule"
    where = ""
    at = re.search(r" at (.+)$", message)
    if at and at.group(1).strip() and at.group(1).strip() in gbnf:
        where = f" (line {gbnf[:gbnf.index(at.group(1).strip())].count(chr(10)) + 1})"
    raise InvalidParameter(f"the grammar is invalid: {message}{where}")


class _CapturedStderr:
    """Captures what native code writes to file descriptor 2 (llama.cpp's grammar parser prints
    its errors there rather than to its log)."""

    def __enter__(self) -> "_CapturedStderr":
        self.text = ""
        self._file = tempfile.TemporaryFile()
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        return self

    def __exit__(self, *exc) -> None:
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._file.seek(0)
        self.text = self._file.read().decode("utf-8", "replace")
        self._file.close()
