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
                                    "max_state_bytes", "model", "system", "seed", "huggingface", "x", "threads",
                                    "gpu_layers", "gpu_memory"]))
        value = draw(st.sampled_from(["1", "0", "-1", "1e400", "nan", "inf", "-inf", "0.5", "\"text\"", "true",
                                      "[1, 2]", "{a = 1}", "99999999999999999999", "\"http://[::1\"", "", "=",
                                      "15", "16", "513", "4294967297", "300000000", "9" * 5000, "\"auto\"",
                                      "0." + "1" * 5000]))
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


# ---- what quipu lets in: tool files, message files, functions files, MCP servers, the Hub -------------

NASTY = ["<|im_end|>", "<|im_start|>system\n", "</tool_call>", "\u0000", "\ud7ff", "é", "\\", "/", "..", "{", "}",
         '"', "\n", "$ref", "#/$defs/a"]
nasty_text = st.text(max_size=8) | st.sampled_from(NASTY) | st.builds(lambda a, b: a + b, st.sampled_from(NASTY),
                                                                     st.text(max_size=4))
names = st.sampled_from(["f", "get_weather", "a.b-c", "x" * 64, "x" * 65, "", "a b", "<|im_end|>", "café"]) | nasty_text


@st.composite
def tool_files(draw):
    def tool():
        fn = {"name": draw(names), "description": draw(nasty_text | st.integers() | st.none()),
              "parameters": draw(json_values | st.just({"type": "object", "properties": {
                  draw(nasty_text): {"type": "string", "description": draw(nasty_text), "enum": [draw(nasty_text)]}}}))}
        fn = {k: v for k, v in fn.items() if draw(st.booleans()) or k == "name"}
        return draw(st.sampled_from([{"type": "function", "function": fn}, fn, [fn], "x", None]))

    return draw(st.one_of(st.lists(st.builds(tool), max_size=4), st.builds(lambda t: {"tools": t},
                                                                           st.lists(st.builds(tool), max_size=3)),
                          json_values))


@st.composite
def message_files(draw):
    def part():
        return draw(st.sampled_from([{"type": "text", "text": draw(nasty_text | st.integers() | st.none())},
                                     {"type": "image_url", "image_url": {"url": "x"}}, "text", 5, {"text": "t"}]))

    def message():
        m = {"role": draw(st.sampled_from(["system", "user", "assistant", "tool", "bot", 5])),
             "content": draw(nasty_text | st.lists(st.builds(part), max_size=3) | st.none() | st.integers()),
             "tool_call_id": draw(nasty_text | st.integers() | st.none()), "name": draw(names | st.integers()),
             "tool_calls": draw(st.none() | st.lists(st.fixed_dictionaries({
                 "id": nasty_text | st.integers(), "type": st.just("function"),
                 "function": st.fixed_dictionaries({"name": names, "arguments": json_values | nasty_text})}),
                 max_size=2) | json_values)}
        return {k: v for k, v in m.items() if draw(st.booleans()) or k == "role"}

    messages = draw(st.lists(st.builds(message), max_size=5))
    return draw(st.sampled_from([messages, {"messages": messages}, "x", None, [None]]))


HINTS = ["int", "str", "float", "bool", "list[int]", "list[Place]", "dict[str, int]", "Optional[str]",
         "Literal['a', 'b']", "Literal[1, None]", "Place", "Node", "Optional['Place']", "'Nope'", "tuple[int, ...]",
         "set[str]", "Any", "list", "dict", "bytes", "Union[int, str]", "Callable", "TypedDictNode", "None"]
BODIES = ["return 1", "return 'x' * 100", "return None", "print('out'); return 2", "raise ValueError('no')",
          "import sys; sys.exit(3)", "import sys; print('err', file=sys.stderr); return {'a': [1]}",
          "return object()", "return float('nan')", "import os; os._exit(5)", "return [1] * 10000"]


