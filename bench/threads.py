"""The threads quipu chooses, which follow the machine's load: decode at a short context on the
same model, on an idle machine against llama-bench at its best (every thread count up to the
CPUs, flash attention off and on), and with one and with two busy processes beside (loops
bounded in time, stopped after) against the best fixed `--threads` quipu itself reaches beside
the same load, and llama-bench's default there. Each measure of a condition is taken in turn with
the others, their order turned round every other repetition, so that the load falls on all alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench.common import median, model_path, quipu_cmd
from bench.llama_bench import N_SHORT, _prompt_and_bans

N_DECODE = 128
BUSY = "import time\nend = time.monotonic() + 900\nwhile time.monotonic() < end:\n    pass\n"


def _ours(model: str, text: str, bans: list[str], home: str, threads: int | None = None) -> float:
    args = ["run", "--raw", "--json", "--no-cache", "-m", model, "--ctx", "4096", "-n", str(N_DECODE), "--seed", "1",
            *(["--threads", str(threads)] if threads is not None else [])]  # (none: quipu chooses)
    for ban in bans:
        args += ["--logit-bias", ban]
    _, r = quipu_cmd(*args, stdin=text.encode(), env={"QUIPU_HOME": home})
    return float(json.loads(r.stdout)["timings"]["decode_tok_s"])


def _theirs(exe: str, model: str, threads: str | None) -> dict[tuple[int, bool], float]:
    """{(threads, flash attention): tokens/s} of one llama-bench run (`threads` None: its default)."""
    out = subprocess.run([exe, "-m", model, "-p", "0", "-n", str(N_DECODE), "-d", str(N_SHORT), "-r", "1", "-o",
                          "json", *(["-t", threads, "-fa", "0,1"] if threads is not None else [])],
                         capture_output=True, check=True)
    return {(int(t["n_threads"]), bool(t["flash_attn"])): float(t["avg_ts"]) for t in json.loads(out.stdout)}


def _add(into: dict[tuple[int, bool], list[float]], measured: dict[tuple[int, bool], float]) -> None:
    for key, ts in measured.items():
        into.setdefault(key, []).append(ts)


def _condition(exe: str, model: str, text: str, bans: list[str], home: str, counts: list[int], busy_count: int,
               repeats: int) -> tuple[list[float], dict[int, list[float]], dict[tuple[int, bool], list[float]], list[float]]:
    """Beside `busy_count` busy processes: decode rates of quipu choosing its threads, of quipu
    with each fixed count, of llama-bench over every count (idle only) and of its default."""
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(busy_count)]
    ours: list[float] = []
    fixed: dict[int, list[float]] = {k: [] for k in counts}
    theirs: dict[tuple[int, bool], list[float]] = {}
    default: list[float] = []
    order: list[str | int] = ["ours", *counts, "default", *(["sweep"] if busy_count == 0 else [])]
    try:
        for rep in range(repeats):
            for what in (order if rep % 2 == 0 else order[::-1]):
                if what == "ours":
                    ours.append(_ours(model, text, bans, home))
                elif isinstance(what, int):
                    fixed[what].append(_ours(model, text, bans, home, what))
                elif what == "default":
                    default.extend(_theirs(exe, model, None).values())
                else:
                    _add(theirs, _theirs(exe, model, ",".join(map(str, counts))))
    finally:
        for p in busy:
            p.kill()
            p.wait()
    return ours, fixed, theirs, default


def bench_threads(repeats: int, home: str) -> list[dict]:
    from bench import llamacpp

    try:
        exe = str(llamacpp.build(("llama-bench",)) / "llama-bench")
    except Exception as exc:  # no compiler or sdist: say so
        return [{"what": f"llama-bench could not be built ({exc}); the threads not compared", "quipu": ""}]
    model = model_path()
    text, bans = _prompt_and_bans(model, N_SHORT)
    counts = list(range(1, len(os.sched_getaffinity(0)) + 1))
    rows = []
    for busy_count, words in ((0, "an idle machine"), (1, "one busy process beside"), (2, "two busy processes beside")):
        ours, fixed, theirs, default = _condition(exe, model, text, bans, home, counts, busy_count, repeats)
        mine = median(ours)
        best_k = max(counts, key=lambda k: median(fixed[k]))
        fixed_words = ", ".join(f"{k}: {median(fixed[k]):.1f}" for k in counts)
        if busy_count == 0:
            (t, fa), best = max(((key, median(v)) for key, v in theirs.items()), key=lambda kv: kv[1])
            rows.append({"what": f"decode tok/s with the threads quipu chooses, {words}: vs llama-bench at its best",
                         "quipu": f"{mine:.1f} (--threads {fixed_words})",
                         "llama.cpp": f"{best:.1f} ({t} threads, flash attention {'on' if fa else 'off'})",
                         "ratio": round(mine / best, 3)})
        else:
            rows.append({"what": f"decode tok/s with the threads quipu chooses, {words}: vs quipu's best fixed "
                                 "--threads (llama.cpp: llama-bench's default there)",
                         "quipu": f"{mine:.1f} (--threads {fixed_words})", "llama.cpp": round(median(default), 1),
                         "ratio": round(mine / median(fixed[best_k]), 3)})
    return rows
