"""Sessions: resuming a saved conversation, snapshots, the prompt cache, what a turn's save costs, a context shift."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import prompt_of, quipu_cmd, median, context_text


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

    from quipu.engine.settings import ContextSettings
    from quipu.engine.llama import LlamaBackend
    from quipu.sessions.inference import InferenceSession
    from quipu.store.statefile import decode_state, encode_state
    from quipu.store.files import atomic_write

    rows = []
    for kv in ("f16", "q8_0"):
        with LlamaBackend(model, ContextSettings(n_ctx=4096, n_threads=threads, kv_type=kv)) as b, tf.TemporaryDirectory() as d:
            toks = b.vocab.tokenize(prompt_of(1400), add_special=True, parse_special=False)[:1400]
            s = InferenceSession(b)
            s.feed_prompt(toks)
            path = Path(d) / "s.kv"
            t0 = time.perf_counter()
            snap = s.snapshot()
            atomic_write(path, encode_state({"n": len(toks)}, snap.state))
            t1 = time.perf_counter()
            blob = decode_state(path.read_bytes())
            b.memory.restore_bytes(blob.state)
            t2 = time.perf_counter()
            size = path.stat().st_size
        rows.append({"what": f"snapshot {kv}: save / load 1400 tokens (s), KB per token",
                     "quipu": f"{t1 - t0:.3f} / {t2 - t1:.3f}, {size / 1400 / 1024:.1f} KB"})
    return rows

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

def long_session(ctx: int, n_tokens: int) -> str:
    """The name of `turn_saves`' session."""
    return f"long-{ctx}-{n_tokens}"

def turn_saves(model: str, label: str, ctx: int, n_tokens: int, threads: int, repeats: int, home: str) -> list[dict]:
    """A 20-token turn's save on a session of `n_tokens` tokens, as quipu saves it, against the
    whole save of every turn (as before the state log) and against no save."""
    env = {"QUIPU_HOME": home}
    name = long_session(ctx, n_tokens)
    common = ["-m", model, "--threads", str(threads), "--ctx", str(ctx), "--seed", "1"]
    quipu_cmd("run", *common, "-S", name, "-n", "1", "Read this.", stdin=context_text(model, n_tokens).encode(), env=env)
    turn = ["run", "-S", "{name}", "-n", "20", "--json", "Go on, in a few words."]
    runs: dict[str, list[dict]] = {"pieces": [], "whole": [], "nosave": []}
    for i in range(repeats):  # interleaved, each on a fork of the same session
        for mode in runs:
            fork = f"{name}-{mode}-{i}"
            quipu_cmd("sessions", "fork", name, fork, env=env)
            runs[mode].append(save_turn(mode, home, *[a.replace("{name}", fork) for a in turn]))
    pieces, whole, nosave = ({k: median([r[k] for r in runs[m]]) for k in ("save_s", "bytes", "process_s")}
                             for m in ("pieces", "whole", "nosave"))
    state_mb = (Path(home) / "data" / "sessions" / f"{name}.kv").stat().st_size / 2**20
    return [
        {"what": f"{label}a 20-token turn on a {n_tokens:,}-token session ({state_mb:.0f} MB of state): bytes the "
                 "process writes (MB), quipu vs a whole save", "quipu": round(pieces["bytes"] / 2**20, 2),
         "re-read from scratch": f"{whole['bytes'] / 2**20:.2f} (whole save)",
         "ratio": round(pieces["bytes"] / whole["bytes"], 4)},
        {"what": f"{label}the same: time spent saving (s), quipu vs a whole save", "quipu": round(pieces["save_s"], 4),
         "re-read from scratch": f"{whole['save_s']:.4f} (whole save)",
         "ratio": round(pieces["save_s"] / whole["save_s"], 3)},
        {"what": f"{label}the same: the whole process (s), quipu vs the same turn with no save",
         "quipu": round(pieces["process_s"], 3), "re-read from scratch": f"{nosave['process_s']:.3f} (no save)",
         "ratio": round(pieces["process_s"] / nosave["process_s"], 3)},
    ]

def bench_saves(model: str, threads: int, repeats: int, home: str) -> list[dict]:
    """A short turn's save on a long session, against the whole save of every turn before the
    state log, on the bundled model and on a sliding-window one (Gemma 3, where installed);
    resuming a session saved as 50 pieces, against the same session saved whole; the peak
    memory of `sessions fork` of a ~120 MB session."""
    from bench.llama_bench import models

    env = {"QUIPU_HOME": home}
    common = ["-m", model, "--threads", str(threads), "--ctx", "8192", "--seed", "1"]
    rows = turn_saves(model, "", 8192, 5000, threads, repeats, home)
    for label, path in models()[1:]:
        rows += turn_saves(path, f"{label}, sliding window: ", 4096, 3000, threads, repeats, home)
    long = long_session(8192, 5000)
    state_mb = (Path(home) / "data" / "sessions" / f"{long}.kv").stat().st_size / 2**20

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

    fork_peak = max(peak_of("sessions", "fork", long, f"long-copy-{i}") for i in range(repeats))
    base_peak = max(peak_of("sessions", "list") for _ in range(repeats))
    rows.append({"what": f"sessions fork of a {state_mb:.0f} MB session: peak memory above `sessions list`'s (MB)",
                 "quipu": round((fork_peak - base_peak) / 2**20, 1), "re-read from scratch": "50 (the target)",
                 "ratio": round((fork_peak - base_peak) / (50 * 2**20), 3)})
    return rows

def bench_shift(model: str, threads: int, repeats: int) -> list[dict]:
    """A full 8,192-token context made room for: dropping the oldest exchange and the next first
    token, moving the kept cells down (quipu) against reading the kept part again."""
    import copy

    from quipu.engine.settings import ContextSettings
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