@st.composite
def functions_files(draw):
    head = ["from __future__ import annotations" if draw(st.booleans()) else "",
            "from dataclasses import dataclass, field", "from typing import *",
            "@dataclass\nclass Place:\n    city: " + draw(st.sampled_from(HINTS))
            + "\n    near: Optional[Place] = None",
            "class Node(TypedDict):\n    name: str\n    kids: list[Node]",
            "TypedDictNode = Node"]
    if draw(st.integers(0, 9)) == 0:
        head.append(draw(st.sampled_from(["raise RuntimeError('import')", "def (:", "import nosuchmodule",
                                          "print('at import')"])))
    fns = []
    for i in range(draw(st.integers(0, 3))):
        params = []
        for j in range(draw(st.integers(0, 3))):
            hint = draw(st.sampled_from(HINTS + [""]))
            default = draw(st.sampled_from(["", " = 1", " = None", " = 'x'", " = []"]))
            params.append(f"p{j}" + (f": {hint}" if hint else "") + (default if default or not params else ""))
        fixed = []  # (a parameter without a default may not follow one with a default)
        seen_default = False
        for p in params:
            seen_default = seen_default or "=" in p
            fixed.append(p if "=" in p or not seen_default else p + " = None")
        doc = draw(nasty_text).replace("\\", "").replace('"', "")
        fns.append(f"def {draw(st.sampled_from(['f', 'g', 'h_' + str(i), '_private']))}({', '.join(fixed)}):\n"
                   f'    """{doc}"""\n    {draw(st.sampled_from(BODIES))}')
    return "\n\n".join(head + fns) + "\n"


@st.composite
def media_files(draw):
    """(a name, bytes): a recording's or an image's header with fields drawn anywhere in their
    range (rates, counts, sizes), or a small valid file with bytes flipped."""
    import struct

    kind = draw(st.sampled_from(["wav", "flac", "mp3", "png", "gif", "bmp", "flip"]))
    u32 = st.integers(0, 2**32 - 1) | st.sampled_from([0, 1, 8000, 16000, 44100, 2**31])
    tail = draw(st.binary(max_size=2000))
    if kind == "wav":
        channels, bits = draw(st.integers(0, 9) | st.just(65535)), draw(st.sampled_from([0, 8, 16, 24, 32, 7]))
        fmt = struct.pack("<HHIIHH", draw(st.sampled_from([1, 3, 2, 0xFFFE, 0])), channels, draw(u32), draw(u32),
                          draw(st.integers(0, 65535)), bits)
        chunks = b"fmt " + struct.pack("<I", draw(st.sampled_from([len(fmt), 0, 2**32 - 1]))) + fmt
        if draw(st.booleans()):
            chunks += b"fact" + struct.pack("<II", 4, draw(u32))
        chunks += b"data" + struct.pack("<I", draw(u32)) + tail
        return "x.wav", b"RIFF" + struct.pack("<I", draw(u32)) + b"WAVE" + chunks
    if kind == "flac":
        bits = draw(st.integers(0, 2**20 - 1)) << 44 | draw(st.integers(0, 7)) << 41 | draw(st.integers(0, 31)) << 36 \
            | draw(st.integers(0, 2**36 - 1))
        info = struct.pack(">HH", 4096, 4096) + b"\0" * 6 + struct.pack(">Q", bits) + b"\0" * 16
        head = draw(st.sampled_from([0x80, 0x00, 0x7F]))
        return "x.flac", b"fLaC" + bytes([head]) + len(info).to_bytes(3, "big") + info + tail
    if kind == "mp3":
        frame = bytes([0xFF, draw(st.sampled_from([0xFB, 0xF3, 0xE3, 0xFA])), draw(st.integers(0, 255)), 0])
        body = bytearray(draw(st.integers(0, 600)))
        if draw(st.booleans()) and len(body) > 48:
            body[32:44] = draw(st.sampled_from([b"Xing", b"Info"])) + struct.pack(">II", draw(u32), draw(u32))
        return "x.mp3", (frame + bytes(body)) * draw(st.integers(1, 5)) + tail
    if kind == "png":
        ihdr = struct.pack(">IIBBBBB", draw(u32), draw(u32), 8, draw(st.sampled_from([0, 2, 6, 3])), 0, 0, 0)
        return "x.png", b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr + b"\0" * 4 + tail
    if kind == "gif":
        return "x.gif", b"GIF89a" + struct.pack("<HH", draw(st.integers(0, 65535)), draw(st.integers(0, 65535))) + tail
    if kind == "bmp":
        return "x.bmp", b"BM" + bytes(12) + struct.pack("<Iii", 40, draw(st.integers(-2**31, 2**31 - 1)),
                                                       draw(st.integers(-2**31, 2**31 - 1))) + tail
    import io
    import wave

    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(bytes(3200))
    data = bytearray(out.getvalue())
    for _ in range(draw(st.integers(1, 8))):
        data[draw(st.integers(0, 60))] = draw(st.integers(0, 255))
    return "x.wav", bytes(data)


