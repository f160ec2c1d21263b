"""One surface fuzzed in a process of its own (so that a crash or a leak ends this process, not
the test run): `python fuzz_worker.py SURFACE SEED COUNT MODEL`. Hypothesis draws COUNT inputs
from SEED; each must give a result or one of quipu's own errors. Anything else fails, and
Hypothesis prints the smallest input it finds that does."""

from __future__ import annotations

import json
import sys

from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from quipu.errors import QuipuError

KEYWORDS = ["type", "properties", "items", "required", "enum", "const", "minLength", "maxLength", "minItems",
            "maxItems", "pattern", "format", "$ref", "$defs", "anyOf", "oneOf", "allOf", "additionalProperties",
            "prefixItems", "minimum", "maximum", "default", "description"]
TYPES = ["string", "number", "integer", "boolean", "object", "array", "null", "nosuch"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(TYPES + ["#/$defs/a", "#/nope", "^a+$", "((", "date", "email", "uuid"]) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(KEYWORDS) | st.text(max_size=5), inner, max_size=5),
    max_leaves=30,
)


@st.composite
def gbnf_texts(draw):
    def expr(depth):
        kind = draw(st.integers(0, 7 if depth < 40 else 4))
        if kind == 0:
            return json.dumps(draw(st.text(max_size=4)))
        if kind == 1:
            return draw(st.sampled_from(["[a-z]", "[^\\n]", "[0-9]{1,3}", "[", "[]", "[\\x00-\\x7f]"]))
        if kind == 2:
            return draw(st.sampled_from(["root", "item", "nosuch", "ws", "-x-"]))
        if kind == 3:
            return expr(depth + 1) + draw(st.sampled_from(["*", "+", "?", "{2}", "{0,5}", "{3,}", "{9999999}"]))
        if kind == 4:
            return draw(st.sampled_from(["", "\"", "(", ")", "|", "::=", "#c\n", "{"]))
        if kind == 5:
            return "(" * (n := draw(st.integers(1, 3000))) + expr(depth + 1) + ")" * n
        if kind == 6:
            return expr(depth + 1) + " | " + expr(depth + 1)
        return "(" + expr(depth + 1) + " " + expr(depth + 1) + ")"

    rules = [f"{draw(st.sampled_from(['root', 'item', 'ws', 'x']))} ::= {expr(0)}"
             for _ in range(draw(st.integers(0, 4)))]
    return "\n".join(rules)


