"""Constrained output: JSON Schema, GBNF, Lark and regular expressions through quipu's constraint
engine (llguidance's masks on llama.cpp's logits), logit biases, and the session layer's Python
extension points (token filter, logits processors)."""

from __future__ import annotations

import datetime
import ipaddress
import json
import re
import uuid

import jsonschema
import numpy as np
import pytest

from quipu.engine.grammar import Grammar, schema_grammar
from quipu.errors import InvalidParameter
from quipu.sessions.conversation import Conversation
from quipu.sessions.inference import InferenceSession
from quipu.sessions.params import SamplingParams

HOT = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0)

# What JSON Schema asks of a value, keyword by keyword; strings bounded, so that a random
# model's output ends.
SCHEMAS = {
    "ranges": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.25},
        "level": {"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 7},
        "step": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}},
        "required": ["age", "score", "level", "step"], "additionalProperties": False},
    "lengths": {"type": "object", "properties": {
        "code": {"type": "string", "minLength": 2, "maxLength": 5},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3}},
        "required": ["code", "tags"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                "required": ["code"], "additionalProperties": False},
    "formats": {"type": "object", "properties": {
        "day": {"type": "string", "format": "date"}, "at": {"type": "string", "format": "time", "maxLength": 20},
        "id": {"type": "string", "format": "uuid"},
        "mail": {"type": "string", "format": "email", "maxLength": 24}},
        "required": ["day", "at", "id", "mail"], "additionalProperties": False},
    "enum_const": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]},
        "version": {"const": 2}}, "required": ["color", "size", "version"], "additionalProperties": False},
    "array": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "minItems": 2, "maxItems": 4},
    "defs": {"$defs": {"point": {"type": "object", "properties": {"x": {"$ref": "#/$defs/small"}, "y": {"$ref": "#/$defs/small"}},
                                 "required": ["x", "y"], "additionalProperties": False},
                      "small": {"type": "integer", "minimum": -99, "maximum": 99}},
             "type": "object", "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
             "required": ["from", "to"], "additionalProperties": False},
    "any_of": {"anyOf": [{"type": "integer", "minimum": 10, "maximum": 20}, {"type": "boolean"},
                         {"type": "string", "maxLength": 3}]},
    "optional": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999}, "note": {"type": "string", "maxLength": 6}},
                 "required": ["id"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                    "alive": {"type": "boolean"}},
                   "required": ["name", "alive"], "additionalProperties": False}},
        "required": ["person"], "additionalProperties": False},
    "properties_count": {"type": "object", "patternProperties": {"^[a-z]{1,3}$": {"type": "integer", "minimum": 0, "maximum": 999}},
                         "additionalProperties": False, "minProperties": 1, "maxProperties": 2},
    "prefix_items": {"type": "array", "prefixItems": [{"type": "string", "maxLength": 3}, {"type": "boolean"}],
                     "items": False},
}
FORMATS = jsonschema.FormatChecker()


@FORMATS.checks("time")
def _is_time(value) -> bool:
    return RFC["time"](value)  # (RFC 3339's: its Z may be a z, as jsonschema's own date-time reads it)


@FORMATS.checks("uuid")
def _is_uuid(value) -> bool:
    return str(uuid.UUID(value)) == value.lower()


@FORMATS.checks("date")
def _is_date(value) -> bool:
    return datetime.date.fromisoformat(value) is not None


# What JSON Schema 2020-12 means by each format llguidance enforces (RFC 3339, its appendix A for
# durations, RFC 5321/1123 for addresses and names, RFC 4122 for UUIDs), checked apart from quipu.
_RFC_TIME = r"(?:[01]\d|2[0-3]):[0-5]\d:(?:[0-5]\d|60)(?:\.\d+)?(?:[zZ]|[+-](?:[01]\d|2[0-3]):[0-5]\d)"
_DUR = r"(?:\d+H(?:\d+M(?:\d+S)?)?|\d+M(?:\d+S)?|\d+S)"