PROJECTOR_KEYS = ["clip.vision.image_size", "clip.vision.patch_size", "clip.use_gelu", "clip.projector_type",
                  "clip.vision.embedding_length", "clip.vision.block_count", "clip.vision.attention.layer_norm_epsilon",
                  "clip.vision.image_mean", "clip.vision.projector.scale_factor", "clip.has_vision_encoder"]
PROJECTOR_TENSORS = ["v.patch_embd.weight", "v.patch_embd.bias", "v.position_embd.weight", "v.blk.0.attn_q.weight",
                     "v.blk.0.attn_k.weight", "v.blk.0.ln1.weight", "v.blk.0.ffn_up.weight", "v.post_ln.weight",
                     "mm.input_projection.weight", "mm.soft_emb_norm.weight"]


@st.composite
def projector_faults(draw):
    """(tensors left out, keys retyped): what a hostile or broken projector file may hold."""
    drop = draw(st.lists(st.sampled_from(PROJECTOR_TENSORS), max_size=2, unique=True))
    values = st.sampled_from([("32", 8), (1, 4), (-1, 5), (1.5, 6), (True, 7), (2.0, 12), (2**33, 10), (0, 4),
                              (2**31, 4)])
    retype = draw(st.dictionaries(st.sampled_from(PROJECTOR_KEYS), values, max_size=2))
    return drop, retype


def keep(text: str) -> None:
    """The input about to be tried, where a test can read it should this process die on it."""
    import os

    where = os.environ.get("QUIPU_FUZZ_LAST")
    if where:
        with open(where, "w", encoding="utf-8") as f:
            f.write(text)


