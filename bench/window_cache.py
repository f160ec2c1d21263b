"""A sliding-window model (Gemma 3 270M, when its package is installed) on the ring quipu keeps by
default, against llama.cpp's own programs, which keep the same ring, and against `--swa-full`
(every position in every window layer).

- Memory: the peak RSS of a whole `quipu run` (a 1,500-token prompt, 16 tokens) at 8k and 32k
  contexts, against `llama-completion` with the same context, step, threads and prompt, and
  against `quipu run --swa-full`.
- Decode: `quipu run --raw --no-cache --json`'s own decode speed at about 1,400 and 2,800 tokens
  of context, against `llama-bench -d` at its best (flash attention off and on), in pairs whose
  order turns round every repetition; a row is the median of the pairs' ratios.
- Sessions on the ring, in one process: resuming a 3,000-token session from its state against
  reading it again, and an /undo of a turn longer than the ring (from the checkpoint where that
  turn's prompt began) against reading the kept part again.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bench.common import context_text, median

DEPTHS = (1400, 2800)
CONTEXTS = (8192, 32768)
N_PROMPT = 1500


def bench_window_cache(threads: int, repeats: int, home: str, n_decode: int = 32) -> list[dict]:
    from bench.llama_bench import models

    windowed = models()[1:]
    if not windowed:
        return [{"what": "Gemma 3 270M's package is not installed: the sliding-window rows are not measured",
                 "quipu": ""}]
    from bench import llamacpp

    try:
        bins = llamacpp.build(("llama-completion", "llama-bench"))
    except Exception as exc:  # no compiler or sdist: say so
        return [{"what": f"llama.cpp's programs could not be built ({exc}); the window is not compared", "quipu": ""}]
    rows = []
    for name, path in windowed:
        rows += _memory(name, path, bins / "llama-completion", threads, home)
        rows += _decode(name, path, bins / "llama-bench", threads, repeats, home, n_decode)
        rows += _sessions(name, path, threads, repeats)
    return rows


def _peak(cmd: list[str], stdin: bytes | None, env: dict | None = None) -> int:
    """The peak RSS of `cmd`, run to its end (its own: a child of a fresh interpreter)."""
    code = ("import resource, subprocess, sys\n"
            "subprocess.run(sys.argv[1:], stdin=sys.stdin, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,"
            " check=True)\n"
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")
    r = subprocess.run([sys.executable, "-c", code, *cmd], input=stdin, capture_output=True,
                       env={**os.environ, **(env or {})}, check=True)
    return int(r.stdout.decode().split()[-1]) * 1024


def _memory(name: str, path: str, completion, threads: int, home: str) -> list[dict]:
    text = context_text(path, N_PROMPT)
    rows = []
    for n_ctx in CONTEXTS:
        quipu = [sys.executable, "-m", "quipu", "run", "--raw", "--no-cache", "-m", path, "--ctx", str(n_ctx),
                 "--threads", str(threads), "-n", "16", "--seed", "1"]
        native = [str(completion), "-m", path, "-c", str(n_ctx), "-b", "256", "-ub", "256", "-t", str(threads),
                  "-n", "16", "--seed", "1", "-no-cnv", "--simple-io", "--no-display-prompt", "-f", "/dev/stdin"]
        env = {"QUIPU_HOME": home + "/window"}
        ring, full, theirs = (_peak(quipu, text.encode(), env), _peak([*quipu, "--swa-full"], text.encode(), env),
                              _peak(native, text.encode()))
        mb = 2**20
        rows.append({"what": f"{name}: peak RSS of a run at a {n_ctx:,} context, {N_PROMPT:,}-token prompt (MB), "
                             "quipu (the ring) vs llama-completion",
                     "quipu": round(ring / mb), "llama.cpp": round(theirs / mb), "ratio": round(ring / theirs, 3)})
        rows.append({"what": f"{name}: the same at {n_ctx:,}, quipu --swa-full (every position) vs llama-completion "
                             "(MB)",
                     "quipu": round(full / mb), "llama.cpp": round(theirs / mb), "ratio": round(full / theirs, 3)})
    return rows


def _decode(name: str, path: str, bench_exe, threads: int, repeats: int, home: str, n_decode: int) -> list[dict]:
    from bench.llama_bench import _llama_bench, _prompt_and_bans, _quipu

    rows = []
    for depth in DEPTHS:
        text, bans = _prompt_and_bans(path, depth)
        ours: list[float] = []
        theirs: dict[bool, list[float]] = {False: [], True: []}
        test = f"tg{n_decode}@d{depth}"
        for rep in range(repeats):
            for ours_now in (rep % 2 == 1, rep % 2 == 0):
                if ours_now:
                    ours.append(_quipu(path, text, bans, n_decode, threads, home)["decode_tok_s"])
                else:
                    found = _llama_bench(bench_exe, path, threads, "-p", "0", "-n", str(n_decode), "-d", str(depth))
                    for fa in (False, True):
                        theirs[fa].append(found[(test, fa)])
        off, on = median(theirs[False]), median(theirs[True])
        paired = zip(ours, theirs[on > off], strict=True)
        rows.append({"what": f"{name}: decode tok/s at {depth:,} tokens of context, the ring, vs llama-bench at "
                             "its best (its ring)", "quipu": round(median(ours), 1),
                     "llama.cpp": f"{max(off, on):.1f} (flash attention off {off:.1f}, on {on:.1f})",
                     "ratio": round(median([q / t for q, t in paired]), 3)})
    return rows


def _sessions(name: str, path: str, threads: int, repeats: int) -> list[dict]:
    """Resume and a rewind past the ring, in one process, each against reading again."""
    from quipu.engine.settings import ContextSettings
    from quipu.engine.llama import LlamaBackend
    from quipu.sessions.inference import InferenceSession
    from quipu.sessions.params import SamplingParams

    settings = ContextSettings(n_ctx=4096, n_threads=threads)
    params = SamplingParams(seed=1, temperature=1.0)
    text = context_text(path, 3000)
    resume, reread, undo, undo_reread = [], [], [], []
    with LlamaBackend(path, settings) as backend, LlamaBackend(backend.model, settings) as other:
        tokens = backend.vocab.tokenize(text, add_special=True, parse_special=False)
        first, turn = tokens[:200], tokens[200:]
        for _ in range(repeats):
            going = InferenceSession(backend, params)
            going.set_context(first)
            for _ in range(8):
                going.infer_next_token()
            kept = list(going.tokens)
            going.set_context(kept + turn)  # (a turn longer than the ring)
            snap = going.snapshot()
            started = time.perf_counter()
            InferenceSession.from_snapshot(other, snap)
            resume.append(time.perf_counter() - started)
            started = time.perf_counter()
            InferenceSession(other, params).rebuild(snap.tokens, snap.n_decoded)
            reread.append(time.perf_counter() - started)
            started = time.perf_counter()
            going.rewind(len(kept))  # /undo: back to the checkpoint where the turn began
            going.set_context(kept)
            undo.append(time.perf_counter() - started)
            assert going.stats.cached_tokens >= len(kept) - 1
            started = time.perf_counter()
            InferenceSession(other, params).rebuild(kept, len(kept) - 1)
            undo_reread.append(time.perf_counter() - started)
    n = len(first) + 8 + len(turn)
    return [{"what": f"{name}: resuming a {n:,}-token session on the ring from its state (s), vs reading it again",
             "quipu": round(median(resume), 4), "re-read from scratch": round(median(reread), 3),
             "ratio": round(median(resume) / median(reread), 4)},
            {"what": f"{name}: /undo of a {len(turn):,}-token turn (longer than the ring) from the checkpoint where "
                     "it began (s), vs reading the kept part again",
             "quipu": round(median(undo), 4), "re-read from scratch": round(median(undo_reread), 3),
             "ratio": round(median(undo) / median(undo_reread), 4)}]
