"""Constrained output: JSON Schema and GBNF through llama.cpp's grammar sampler, logit biases,
and the session layer's Python extension points (token filter, logits processors)."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from quipu.engine.grammar import schema_to_gbnf
from quipu.errors import InvalidParameter
from quipu.sessions.conversation import Conversation
from quipu.sessions.inference import InferenceSession
from quipu.sessions.params import SamplingParams

HOT = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0)

# Nested objects, arrays with bounds, enums, numbers, optional fields, strings with patterns
# (strings bounded, so that a random model's output ends).
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                    "alive": {"type": "boolean"}},
                   "required": ["name", "alive"]}},
        "required": ["person"]},
    "array": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"type": "string", "enum": ["S", "M", "L"]}},
             "required": ["color", "size"]},
    "numbers": {"type": "object", "properties": {"price": {"type": "number"}, "count": {"type": "integer"}},
                "required": ["price", "count"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"id": {"type": "integer"},
                                                  "note": {"type": "string", "maxLength": 6}},
                 "required": ["id"]},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                                 "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                                          "maxItems": 3}},
                "required": ["code"]},
}


def outputs(backend, schema: dict, n: int, prompt: str, max_tokens: int) -> list[str]:
    """`n` replies under the schema, each from a fresh conversation with its own seed."""
    texts = []
    for seed in range(n):
        session = InferenceSession(backend, HOT.replace(seed=seed, grammar=schema_to_gbnf(json.dumps(schema))))
        gen = Conversation.start(session).send(prompt, max_tokens=max_tokens)
        assert gen.finish_reason == "stop", (gen.finish_reason, gen.text)
        texts.append(gen.text)
    return texts


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_output_of_the_tiny_model_validates(make_backend, name):
    backend = make_backend(n_ctx=1024)
    for text in outputs(backend, SCHEMAS[name], 20, "give json", 600):
        jsonschema.validate(json.loads(text), SCHEMAS[name])


@pytest.mark.model
def test_every_output_of_smollm2_validates(bundled_model):
    from quipu.engine.base import ContextSettings
    from quipu.engine.llama import LlamaBackend

    with LlamaBackend(bundled_model, ContextSettings(n_ctx=1024)) as backend:
        for name in ("nested", "array", "enum", "optional", "pattern"):
            for text in outputs(backend, SCHEMAS[name], 20, "Reply with a small JSON example.", 200):
                jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_a_processor_forces_a_known_sequence(make_backend):
    backend = make_backend()
    wanted = backend.tokenize("the sky is blue", add_special=False, parse_special=False)
    session = InferenceSession(backend, HOT.replace(seed=1))
    seen = []

    def force(tokens, logits):
        assert isinstance(logits, np.ndarray) and logits.dtype == np.float32 and logits.shape == (backend.n_vocab,)
        seen.append(len(tokens))
        logits[:] = -np.inf
        logits[wanted[len(seen) - 1] if len(seen) <= len(wanted) else 4] = 0.0  # then the end token

    session.logits_processors.append(force)
    prompt = backend.tokenize("hello", add_special=True, parse_special=False)
    gen = session.complete(prompt, 40)
    assert gen.tokens == wanted and gen.finish_reason == "stop"
    assert seen[0] == len(prompt)  # the processor sees the history as it grows


def test_a_token_filter_allows_only_its_tokens(make_backend):
    backend = make_backend()
    allowed = backend.tokenize("sky blue", add_special=False, parse_special=False)
    session = InferenceSession(backend, HOT.replace(seed=2))
    session.token_filter = lambda tokens: allowed
    gen = session.complete(backend.tokenize("hello", add_special=True, parse_special=False), 24)
    assert len(gen.tokens) == 24 and set(gen.tokens) <= set(allowed)


def test_a_logit_bias_of_minus_infinity_bans_a_token(make_backend):
    backend = make_backend()
    prompt = backend.tokenize("the sky", add_special=True, parse_special=False)
    greedy = SamplingParams(temperature=0, repeat_penalty=1.0)
    free = InferenceSession(backend, greedy).complete(prompt, 12).tokens
    banned = free[0]
    biased = InferenceSession(make_backend(), greedy.replace(logit_bias=((banned, float("-inf")),)))
    assert banned not in biased.complete(prompt, 12).tokens


@pytest.mark.parametrize("schema, words", [
    ('{"type": "integer", "minimum": 3}', "minimum at /"),
    ('{"type": "object", "properties": {"a": {"type": "number", "maximum": 9}}}', "maximum at /properties/a"),
    ('{"type": "array", "uniqueItems": true}', "uniqueItems"),
    ('{"type":', "not valid JSON: Expecting value: line 1 column 9"),
    ('[1, 2]', "must be a JSON object"),
])
def test_a_schema_the_converter_cannot_enforce_is_refused_by_name(schema, words):
    with pytest.raises(InvalidParameter, match=words):
        schema_to_gbnf(schema)


def test_a_property_named_like_a_keyword_is_not_refused():
    gbnf = schema_to_gbnf('{"type": "object", "properties": {"minimum": {"type": "integer"}}}')
    assert "minimum" in gbnf


def test_a_constrained_session_resumes_exactly(quipu, tiny_model, home):
    schema = json.dumps({"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 40})
    args = ("-m", tiny_model, "--schema", schema, "-t", "1.0", "--top-k", "0", "--top-p", "1", "--min-p", "0")
    for seed in range(1, 30):  # a seed whose 64 tokens do not end the array early
        whole = json.loads(quipu("run", "--json", "-S", f"w{seed}", *args, "--seed", str(seed), "-n", "64",
                                 "list").stdout)
        if whole["finish_reason"] == "length":
            break
    assert whole["finish_reason"] == "length"
    first = quipu("run", "--json", "-S", "half", *args, "--seed", str(seed), "-n", "32", "list")
    rest = quipu("run", "--json", "-S", "half", "--continue", "-n", "32")  # the session keeps its schema
    assert first.returncode == rest.returncode == 0, rest.stderr.decode()
    assert json.loads(first.stdout)["text"] + json.loads(rest.stdout)["text"] == whole["text"]
    record = json.loads((home / "data" / "sessions" / "half.json").read_text())
    assert record["params"]["grammar"] == schema_to_gbnf(schema)
    done = quipu("run", "--json", "-S", "half", "--continue", "-n", "2000")
    jsonschema.validate(json.loads(record["messages"][-1]["content"] + json.loads(done.stdout)["text"]),
                        json.loads(schema))


@pytest.mark.parametrize("args, words", [
    (["--schema", '{"type": "integer", "minimum": 1}'], "minimum at /"),
    (["--schema", "@/no/such.json"], "cannot read the schema"),
    (["--grammar", "GRAMMAR"], "line 2"),
    (["--schema", '{"type": "integer"}', "--grammar", "GRAMMAR"], "not both"),
    (["--logit-bias", "hello"], "TOKEN=BIAS"),
    (["--logit-bias", "999999=1"], "not in the model's vocabulary"),
])
def test_bad_constraints_are_usage_errors(quipu, tiny_model, tmp_path, args, words):
    grammar = tmp_path / "g.gbnf"
    grammar.write_text('root ::= ( "a"\nx ::= "b"\n')
    r = quipu("run", "-m", tiny_model, *[str(grammar) if a == "GRAMMAR" else a for a in args], "hi")
    err = r.stderr.decode()
    assert r.returncode == 2 and words in err and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_a_cut_reply_under_a_schema_is_flagged(quipu, tiny_model):
    schema = '{"type": "array", "items": {"type": "string"}, "minItems": 3}'
    r = quipu("run", "-m", tiny_model, "--schema", schema, "-n", "3", "--json", "x")
    assert r.returncode == 0 and json.loads(r.stdout)["finish_reason"] == "length"
    assert "incomplete" in r.stderr.decode()


def test_chat_constrains_the_next_replies(quipu, tiny_model, tmp_path, home):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMAS["enum"]))
    lines = f"hello\n/schema {schema}\ngive json\n/schema off\nhello\n/schema /no/file\n"
    r = quipu("chat", "-m", tiny_model, "-n", "60", "--seed", "4", "-S", "c", input=lines)
    assert r.returncode == 0 and "Traceback" not in r.stderr.decode()
    assert "cannot read the schema" in r.stderr.decode()
    replies = [m["content"] for m in json.loads((home / "data" / "sessions" / "c.json").read_text())["messages"]
               if m["role"] == "assistant"]
    jsonschema.validate(json.loads(replies[1]), SCHEMAS["enum"])
    with pytest.raises(ValueError):
        json.loads(replies[2])
    r = quipu("chat", "-m", tiny_model, "-n", "60", "--schema", json.dumps(SCHEMAS["enum"]), "-S", "d", input="x\n")
    reply = json.loads((home / "data" / "sessions" / "d.json").read_text())["messages"][-1]["content"]
    jsonschema.validate(json.loads(reply), SCHEMAS["enum"])


def test_the_grammar_tried_on_the_likeliest_tokens_first_is_valid_and_exact(make_backend, monkeypatch):
    import quipu.engine.llama as llama
    from quipu.sessions.inference import Snapshot

    monkeypatch.setattr(llama, "GRAMMAR_FIRST_TRY", 48)  # the tiny vocabulary is smaller than the default
    schema = SCHEMAS["pattern"]
    params = SamplingParams(temperature=1.0, top_k=8, repeat_penalty=1.3, logit_bias=((7, 2.0),),
                            grammar=schema_to_gbnf(json.dumps(schema)))
    backend = make_backend(n_ctx=1024)
    for text in [Conversation.start(InferenceSession(backend, params.replace(seed=s))).send("json", max_tokens=400).text
                 for s in range(10)]:
        jsonschema.validate(json.loads(text), schema)
    prompt = backend.tokenize("hello", add_special=True, parse_special=False)
    whole = InferenceSession(make_backend(), params.replace(seed=3)).complete(prompt, 24)
    first = InferenceSession(make_backend(), params.replace(seed=3))
    a = first.complete(prompt, 12)
    snap = first.snapshot()
    resumed = InferenceSession.from_snapshot(make_backend(), Snapshot(snap.tokens, snap.n_decoded, snap.draws,
                                                                      snap.params, snap.context, snap.state))
    resumed.start_reply(len(prompt))  # the reply so far is replayed into the grammar
    b = resumed.infer(12)
    assert a.tokens + b.tokens == whole.tokens[:len(a.tokens) + len(b.tokens)]