def main() -> None:
    from quipu.cli.boundary import quiet_libraries

    quiet_libraries()  # (as the command line does: the libraries' loggers print nothing)
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

        from quipu.app.environment import check_config
        from quipu.config import load_config
        from quipu.options import CONFIG

        folder = Path(tempfile.mkdtemp())

        @seed(seed_value)
        @checks
        @given(configs())
        def case(text):
            keep(text)
            path = folder / "config.toml"
            path.write_text(text)
            try:
                config = check_config(load_config(path, dict(CONFIG)))
            except QuipuError:
                return
            import types

            from quipu.app.turn_options import TurnOptions, context_settings, max_tokens, offload

            env = types.SimpleNamespace(config=config, environ={})
            for read in (context_settings, max_tokens, offload):  # (the values as a run reads them)
                try:
                    read(TurnOptions(), env)
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
        from quipu.engine.chat_api import ChatApiModel
        from quipu.engine.http import ServerError, ServerSettings
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
    elif surface in ("tools", "messages"):
        import tempfile
        from pathlib import Path

        from quipu.app.tool_files import check_tool_schemas, messages_from_file, tools_from_json
        from quipu.app.tools import Toolbox
        from quipu.engine.settings import ContextSettings
        from quipu.engine.llama import LlamaBackend
        from quipu.errors import TemplateError
        from quipu.sessions.conversation import Conversation
        from quipu.sessions.inference import InferenceSession
        from quipu.sessions.params import SamplingParams

        folder = Path(tempfile.mkdtemp())
        backend = LlamaBackend(model, ContextSettings(n_ctx=2048, n_threads=1))
        template = (Path(__file__).parent / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()

        def render(tools=(), messages=()):
            session = InferenceSession(backend, SamplingParams(seed=0))
            conv = Conversation.start(session, template=template, messages=list(messages))
            conv.update(tools=list(tools))
            try:
                conv.render_tokens(conv.messages, add_generation_prompt=True)
            except TemplateError:
                pass  # (a template may refuse a conversation, in its own words)

        @seed(seed_value)
        @checks
        @given(tool_files() if surface == "tools" else message_files())
        def case(value):
            text = json.dumps(value)
            keep(text)
            path = folder / "input.json"
            path.write_text(text)
            try:
                if surface == "tools":
                    box = Toolbox()
                    box.add(tools_from_json(str(path)))
                    check_tool_schemas(box.tools.values())
                    render(tools=box.specs)
                else:
                    render(messages=messages_from_file(str(path)))
            except QuipuError:
                pass
    elif surface == "functions":
        import tempfile
        from pathlib import Path

        from quipu.app.functions import functions_from_files
        from quipu.app.tool_files import check_tool_schemas
        from quipu.app.tooldefs import ToolFailure

        folder = Path(tempfile.mkdtemp())

        @seed(seed_value)
        @checks
        @given(functions_files(), json_values)
        def case(source, arguments):
            keep(source)
            path = folder / "fns.py"
            path.write_text(source)
            try:
                tools, _, worker = functions_from_files([str(path)], timeout=20)
            except QuipuError:
                return
            try:
                check_tool_schemas(tools)
                for tool in tools:
                    try:
                        tool.run(arguments if isinstance(arguments, dict) else {}, 20, lambda: False)
                    except ToolFailure:
                        pass
            except QuipuError:
                pass
            finally:
                worker.close()
    elif surface == "mcp":
        import tempfile
        from pathlib import Path

        import quipu.app.mcp as mcp_tools
        from quipu.app.tooldefs import ToolFailure

        mcp_tools.START_TIMEOUT = 1.5  # (a script that leaves a request unanswered is waited for this long)
        folder = Path(tempfile.mkdtemp())
        scripted = Path(__file__).with_name("scripted_server.py")
        answer = st.one_of(
            st.builds(lambda r: {"jsonrpc": "2.0", "result": r}, json_values),
            st.builds(lambda t: {"jsonrpc": "2.0", "result": {"tools": t}}, st.lists(st.fixed_dictionaries({
                "name": names, "description": nasty_text | st.integers(), "inputSchema": json_values}), max_size=3)),
            st.just({"jsonrpc": "2.0", "result": {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
                                                  "serverInfo": {"name": "s", "version": "1"}}}),
            st.builds(lambda c: {"jsonrpc": "2.0", "result": {"content": c}}, json_values),
            st.builds(lambda e: {"jsonrpc": "2.0", "error": e}, json_values),
            nasty_text, json_values)

        @seed(seed_value)
        @checks
        @given(st.lists(st.tuples(answer, st.sampled_from(["same", "other", "none"])), max_size=6))
        def case(script):
            text = json.dumps(script)
            keep(text)
            (folder / "script.json").write_text(text)
            server = {"command": sys.executable, "args": [str(scripted), str(folder / "script.json")], "env": {},
                      "env_pass": [], "timeout": 5.0, "prefix": None}
            try:
                [started] = mcp_tools.start_servers(["s"], {"s": server}, None)
            except QuipuError:
                return
            try:
                for tool in started.tools:
                    try:
                        tool.run({}, 1.5, lambda: False)
                    except ToolFailure:
                        pass
            finally:
                started.close()
    elif surface == "media":
        from quipu.app.attachments import attachment_of
        from quipu.engine.settings import ContextSettings
        from quipu.engine.llama import LlamaBackend
        from tinymodel import write_tiny_audio_projector, write_tiny_projector
        import tempfile
        from pathlib import Path

        folder = Path(tempfile.mkdtemp())
        senses = {}
        for sense, write in (("image", write_tiny_projector), ("audio", write_tiny_audio_projector)):
            backend = LlamaBackend(model, ContextSettings(n_ctx=4096, n_threads=1))
            backend.media.open_projector(write(folder / f"{sense}.gguf"))
            senses[sense] = backend

        @seed(seed_value)
        @checks
        @given(media_files())
        def case(file):
            name, data = file
            keep(json.dumps([name, data.hex()]))
            try:
                found = attachment_of(name, data)
            except QuipuError:
                return
            if found.kind.kind in senses:  # (what quipu let through reaches llama.cpp's decoders)
                try:
                    senses[found.kind.kind].media.media_mark(found.data)
                except QuipuError:
                    pass
    elif surface == "projector":
        import tempfile
        from pathlib import Path

        from quipu.engine.projector_check import check_encodes, check_keys
        from tinymodel import write_tiny_projector

        folder = Path(tempfile.mkdtemp())

        @seed(seed_value)
        @checks
        @given(projector_faults())
        def case(fault):
            drop, retype = fault
            keep(json.dumps([drop, {k: [repr(v[0]), v[1]] for k, v in retype.items()}]))
            path = folder / "mmproj.gguf"
            path.unlink(missing_ok=True)
            write_tiny_projector(path, drop=drop, retype=retype)
            try:
                check_keys(path)
                check_encodes(path, Path(model), None)  # (what crashes, crashes in a process of its own)
            except QuipuError:
                return
            from quipu.engine.settings import ContextSettings
            from quipu.engine.llama import LlamaBackend

            with LlamaBackend(model, ContextSettings(n_ctx=1024, n_threads=1)) as backend:  # checked: it loads here
                try:
                    backend.media.open_projector(path)
                except QuipuError:
                    pass
    elif surface == "hub":
        import os
        import tempfile
        import types
        from pathlib import Path

        from hub_server import start_hub

        root = Path(tempfile.mkdtemp())
        outside = Path(tempfile.mkdtemp()) / "outside"
        os.environ.update(HF_ENDPOINT="", HF_HUB_CACHE=str(root / "hf"), HF_HUB_DISABLE_XET="1",
                          HF_HUB_DISABLE_TELEMETRY="1", HF_TOKEN="")
        hub = start_hub({"fz/Fuzz-GGUF": {"a-Q4_K_M.gguf": b"GGUF" + bytes(64)}})
        os.environ["HF_ENDPOINT"] = hub.url
        from quipu.app import hub as hubs
        from quipu.app.hub_pull import pull as hub_pull

        env = types.SimpleNamespace(dirs=types.SimpleNamespace(models=root / "models"))
        paths = st.sampled_from(["a-Q4_K_M.gguf", str(outside / "x-Q4_K_M.gguf"), "../x-Q4_K_M.gguf",
                                 "a/../../x-Q4_K_M.gguf", "C:\\x-Q4_K_M.gguf", "a\\b-Q4_K_M.gguf",
                                 "x\x00-Q4_K_M.gguf", "sub/a-Q4_K_M.gguf", "chat_template.jinja",
                                 "b-00001-of-00002.gguf", ""]) | nasty_text
        entry = st.fixed_dictionaries({"type": st.sampled_from(["file", "directory", "x", 5]), "path": paths | st.integers(),
                                       "size": st.integers(-5, 2**62) | st.none() | nasty_text,
                                       "oid": st.just("0" * 40)},
                                      optional={"lfs": st.fixed_dictionaries({"oid": nasty_text | st.just("0" * 64),
                                                                              "size": st.integers(0, 100)})})
        listing = st.one_of(st.lists(entry, max_size=4).map(lambda x: json.dumps(x).encode()),
                            json_values.map(lambda x: json.dumps(x).encode()), st.binary(max_size=20))

        # A listing in pages: each page's address pointing to the next, the last to none, or
        # (forever) back to the first.
        paged = st.tuples(st.lists(listing, min_size=1, max_size=4), st.booleans())

        def pages_of(bodies: list, forever: bool):
            def serve(path: str):
                at = int(path.rsplit("page=", 1)[1]) if "page=" in path else 0
                following = at + 1 if at + 1 < len(bodies) else (0 if forever else None)
                return bodies[at], (None if following is None else f"/api/models/fz/Fuzz-GGUF/tree/x?page={following}")
            return serve

        @seed(seed_value)
        @checks
        @given(listing | paged, st.sampled_from(["0123456789abcdef0123456789abcdef01234567", "../../x", "", "a/b", "é"]),
               st.sampled_from([None, '"../../../x"', '"abc"', '""', "W/\"x\""]))
        def case(body, commit, etag):
            shown = body.decode("latin-1") if isinstance(body, bytes) else [[b.decode("latin-1") for b in body[0]],
                                                                              body[1]]
            keep(json.dumps([shown, commit, etag]))
            hub.listing = body if isinstance(body, bytes) else pages_of(*body)
            hub.commit, hub.etag = commit, etag
            try:
                hub_pull(hubs.HubRef.parse("fz/Fuzz-GGUF"), env.dirs)
            except QuipuError:
                pass
            assert not outside.exists(), "a listing wrote outside the cache"
            for path in Path("/").glob("*-Q4_K_M.gguf"):
                raise AssertionError(f"written at {path}")
    elif surface == "log":
        import contextlib
        import io
        import os
        import sqlite3
        import tempfile

        from quipu.app.answer_log import answer, find_answers, followed, open_log, remove_answers
        from quipu.app.environment import Environment
        from quipu.cli import build_app
        from quipu.cli.boundary import run_app
        from quipu.store.logbook import Record

        os.environ["QUIPU_HOME"] = tempfile.mkdtemp()
        env = Environment.load()
        book = open_log(env)
        book.add(Record("a prompt", "an answer", "m"))  # (the tables made, one row of quipu's)
        book.close()
        columns = ["prompt", "answer", "model", "command", "conversation", "system", "reasoning", "tool_calls",
                   "attachments", "options", "finish_reason", "prompt_tokens", "cached_tokens", "timings", "session",
                   "at", "id", "extra"]
        cells = (st.none() | st.integers(-2**63, 2**63 - 1) | st.floats() | st.text(max_size=12)
                 | st.binary(max_size=6) | st.builds(json.dumps, json_values))
        ids = st.integers(-2**70, 2**70).map(str) | st.text(alphabet="0123456789²٣-+ ", max_size=22)

        @seed(seed_value)
        @checks
        @given(st.dictionaries(st.sampled_from(columns), cells, max_size=6), st.booleans(), ids)
        def case(row, add_column, some_id):
            keep(repr((row, add_column, some_id)))
            with contextlib.closing(sqlite3.connect(env.log_path)) as db:  # a row some other tool wrote
                try:
                    if add_column and "extra" not in [c[1] for c in db.execute("PRAGMA table_info(answers)")]:
                        db.execute("ALTER TABLE answers ADD COLUMN extra")
                    if row:
                        db.execute(f"INSERT INTO answers ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                                   list(row.values()))
                    db.commit()
                except sqlite3.Error:  # (SQLite itself refused the row)
                    pass
            digits = some_id.strip().lstrip("+-")
            number = int(some_id) if digits.isascii() and digits.isdigit() else None
            asks = [lambda: find_answers(env, limit=5), lambda: find_answers(env, query="prompt", limit=5),
                    lambda: followed(env, some_id), lambda: followed(env, None)]
            if number is not None:
                asks += [lambda: answer(env, number), lambda: remove_answers(env, [number])]
            for ask in asks:
                try:
                    got = ask()
                except QuipuError:
                    continue
                for r in got if isinstance(got, list) else [got] if isinstance(got, Record) else []:
                    json.dumps(r.to_json(), ensure_ascii=False)
            for argv in (["logs", "-n", "5"], ["logs", "show", some_id], ["logs", "--json"]):
                err = io.StringIO()
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                    code = run_app(build_app, argv)
                assert code in (0, 1, 2) and "Traceback" not in err.getvalue(), (argv, code, err.getvalue())
    elif surface == "roles":
        import os
        import tempfile

        from quipu.app.environment import Environment
        from quipu.app.roles import add_role, load_roles, remove_role, role, roles_dir
        from quipu.options import ROLE

        os.environ["QUIPU_HOME"] = tempfile.mkdtemp()
        env = Environment.load()
        values = (st.floats() | st.integers(-2**80, 2**80) | st.text(max_size=10) | st.booleans()
                  | st.lists(st.text(max_size=5), max_size=3) | json_values)
        toml_bits = st.sampled_from(["x = ", "nan", "inf", "-inf", '"\x1b"', "'''", "[a]", "[[a]]", "=", "\n", "9" * 40,
                                     "{a = {b = [", "temperature", "system", "1979-05-27", "0x1F", '"\\u0000"'])

        @seed(seed_value)
        @checks
        @given(st.dictionaries(st.sampled_from([*ROLE, "prompt", "nosuch"]), values, max_size=5),
               st.lists(toml_bits | st.text(max_size=6), max_size=12))
        def case(given_values, bits):
            keep(repr((given_values, bits)))
            try:
                add_role(env, "r", given_values, replace=True)
            except QuipuError:
                pass
            else:  # what `roles add` wrote, its reader takes back, value for value
                back = role(env, "r").values
                assert set(back) == set(given_values), (back, given_values)
                for key, value in back.items():
                    was = given_values[key]
                    assert value == (tuple([was] if isinstance(was, str) else was) if isinstance(value, tuple)
                                     else str(was) if key == "ctx" else was), (key, value, was)
                remove_role(env, "r")
            roles_dir(env).mkdir(parents=True, exist_ok=True)
            (roles_dir(env) / "h.toml").write_text("".join(bits), encoding="utf-8", errors="surrogatepass")
            for ask in (lambda: load_roles(env), lambda: role(env, "h")):
                try:
                    ask()
                except QuipuError:
                    pass
            remove_role(env, "h")  # (a role written by hand, broken, is removed as any other)
            assert not (roles_dir(env) / "h.toml").exists()
    elif surface == "ints":
        import os
        import tempfile
        from pathlib import Path

        from quipu.app.batch import row_params
        from quipu.app.environment import Environment, check_config
        from quipu.app.roles import add_role, with_role
        from quipu.app.turn_options import TurnOptions, context_settings, max_tokens, sampling_params
        from quipu.cli import spec
        from quipu.options import C_INT, MAX_SEED, OPTIONS
        from quipu.sessions.params import SamplingParams

        home = Path(tempfile.mkdtemp())
        os.environ["QUIPU_HOME"] = str(home)
        (home / "config").mkdir()
        numbers = [o.name for o in OPTIONS.values() if o.kind is int]
        edges = st.sampled_from([C_INT, C_INT + 1, 2**32 - 1, 2**32, MAX_SEED, MAX_SEED + 1, 2**64, -1, -C_INT - 2,
                                 0, 1]) | st.integers(-2**70, 2**70)

        def ints_of(params):
            return {k: v for k, v in vars(params).items() if isinstance(v, int) and not isinstance(v, bool)}

        def reached(opts, env):
            """What reaches the engine: the sampling parameters, the reply's length, the threads."""
            ints = ints_of(sampling_params(opts, env))
            ints["max_tokens"] = max_tokens(opts, env)
            ints["threads"] = context_settings(opts, env).n_threads
            return ints

        @seed(seed_value)
        @checks
        @given(st.sampled_from(numbers), edges, st.sampled_from(["flag", "config", "role", "row"]))
        def case(name, value, source):
            keep(repr((name, value, source)))
            (home / "config" / "config.toml").write_text(f"[generation]\n{name} = {value}\n" if source == "config"
                                                         else "")
            env = Environment.load()
            try:
                if source == "flag":
                    got = reached(spec.turn_options({name: value}, env), env)
                elif source == "config":
                    check_config(env.config)
                    got = reached(TurnOptions(), env)
                elif source == "role":
                    add_role(env, "r", {name: value}, replace=True)
                    got = reached(with_role(TurnOptions(), "r", env)[0], env)
                else:
                    params, limit, _ = row_params(SamplingParams(), {name: value}, None)
                    got = {**ints_of(params), "max_tokens": limit}
            except QuipuError:
                return
            for key, held in got.items():  # (what a C int, or the seed's 64 bits, holds: never wrapped)
                assert held is None or (0 <= held <= MAX_SEED if key == "seed" else -C_INT - 1 <= held <= C_INT), \
                    (name, value, source, key, held)
    elif surface == "lines":
        from quipu.app.batch import input_lines, read_rows

        separators = st.sampled_from(["\u2028", "\u2029", "\u0085", "\f", "\v", "\x1c", "\x1d", "\x1e", "\r"])
        pieces = st.lists(st.text(max_size=6) | separators, max_size=8).map("".join)

        @seed(seed_value)
        @checks
        @given(st.lists(pieces, min_size=1, max_size=5))
        def case(lines):
            lines = [line.replace("\n", " ") for line in lines]
            text = "\n".join(lines)
            keep(repr(text))
            assert input_lines(text) == [line.removesuffix("\r") for line in lines]  # (a line ends at \n only)
            rows = read_rows("\n".join(json.dumps({"id": str(i), "prompt": line}) for i, line in enumerate(lines)))
            assert [row.id for row in rows] == [str(i) for i in range(len(lines))]  # (a row each, its id kept)
            assert all(row.prompt == line for row, line in zip(rows, lines, strict=True) if row.error is None)
    else:
        raise SystemExit(f"no surface {surface}")
    case()
    print("ok", surface, count)


if __name__ == "__main__":
    main()