def _a_date(text: str) -> bool:
    """RFC 3339's full-date, as Python reads one: the days each month has, leap years."""
    try:
        return len(text) == 10 and datetime.date.fromisoformat(text) is not None
    except ValueError:
        return False


RFC = {
    "date": _a_date,
    "time": lambda v: re.fullmatch(_RFC_TIME, v) is not None,
    "date-time": lambda v: re.fullmatch(r"\d{4}-\d{2}-\d{2}[tT]" + _RFC_TIME, v) is not None and _a_date(v[:10]),
    "duration": lambda v: re.fullmatch(r"P(?:(?:\d+D|\d+M(?:\d+D)?|\d+Y(?:\d+M(?:\d+D)?)?)(?:T" + _DUR + r")?|T" + _DUR
                                       + r"|\d+W)", v) is not None,
    "email": lambda v: v.count("@") == 1 and all(v.split("@")) and len(v) <= 254 and not re.search(r"\s", v),
    "hostname": lambda v: len(v) <= 253 and all(re.fullmatch(r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?", label)
                                                 and len(label) <= 63 for label in v.split("."))
    and v.split(".")[-1][0].isalpha(),  # (RFC 1123: the highest-level label is alphabetic)
    "ipv4": lambda v: isinstance(ipaddress.ip_address(v), ipaddress.IPv4Address),
    "ipv6": lambda v: isinstance(ipaddress.ip_address(v), ipaddress.IPv6Address),
    "uuid": lambda v: str(uuid.UUID(v)) == v.lower(),
}
# The longest each format's text may be under quipu's bounds (nine digits of a second's fraction,
# of each number of a duration; RFC 5321's and RFC 1035's lengths).
LONGEST = {"date": 10, "time": 24, "date-time": 35, "duration": 62, "email": 254, "hostname": 253, "ipv4": 15,
           "ipv6": 39, "uuid": 36}


def bounded_outputs(backend, fmt: str, seeds, prompt: str) -> list[str]:
    """The strings written under `{"type": "string", "format": fmt}`, with no other bound given."""
    schema = {"type": "string", "format": fmt}
    texts = []
    for seed in seeds:
        session = InferenceSession(backend, HOT.replace(seed=seed, grammar=schema_grammar(json.dumps(schema))))
        gen = Conversation.start(session).send(prompt, max_tokens=LONGEST[fmt] + 8)
        assert gen.finish_reason == "stop", (fmt, seed, gen.text)  # it ended, within its bound
        value = json.loads(gen.text)
        assert len(value) <= LONGEST[fmt] and RFC[fmt](value), (fmt, value)
        texts.append(value)
    return texts


@pytest.mark.parametrize("fmt", RFC)
def test_every_format_ends_within_its_bound_and_means_what_json_schema_says(make_backend, fmt):
    # At temperature 1.0 with no maxLength, the random tiny model writes each format's text to
    # its end: a time's fraction of a second of at most nine digits, not digits without end.
    backend = make_backend(n_ctx=1024)
    values = bounded_outputs(backend, fmt, range(12), "give json")
    if fmt in ("time", "date-time"):
        assert all(len(m) <= 10 for v in values for m in re.findall(r"\.\d+", v))


@pytest.mark.model
def test_smollm2_writes_every_format_to_its_end(bundled_model):
    from quipu.engine.settings import ContextSettings
    from quipu.engine.llama import LlamaBackend

    with LlamaBackend(bundled_model, ContextSettings(n_ctx=1024)) as backend:
        for i, fmt in enumerate(RFC):
            bounded_outputs(backend, fmt, range(i * 8, i * 8 + 8), f"Write one {fmt} value as a JSON string.")


def check(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)


def outputs(backend, schema: dict, seeds, prompt: str, max_tokens: int) -> list[str]:
    """Replies under the schema, each from a fresh conversation with its own seed."""
    texts = []
    for seed in seeds:
        session = InferenceSession(backend, HOT.replace(seed=seed, grammar=schema_grammar(json.dumps(schema))))
        gen = Conversation.start(session).send(prompt, max_tokens=max_tokens)
        assert gen.finish_reason == "stop", (gen.finish_reason, gen.text)
        texts.append(gen.text)
    return texts


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_output_of_the_tiny_model_validates(make_backend, name):
    backend = make_backend(n_ctx=1024)
    for text in outputs(backend, SCHEMAS[name], range(10), "give json", 600):
        check(text, SCHEMAS[name])


@pytest.mark.model
def test_every_output_of_smollm2_validates(bundled_model):
    # 100 replies at temperature 1.0 across the schemas, every one valid.
    from quipu.engine.settings import ContextSettings
    from quipu.engine.llama import LlamaBackend

    seen = 0
    with LlamaBackend(bundled_model, ContextSettings(n_ctx=1024)) as backend:
        for i, name in enumerate(SCHEMAS):
            seeds = range(i * 10, i * 10 + (100 - seen if i == len(SCHEMAS) - 1 else 100 // len(SCHEMAS)))
            for text in outputs(backend, SCHEMAS[name], seeds, "Reply with a small JSON example.", 300):
                check(text, SCHEMAS[name])
                seen += 1
    assert seen == 100


def test_a_processor_forces_a_known_sequence(make_backend):
    backend = make_backend()
    wanted = backend.vocab.tokenize("the sky is blue", add_special=False, parse_special=False)
    session = InferenceSession(backend, HOT.replace(seed=1))
    seen = []

    def force(tokens, logits):
        assert isinstance(logits, np.ndarray) and logits.dtype == np.float32 and logits.shape == (backend.n_vocab,)
        seen.append(len(tokens))
        logits[:] = -np.inf
        logits[wanted[len(seen) - 1] if len(seen) <= len(wanted) else 4] = 0.0  # then the end token

    session.logits_processors.append(force)
    prompt = backend.vocab.tokenize("hello", add_special=True, parse_special=False)
    gen = session.complete(prompt, 40)
    assert gen.tokens == wanted and gen.finish_reason == "stop"
    assert seen[0] == len(prompt)  # the processor sees the history as it grows


def test_a_token_filter_allows_only_its_tokens(make_backend):
    backend = make_backend()
    allowed = backend.vocab.tokenize("sky blue", add_special=False, parse_special=False)
    session = InferenceSession(backend, HOT.replace(seed=2))
    session.token_filter = lambda tokens: allowed
    gen = session.complete(backend.vocab.tokenize("hello", add_special=True, parse_special=False), 24)
    assert len(gen.tokens) == 24 and set(gen.tokens) <= set(allowed)


def test_a_logit_bias_of_minus_infinity_bans_a_token(make_backend):
    backend = make_backend()
    prompt = backend.vocab.tokenize("the sky", add_special=True, parse_special=False)
    greedy = SamplingParams(temperature=0, repeat_penalty=1.0)
    free = InferenceSession(backend, greedy).complete(prompt, 12).tokens
    banned = free[0]
    biased = InferenceSession(make_backend(), greedy.replace(logit_bias=((banned, float("-inf")),)))
    assert banned not in biased.complete(prompt, 12).tokens


@pytest.mark.parametrize("schema, words", [
    ('{"type": "array", "uniqueItems": true}', "uses uniqueItems at /, which quipu's constraint engine cannot enforce"),
    ('{"properties": {"a": {"not": {"type": "string"}}}}', "uses not at /properties/a"),
    ('{"properties": {"a": {"type": "string", "maxLenght": 3}}}', "unknown keyword 'maxLenght' at /properties/a"),
    ('{"$ref": "#/$defs/nowhere"}', "$ref at / points to #/$defs/nowhere, which the schema does not have"),
    ('{"$ref": "https://example.com/s.json"}', "references within the schema only"),
    ('{"items": {"type": "strin"}}', "type at /items is 'strin'"),
    ('{"type":', "not valid JSON: Expecting value: line 1 column 9"),
    ('[1, 2]', "must be a JSON object"),
    ('{"type": "integer", "minimum": 5, "maximum": 1}', "minimum at / (5) is more than its maximum (1)"),
])
def test_a_schema_that_cannot_be_enforced_is_refused_by_name_and_place(schema, words):
    with pytest.raises(InvalidParameter, match=re.escape(words)):
        schema_grammar(schema)


def test_a_property_named_like_a_keyword_and_extensions_are_not_refused():
    schema_grammar('{"type": "object", "properties": {"minimum": {"type": "integer"}, "not": {}}, "x-note": 1}')


@pytest.mark.parametrize("kind", ["schema", "gbnf", "lark", "regex"])
def test_a_constrained_session_resumes_exactly(quipu, tiny_model, home, tmp_path, kind):
    # 32 tokens, then the session resumed in a new process for 32 more: the 64 of one run.
    grammars = {"schema": json.dumps({"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 40}),
                "gbnf": 'root ::= "[" item ("," item){30,60} "]"\nitem ::= [a-z ]{1,12}\n',
                "lark": 'start: "[" item ("," item)~30..60 "]"\nitem: /[a-z ]{1,12}/\n',
                "regex": "(the|sky|blue| |,){150,300}"}
    if kind in ("gbnf", "lark"):
        path = tmp_path / f"g.{kind}"
        path.write_text(grammars[kind])
        given = ("--grammar", str(path))
    else:
        given = (f"--{kind}", grammars[kind])
    args = ("-m", tiny_model, *given, "-t", "1.0", "--top-k", "0", "--top-p", "1", "--min-p", "0")
    for seed in range(1, 30):  # a seed whose 64 tokens do not end the reply early
        whole = json.loads(quipu("run", "--json", "-S", f"w{seed}", *args, "--seed", str(seed), "-n", "64",
                                 "list").stdout)
        if whole["finish_reason"] == "length":
            break
    assert whole["finish_reason"] == "length"
    first = quipu("run", "--json", "-S", "half", *args, "--seed", str(seed), "-n", "32", "list")
    rest = quipu("run", "--json", "-S", "half", "--continue", "-n", "32")  # the session keeps its grammar
    assert first.returncode == rest.returncode == 0, rest.stderr.decode()
    assert json.loads(first.stdout)["text"] + json.loads(rest.stdout)["text"] == whole["text"]
    record = json.loads((home / "data" / "sessions" / "half.json").read_text())
    assert record["params"]["grammar"]["kind"] == ("json_schema" if kind == "schema" else kind)
    done = quipu("run", "--json", "-S", "half", "--continue", "-n", "2000")
    text = record["messages"][-1]["content"] + json.loads(done.stdout)["text"]
    if kind == "schema":
        jsonschema.validate(json.loads(text), json.loads(grammars["schema"]))
    elif kind == "regex":
        assert re.fullmatch(grammars["regex"], text), text
    else:
        assert re.fullmatch(r"\[[a-z ]{1,12}(,[a-z ]{1,12})*\]", text), text


@pytest.mark.parametrize("kind, text, check", [
    ("gbnf", 'root ::= "id-" [0-9]{3} ("/" [a-z]{2})?\n', r"id-[0-9]{3}(/[a-z]{2})?"),
    ("lark", 'start: "id-" DIGIT DIGIT DIGIT ("/" /[a-z]{2}/)?\nDIGIT: /[0-9]/\n', r"id-[0-9]{3}(/[a-z]{2})?"),
    ("regex", r"id-[0-9]{3}(/[a-z]{2})?", r"id-[0-9]{3}(/[a-z]{2})?"),
])
def test_a_grammar_in_each_syntax_is_kept_to(quipu, tiny_model, tmp_path, kind, text, check):
    if kind == "regex":
        given = ("--regex", text)
    else:
        (tmp_path / f"g.{kind}").write_text(text)
        given = ("--grammar", str(tmp_path / f"g.{kind}"))
    for seed in range(8):
        r = quipu("run", "-m", tiny_model, *given, "-t", "1.0", "--seed", str(seed), "--json", "-n", "40", "x")
        reply = json.loads(r.stdout)
        assert reply["finish_reason"] == "stop" and re.fullmatch(check, reply["text"]), reply


def test_a_session_saved_with_a_gbnf_string_still_resumes():
    params = SamplingParams.from_dict({**HOT.replace(seed=1).to_dict(), "grammar": 'root ::= "a"'})
    assert params.grammar == Grammar("gbnf", 'root ::= "a"')
    assert SamplingParams.from_dict(params.to_dict()) == params


@pytest.mark.parametrize("args, words", [
    (["--schema", '{"type": "integer", "minimum": 1, "uniqueItems": true}'], "uniqueItems at /"),
    (["--schema", '{"type":'], "the schema is not valid JSON"),
    (["--schema", '"a string"'], "the schema must be a JSON object"),
    (["--schema", '{"properties": {"a": {"tpye": "string"}}}'], "unknown keyword 'tpye' at /properties/a"),
    (["--schema", '{"$ref": "#/definitions/a"}'], "points to #/definitions/a"),
    (["--schema", "@/no/such.json"], "cannot read the schema"),
    (["--grammar", "GBNF"], "the GBNF grammar is invalid: Expected ')' at line 2"),
    (["--grammar", "LARK"], "the Lark grammar is invalid: line 1, column 13"),
    (["--regex", "(("], "the regular expression is invalid: regex parse error: unclosed group"),
    (["--schema", '{"type": "integer"}', "--grammar", "GBNF"], "not --schema and --grammar"),
    (["--regex", "a", "--schema", "{}"], "not --schema and --regex"),
    (["--logit-bias", "hello"], "TOKEN=BIAS"),
    (["--logit-bias", "999999=1"], "not in the model's vocabulary"),
])
def test_bad_constraints_are_usage_errors(quipu, tiny_model, tmp_path, home, args, words):
    (tmp_path / "g.gbnf").write_text('root ::= ( "a"\nx ::= "b"\n')
    (tmp_path / "g.lark").write_text('start: "a" (\nfoo: "b"\n')
    files = {"GBNF": str(tmp_path / "g.gbnf"), "LARK": str(tmp_path / "g.lark")}
    r = quipu("run", "-m", tiny_model, "-S", "bad", *[files.get(a, a) for a in args], "hi")
    err = r.stderr.decode()
    assert r.returncode == 2 and words in err and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert r.stdout == b"" and not (home / "data" / "sessions" / "bad.json").exists()  # nothing else written


def test_a_cut_reply_under_a_schema_is_flagged(quipu, tiny_model):
    schema = '{"type": "array", "items": {"type": "string"}, "minItems": 3}'
    r = quipu("run", "-m", tiny_model, "--schema", schema, "-n", "3", "--json", "x")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["finish_reason"] == "length" and out["incomplete"] is True
    assert "incomplete and will not parse" in r.stderr.decode() and r.stderr.decode().count("\n") == 1
    whole = quipu("run", "-m", tiny_model, "--schema", '{"enum": ["yes", "no"]}', "-n", "20", "--json", "x")
    out = json.loads(whole.stdout)
    assert out["finish_reason"] == "stop" and out["incomplete"] is False and whole.stderr == b""
    plain = json.loads(quipu("run", "-m", tiny_model, "-n", "3", "--json", "x").stdout)
    assert "incomplete" not in plain  # (no grammar, nothing to be incomplete)


def test_chat_constrains_the_next_replies(quipu, tiny_model, tmp_path, home):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMAS["enum_const"]))
    lines = f"hello\n/schema {schema}\ngive json\n/schema off\nhello\n/schema /no/file\n/regex [0-9]{{4}}\nyear?\n"
    r = quipu("chat", "-m", tiny_model, "-n", "300", "--seed", "4", "-S", "c", input=lines)
    assert r.returncode == 0 and "Traceback" not in r.stderr.decode()
    assert "cannot read the schema" in r.stderr.decode()
    replies = [m["content"] for m in json.loads((home / "data" / "sessions" / "c.json").read_text())["messages"]
               if m["role"] == "assistant"]
    jsonschema.validate(json.loads(replies[1]), SCHEMAS["enum_const"])
    with pytest.raises(ValueError):
        json.loads(replies[2])
    assert re.fullmatch(r"[0-9]{4}", replies[3])
    r = quipu("chat", "-m", tiny_model, "-n", "300", "--schema", json.dumps(SCHEMAS["enum_const"]), "-S", "d", input="x\n")
    reply = json.loads((home / "data" / "sessions" / "d.json").read_text())["messages"][-1]["content"]
    jsonschema.validate(json.loads(reply), SCHEMAS["enum_const"])


def test_a_batch_keeps_each_row_to_its_own_schema(quipu, tiny_model, tmp_path):
    # The command line's schema for every row, a row's own `schema` over it, a bad one an error row.
    rows = [{"prompt": "a"}, {"prompt": "b", "schema": SCHEMAS["array"]}, {"prompt": "c", "schema": {"type": "nope"}},
            {"prompt": "d", "schema": json.dumps(SCHEMAS["defs"])}, {"prompt": "e"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = quipu("run", "-m", tiny_model, "--batch", str(tmp_path / "rows.jsonl"), "--parallel", "3", "-t", "1.0",
              "--schema", json.dumps(SCHEMAS["enum_const"]), "-n", "400")
    assert r.returncode == 0, r.stderr.decode()  # (an error row is a row written)
    out = [json.loads(line) for line in r.stdout.decode().splitlines()]
    assert "type at / is 'nope'" in out[2]["error"]
    for row, schema in zip([out[0], out[1], out[3], out[4]], ["enum_const", "array", "defs", "enum_const"], strict=True):
        assert row["finish_reason"] == "stop" and row["incomplete"] is False, row
        check(row["text"], SCHEMAS[schema])
    cut = quipu("run", "-m", tiny_model, "--batch", "-", "--schema", json.dumps(SCHEMAS["defs"]), "-n", "3",
                input="a\n")
    [row] = [json.loads(line) for line in cut.stdout.decode().splitlines()]
    assert row["finish_reason"] == "length" and row["incomplete"] is True  # (a batch's rows are marked too)


def test_a_batch_row_under_a_grammar_answers_as_the_same_row_alone(quipu, tiny_model):
    # Masks computed together for the rows of a step give each row what it gets alone.
    args = ("-m", tiny_model, "--regex", "(the|sky|blue| ){1,30}", "-t", "1.0", "--seed", "7", "-n", "30")
    batch = quipu("run", *args, "--batch", "-", "--parallel", "4", input="one\ntwo\nthree\nfour\nfive\n")
    texts = [json.loads(line)["text"] for line in batch.stdout.decode().splitlines()]
    for i, prompt in enumerate(["one", "two", "three", "four", "five"]):
        seed = json.loads(batch.stdout.decode().splitlines()[i])["seed"]
        alone = quipu("run", *args[:-4], "--seed", str(seed), "-n", "30", "--json", prompt)
        assert json.loads(alone.stdout)["text"] == texts[i]


def test_json_may_be_compact_or_indented_but_no_long_run_of_blanks_is_open(tiny_model):
    from quipu.engine.constraint import Matcher
    from quipu.engine.model import LlamaModel

    model = LlamaModel(tiny_model)
    space = model.tokenize(" ", add_special=False, parse_special=False)[-1]
    newline = model.tokenize("\n", add_special=False, parse_special=False)[-1]
    grammar = schema_grammar(json.dumps(SCHEMAS["optional"]))
    brace = model.tokenize("{", add_special=False, parse_special=False)[-1]

    def allowed_after(tokens):
        matcher = Matcher(model, grammar)
        matcher.replay([brace, *tokens])
        matcher.fill()
        return matcher.allowed()

    assert allowed_after([])[space] and allowed_after([])[newline]  # compact, spaced or indented: the model's choice
    assert not allowed_after([space])[space]  # one space, not two
    indent = [newline] + [space] * 32
    assert allowed_after(indent[:-1])[space] and not allowed_after(indent)[space]  # up to 32 of indentation
    assert not allowed_after([newline])[newline]
