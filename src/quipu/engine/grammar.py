"""Grammars as the user gives them, checked before any engine sees them: a JSON Schema, GBNF
(llama.cpp's format), a Lark grammar or a regular expression (`Grammar`). The checks here are
pure Python; the engine that enforces a grammar is `constraint.py` (llguidance) on a local model,
or the server's own on llama-server.

A JSON Schema keyword that the engine in use would not enforce is refused by name and place
(`uniqueItems at /properties/tags`), and so is a keyword that is no JSON Schema keyword at all (a
typo such as `maxLenght` would otherwise constrain nothing): what is generated always validates."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterator

from quipu.errors import InvalidParameter

KINDS = ("json_schema", "gbnf", "lark", "regex")


@dataclass(frozen=True)
class Grammar:
    """A constraint on every token of a reply: `kind` is one of KINDS, `text` its source (a
    schema as compact JSON)."""

    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidParameter(f"a grammar is one of {', '.join(KINDS)}, not {self.kind!r}")
        if not isinstance(self.text, str) or not self.text.strip():
            raise InvalidParameter(f"the {self.kind} grammar is empty")

    @property
    def what(self) -> str:
        return {"json_schema": "JSON Schema", "gbnf": "GBNF grammar", "lark": "Lark grammar",
                "regex": "regular expression"}[self.kind]


def grammar_kind(path: str) -> str:
    """The syntax of a grammar file, by its name: `.lark` is Lark, anything else GBNF."""
    return "lark" if path.lower().endswith(".lark") else "gbnf"


# ---- JSON Schema -----------------------------------------------------------------------------

# Keywords whose values are schemas (or lists or maps of them): where a schema's keywords are.
_ONE = ("items", "additionalProperties", "additionalItems", "propertyNames", "not", "if", "then", "else",
        "contains", "unevaluatedItems", "unevaluatedProperties")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")

# Every keyword of JSON Schema (2020-12, with draft-07's spellings) that constrains a value...
VALIDATION = frozenset(_ONE + _MANY + _MAP + (
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "format", "maxItems", "minItems", "uniqueItems", "minContains",
    "maxContains", "required", "maxProperties", "minProperties", "dependentRequired", "dependencies",
    "$ref", "$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor"))
# ... and those that only describe it (an OpenAPI `discriminator` among them).
ANNOTATIONS = frozenset((
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "readOnly", "writeOnly",
    "deprecated", "contentEncoding", "contentMediaType", "contentSchema", "$anchor", "$vocabulary", "id",
    "discriminator"))
# What llguidance (1.x) does not enforce: refused, where it would otherwise stop at the schema.
LOCAL_REFUSED = frozenset((
    "uniqueItems", "not", "if", "then", "else", "contains", "minContains", "maxContains", "propertyNames",
    "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedItems", "unevaluatedProperties",
    "$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor"))
# What llama-server's converter (common/json-schema.cpp) does not read: it would ignore them.
SERVER_REFUSED = LOCAL_REFUSED | {"multipleOf", "minProperties", "maxProperties", "patternProperties"}
SERVER_FORMATS = ("date", "time", "date-time", "uuid")
TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")

# The deepest a schema may nest (its JSON, counted without recursion).
MAX_DEPTH = 100
# The most a length or a count may be on llama-server: its converter writes one rule per unit.
SERVER_MAX_BOUND = 1000
_BOUNDS = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"))


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


def subschemas(schema: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
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
                yield from subschemas(sub, f"{path}/{key}/{_pointer(name)}")


def _pointer(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


def enforceable(schema: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`schema` without the keywords quipu's constraint engine cannot enforce (`LOCAL_REFUSED`,
    wherever they stand), and those keywords: what a value can be held to of it."""
    removed: set[str] = set()

    def held(value: Any, is_schema: bool) -> Any:
        if isinstance(value, list):
            return [held(v, is_schema) for v in value]
        if not isinstance(value, dict):
            return value
        if not is_schema:  # (a map of names to schemas)
            return {k: held(v, True) for k, v in value.items()}
        out = {}
        for key, sub in value.items():
            if key in LOCAL_REFUSED:
                removed.add(key)
            elif key in _ONE or key in _MANY:
                out[key] = held(sub, True)
            elif key in _MAP:
                out[key] = held(sub, False)
            else:
                out[key] = sub
        return out

    return held(schema, True), sorted(removed)


