"""`--batch`: rows side by side against lone runs and llama.cpp's own batched bench."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import PASSAGE, quipu_cmd, median, kv_bytes_per_token


BATCH_CODE = """
import json, sys, time
from quipu.app.batch import run_batch
from quipu.app.environment import Environment
from quipu.app.turn_options import TurnOptions
model, threads, parallel, n_decode, text = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.stdin.read()
rows = []
opts = TurnOptions.of(model=model, raw=True, temperature=0.0, max_tokens=n_decode, threads=threads, logit_bias=("2=-inf",))
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

    # quipu computes with flash attention off on the CPU alone (exact at any thread count);
    # batched-bench is measured so, and at its default (on, on this CPU).
    samples: dict[str, list] = {"solo": [], 8: [], 32: [], "processes": [], "native": [], "native_default": []}
    for _ in range(max(2, repeats)):  # two at least: a batch's rows must read the same each time
        samples["solo"].append(in_process(1))
        samples[8].append(in_process(8))
        samples[32].append(in_process(32))
        samples["native"].append(native("off"))
        samples["native_default"].append(native("auto"))
        samples["processes"].append(samples["solo"][-1]["tokens"] / processes())
    solo_rate = median([g["rate"] for g in samples["solo"]])
    processes_rate = median(samples["processes"])
    solo_texts = samples["solo"][0]["texts"]
    for parallel in (8, 32):
        rate = median([g["rate"] for g in samples[parallel]])
        first = samples[parallel][0]["texts"]
        same = sum(a == b for a, b in zip(first, solo_texts, strict=False))
        again = min(sum(a == b for a, b in zip(first, g["texts"], strict=False)) for g in samples[parallel][1:])
        row = {"what": f"--batch, {n_rows} rows, --parallel {parallel}: tokens/s (prompt + generated)",
               "quipu": round(rate, 1),
               "ratio": f"{rate / solo_rate:.2f}x one by one in one process, {rate / processes_rate:.2f}x {n_rows} "
                        f"processes; greedy: {same}/{n_rows} rows as one by one, {again}/{n_rows} as in the "
                        "other runs of this --parallel"}
        measured = [n[parallel] for n in samples["native"] if parallel in n]
        default = [n[parallel] for n in samples["native_default"] if parallel in n]
        if measured:
            row["llama.cpp"] = round(median(measured), 1)
            row["ratio"] = (f"{rate / median(measured):.2f}x llama.cpp (flash attention off, as quipu"
                            + (f"; at its default, on: {median(default):.1f} tok/s, {rate / median(default):.2f}x)"
                               if default else ")") + "; " + row["ratio"])
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