@st.composite
def templates(draw):
    def expr():
        return draw(st.sampled_from([
            "1", "'x'", "messages", "messages[0].content", "m.content", "'ab' * 3", "'x' * 100000000", "10 ** 9",
            "2 ** 1000000", "1 / 0", "1 // 0", "messages | length", "messages | tojson", "range(5) | list",
            "range(10**9)", "'a' ~ 'b'", "none.x", "undefined_name", "[1,2] * 100000000", "'%s' % 'x'",
            "raise_exception('no')", "x", "loop.index", "bos_token", "add_generation_prompt",
        ]))

    def block(depth):
        kind = draw(st.integers(0, 5 if depth < 4 else 1))
        if kind == 0:
            return draw(st.text(max_size=6)).replace("{", "").replace("%", "")
        if kind == 1:
            return "{{ " + expr() + " }}"
        if kind == 2:
            return ("{% for x in " + draw(st.sampled_from(["messages", "range(100000)", "range(3)", "'abc'"]))
                    + " %}" + block(depth + 1) + "{% endfor %}")
        if kind == 3:
            return "{% if " + expr() + " %}" + block(depth + 1) + "{% else %}" + block(depth + 1) + "{% endif %}"
        if kind == 4:
            return "{% set x = " + expr() + " %}" + block(depth + 1)
        return draw(st.sampled_from(["{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "{{", "{% for %}", "}}"]))

    return "".join(block(0) for _ in range(draw(st.integers(1, 4))))


@st.composite
def configs(draw):
    lines = []
    for _ in range(draw(st.integers(0, 6))):
        table = draw(st.sampled_from(["", "[generation]", "[remote]", "[sessions]", "[cache]", "[models]", "[nope]"]))
        key = draw(st.sampled_from(["temperature", "top_k", "max_tokens", "ctx", "timeout", "url", "max_bytes",
                                    "max_state_bytes", "model", "system", "seed", "huggingface", "x"]))
        value = draw(st.sampled_from(["1", "0", "-1", "1e400", "nan", "inf", "-inf", "0.5", "\"text\"", "true",
                                      "[1, 2]", "{a = 1}", "99999999999999999999", "\"http://[::1\"", "", "="]))
        lines += [table, f"{key} = {value}"]
    return "\n".join(lines)


ROW_KEYS = ["prompt", "messages", "id", "system", "seed", "max_tokens", "temperature", "top_p", "top_k", "min_p",
            "repeat_penalty", "stop", "role", "content", "x"]
row_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=10) | st.sampled_from(["user", "assistant", "system"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(ROW_KEYS), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def batch_files(draw):
    rows = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.integers(0, 3))
        if kind == 0:
            rows.append(json.dumps(draw(st.dictionaries(st.sampled_from(ROW_KEYS), row_values, max_size=6))))
        elif kind == 1:
            rows.append(draw(st.text(max_size=20)).replace("\n", " "))
        elif kind == 2:
            rows.append(draw(st.sampled_from(["{", "[1, 2]", "null", '{"prompt": NaN}', '{"top_k": 1e400}'])))
        else:
            rows.append(json.dumps({"messages": draw(st.lists(st.dictionaries(st.sampled_from(ROW_KEYS), row_values,
                                                                              max_size=3), max_size=3))}))
    return "\n".join(rows)


def keep(text: str) -> None:
    """The input about to be tried, where a test can read it should this process die on it."""
    import os

    where = os.environ.get("QUIPU_FUZZ_LAST")
    if where:
        with open(where, "w", encoding="utf-8") as f:
            f.write(text)


def main() -> None:
    surface, seed_value, count, model = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    checks = settings(max_examples=count, deadline=None, database=None, derandomize=False,
                      suppress_health_check=list(HealthCheck))

    if surface in ("schema", "gbnf"):
        from quipu.engine.constraint import Matcher
        from quipu.engine.grammar import Grammar, check_grammar_depth, schema_grammar
        from quipu.engine.model import LlamaModel
        from quipu.engine.native import lc

        loaded = LlamaModel(model)

        def grammar(made: Grammar) -> None:
            keep(made.text)
            matcher = Matcher(loaded, made)  # quipu's engine (llguidance): a first mask
            matcher.fill()
            if made.kind == "gbnf":  # and llama.cpp's parser, which llama-server runs on GBNF
                check_grammar_depth(made.text)
                sampler = lc.llama_sampler_init_grammar(loaded.vocab, made.text.encode(), b"root")
                if sampler:
                    lc.llama_sampler_free(sampler)

        if surface == "schema":
            @seed(seed_value)
            @checks
            @given(json_values)
            def case(value):
                try:
                    grammar(schema_grammar(json.dumps(value)))
                except QuipuError:
                    pass
        else:
            @seed(seed_value)
            @checks
            @given(gbnf_texts())
            def case(text):
                try:
                    grammar(Grammar("gbnf", text))
                except QuipuError:
                    pass
    elif surface == "template":
        from quipu.sessions.template import ChatTemplate

        messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]

        @seed(seed_value)
        @checks
        @given(templates())
        def case(source):
            keep(source)
            try:
                ChatTemplate(source).render(messages, True)
            except QuipuError:
                pass
    elif surface == "config":
        import tempfile
        from pathlib import Path

        from quipu.app.environment import GENERATION_TYPES, check_config
        from quipu.config import load_config

        folder = Path(tempfile.mkdtemp())

        @seed(seed_value)
        @checks
        @given(configs())
        def case(text):
            keep(text)
            path = folder / "config.toml"
            path.write_text(text)
            try:
                check_config(load_config(path, GENERATION_TYPES))
            except QuipuError:
                pass
    elif surface == "batch":
        from quipu.app.batch import read_rows, row_params
        from quipu.sessions.params import SamplingParams

        @seed(seed_value)
        @checks
        @given(batch_files())
        def case(text):
            keep(text)
            try:
                rows = read_rows(text)
            except QuipuError:
                return
            for row in rows:  # each row is runnable, or has its own error
                if row.error is None:
                    try:
                        row_params(SamplingParams(), row.fields, None)
                    except QuipuError:
                        pass
    elif surface == "events":
        import os

        from quipu.engine.base import SamplerSettings
        from quipu.engine.chat_api import ChatApiModel, ServerError, ServerSettings
        from quipu.engine.llama_server import LlamaServerModel
        from quipu.sessions.base import ReplySink

        # The server (tests/servers.py, mode "random") draws its events from the seed it is told.
        url = os.environ["QUIPU_FUZZ_URL"]
        client = ChatApiModel(ServerSettings(url=url, retries=0))
        served = LlamaServerModel(client, {"default_generation_settings": {"n_ctx": 512}})

        @seed(seed_value)
        @checks
        @given(st.integers(0, 2**31))
        def case(drawn):
            keep(str(drawn))
            client.request_json("POST", "/fuzz-seed", {"seed": drawn})
            for ask in (lambda: client.chat([{"role": "user", "content": "hi"}], params={}, max_tokens=8,
                                            sink=ReplySink()),
                        lambda: served.complete([1, 2, 3], SamplerSettings(), 1, 8, sink=ReplySink())):
                try:
                    ask()
                except ServerError:
                    pass
    elif surface == "cli":
        import contextlib
        import io
        import os

        from quipu.cli import build_app
        from quipu.cli.boundary import run_app

        os.environ.update(HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9")  # no network, ever
        for name in ("QUIPU_URL", "QUIPU_MODEL"):
            os.environ.pop(name, None)
        words = st.sampled_from([
            "run", "chat", "sessions", "models", "embed", "config", "cache", "show", "rm", "list", "info",
            "-t", "--temperature", "-n", "--top-k", "--top-p", "--seed", "--stop", "--ctx", "--kv-type", "--schema",
            "--grammar", "--logit-bias", "--url", "--batch", "--parallel", "-S", "--session", "--continue", "--raw",
            "--json", "--think", "--no-think", "--show-prompt", "-s", "--", "-", "nan", "inf", "-1", "1e400", "0",
            "x", "../x", "{", '{"type": "nosuch"}', "@/nonexistent", "http://[::1", "q4_0", "=", "--nope", "-h",
        ])

        @seed(seed_value)
        @checks
        @given(st.lists(words | st.text(max_size=6), max_size=8))
        def case(argv):
            keep(json.dumps(argv))
            if argv[:1] in (["run"], ["chat"], ["embed"]):  # a model that is not there: nothing loads
                argv = [argv[0], "-m", "/nonexistent/model.gguf", *argv[1:]]
            err = io.StringIO()
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                code = run_app(build_app, argv)
            assert code in (0, 1, 2, 130), (argv, code, err.getvalue())
            assert "Traceback" not in err.getvalue(), (argv, err.getvalue())
    else:
        raise SystemExit(f"no surface {surface}")
    case()
    print("ok", surface, count)


if __name__ == "__main__":
    main()