def check_schema(schema: dict[str, Any], *, server: bool = False) -> None:
    """Refuses, by keyword and place, what the engine would not enforce (llguidance, or with
    `server` llama-server's converter), a keyword JSON Schema does not have, an unknown type, a
    `$ref` to nowhere, and values no JSON could satisfy. Whole numbers written as floats (`2.0`)
    become integers."""
    refused = SERVER_REFUSED if server else LOCAL_REFUSED
    engine = "llama-server's JSON Schema converter" if server else "quipu's constraint engine"
    for where, sub in subschemas(schema):
        for key in sub:
            if key in refused:
                raise InvalidParameter(f"the schema uses {key} at {where}, which {engine} cannot enforce; "
                                       "remove it or write a --grammar")
            if key not in VALIDATION and key not in ANNOTATIONS and not str(key).startswith("x-"):
                raise InvalidParameter(f"the schema has an unknown keyword {key!r} at {where} (JSON Schema has no "
                                       "such keyword; extensions are spelled x-...)")
        _check_types(sub, where)
        if "$ref" in sub:
            _check_ref(schema, sub["$ref"], where)
        if server:
            _check_server_only(sub, where)
    check_values(schema, bound=SERVER_MAX_BOUND if server else None)
    check_finite(schema)


def _check_types(sub: dict[str, Any], where: str) -> None:
    if "type" not in sub:
        return
    kinds = sub["type"] if isinstance(sub["type"], list) else [sub["type"]]
    for kind in kinds:
        if kind not in TYPES:
            raise InvalidParameter(f"the schema's type at {where} is {kind!r}; a type is one of {', '.join(TYPES)}")


def _check_ref(schema: dict[str, Any], ref: Any, where: str) -> None:
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise InvalidParameter(f"$ref at {where} is {ref!r}; quipu follows references within the schema only "
                               "(#/$defs/...)")
    target = _pointed(schema, ref)
    if target is _NOWHERE:
        raise InvalidParameter(f"$ref at {where} points to {ref}, which the schema does not have")
    if not isinstance(target, (dict, bool)):
        raise InvalidParameter(f"$ref at {where} points to {ref}, which is not a schema")


_NOWHERE = object()  # what `_pointed` finds where a reference points at nothing


def _pointed(schema: dict[str, Any], ref: str) -> Any:
    """What `ref` (`#/$defs/x`, a JSON pointer within `schema`) points at; `_NOWHERE` where the
    schema holds nothing there."""
    target: Any = schema
    for part in ref[1:].lstrip("/").split("/") if ref not in ("#", "#/") else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isascii() and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return _NOWHERE
    return target


def _check_server_only(sub: dict[str, Any], where: str) -> None:
    kinds = sub["type"] if isinstance(sub.get("type"), list) else [sub.get("type")]
    if "number" in kinds:
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if key in sub:
                raise InvalidParameter(f"the schema uses {key} at {where} on a number, which llama-server's JSON "
                                       "Schema converter cannot enforce (it bounds integers only)")
    if "format" in sub and sub["format"] not in SERVER_FORMATS:
        raise InvalidParameter(f"the schema's format at {where} is {sub['format']!r}; llama-server's JSON Schema "
                               f"converter enforces only {', '.join(SERVER_FORMATS)}")
    if isinstance(sub.get("pattern"), str) and not (sub["pattern"].startswith("^") and sub["pattern"].endswith("$")):
        raise InvalidParameter(f"the pattern at {where} is not anchored with ^ and $, and llama-server's JSON "
                               "Schema converter would accept any string for it")


def check_values(schema: dict[str, Any], bound: int | None = None) -> None:
    """Refuses, by place, values no JSON could satisfy or no grammar should be made of: an empty
    `enum`, a length or count that is not a whole number of 0 or more (or above `bound`), a
    minimum above its maximum."""
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
                if bound is not None and value > bound:
                    raise InvalidParameter(f"{key} at {where} is {value}; llama-server's converter bounds a length "
                                           f"or a count to at most {bound} (leave {key} out for no bound)")
            low, high = sub.get(pair[0]), sub.get(pair[1])
            if low is not None and high is not None and low > high:
                raise InvalidParameter(f"{pair[0]} at {where} ({low}) is more than {pair[1]} ({high}): no value "
                                       "could validate")
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
            value = sub.get(key)
            if key in sub and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise InvalidParameter(f"{key} at {where} must be a number, not {value!r}")
        if isinstance(sub.get("multipleOf"), (int, float)) and sub["multipleOf"] <= 0:
            raise InvalidParameter(f"multipleOf at {where} must be more than 0, not {sub['multipleOf']!r}")
        low = sub.get("minimum", sub.get("exclusiveMinimum"))
        high = sub.get("maximum", sub.get("exclusiveMaximum"))
        if isinstance(low, (int, float)) and isinstance(high, (int, float)) and low > high:
            raise InvalidParameter(f"the minimum at {where} ({low}) is more than its maximum ({high}): no value "
                                   "could validate")


def check_finite(schema: dict[str, Any]) -> None:
    """Refuses a schema whose every value would be endless: a `$ref` that a value must follow
    back into itself (a property it requires, an item it must have, every branch of an `anyOf`),
    so that a reply held to it could never end. A fixpoint over the schema's objects, as a
    grammar's productive rules are found."""
    finite: set[int] = set()

    def holds(sub: Any) -> bool:
        if not isinstance(sub, dict):
            return sub is not False
        if id(sub) in finite:
            return True
        if isinstance(sub.get("$ref"), str) and not holds_ref(sub["$ref"]):
            return False
        if any(not holds(s) for s in sub.get("allOf") or ()):
            return False
        for key in ("anyOf", "oneOf"):
            if isinstance(sub.get(key), list) and sub[key] and not any(holds(s) for s in sub[key]):
                return False
        kinds = sub["type"] if isinstance(sub.get("type"), list) else [sub.get("type")]
        if any(k not in ("object", "array") for k in kinds):
            return True  # (a scalar, or no type: a value ends at once)
        if "object" in kinds:
            props: dict[str, Any] = sub["properties"] if isinstance(sub.get("properties"), dict) else {}
            if all(holds(props[name]) for name in sub.get("required") or () if name in props):
                return True
        if "array" in kinds:
            items: list[Any] = sub["prefixItems"] if isinstance(sub.get("prefixItems"), list) else []
            least = sub.get("minItems", 0)
            needed = items[:least] + ([sub.get("items")] if least > len(items) else [])
            if all(holds(s) for s in needed if s is not None):
                return True
        return False

    def holds_ref(ref: str) -> bool:
        found = _pointed(schema, ref)  # (a reference to nowhere, or to no schema, is refused by `_check_ref`)
        return not isinstance(found, dict) or id(found) in finite

    while True:  # (each pass finds more that end, until none more do)
        more = {key for key, sub in ((id(s), s) for _, s in subschemas(schema)) if key not in finite and holds(sub)}
        if not more:
            break
        finite |= more
    if id(schema) not in finite:
        stuck = next((w for w, sub in subschemas(schema) if id(sub) not in finite and "$ref" in sub), "/")
        raise InvalidParameter(f"no value of the schema ends: the $ref at {stuck} must be followed back into itself "
                               "without end")


def schema_grammar(text: str, *, server: bool = False) -> Grammar:
    """A checked JSON Schema, as compact JSON."""
    schema = parse_schema(text)
    check_schema(schema, server=server)
    return Grammar("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))


# ---- GBNF --------------------------------------------------------------------------------

# The deepest a GBNF grammar's groups may nest: llama.cpp's parser (on llama-server) recurses
# once a level, and a deep enough nesting overflows its stack (a segmentation fault, not an error).
MAX_GRAMMAR_DEPTH = 2000  # (measured here, 20,000 crashed)


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
