"""The default thread count: quipu's against llama-bench's own default, same model, decode at a
short context, on an idle machine and with one busy process beside them (a loop bounded in time,
stopped after), as ratios. Each quipu run is paired with a llama-bench run, their order turned
round every other repetition."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.common import median, model_path, quipu_cmd
from bench.llama_bench import N_SHORT, _prompt_and_bans

N_DECODE = 64
BUSY = "import time\nend = time.monotonic() + 900\nwhile time.monotonic() < end:\n    pass\n"


def _ours(model: str, text: str, bans: list[str], home: str, threads: int | None = None) -> float:
    args = ["run", "--raw", "--json", "--no-cache", "-m", model, "--ctx", "4096", "-n", str(N_DECODE), "--seed", "1",
            *(["--threads", str(threads)] if threads is not None else [])]
    for ban in bans:
        args += ["--logit-bias", ban]
    _, r = quipu_cmd(*args, stdin=text.encode(), env={"QUIPU_HOME": home})  # (no --threads: the default)
    return float(json.loads(r.stdout)["timings"]["decode_tok_s"])


def _theirs(exe: str, model: str) -> float:
    out = subprocess.run([exe, "-m", model, "-p", "0", "-n", str(N_DECODE), "-d", str(N_SHORT), "-r", "1", "-o",
                          "json"], capture_output=True, check=True)  # (no -t: llama-bench's default)
    [test] = json.loads(out.stdout)
    return float(test["avg_ts"])


def bench_threads(repeats: int, home: str) -> list[dict]:
    from bench import llamacpp

    try:
        exe = str(llamacpp.build(("llama-bench",)) / "llama-bench")
    except Exception as exc:  # no compiler or sdist: say so
        return [{"what": f"llama-bench could not be built ({exc}); the default threads not compared", "quipu": ""}]
    from quipu.engine.settings import default_threads

    model = model_path()
    text, bans = _prompt_and_bans(model, N_SHORT)
    figures: dict[str, dict[str, list[float]]] = {}
    for condition in ("idle", "busy"):
        busy = subprocess.Popen([sys.executable, "-c", BUSY]) if condition == "busy" else None
        try:
            ours, theirs, one = figures.setdefault(condition, {"quipu": [], "llama.cpp": [], "one": []}).values()
            for rep in range(repeats):
                for ours_now in (rep % 2 == 1, rep % 2 == 0):
                    (ours if ours_now else theirs).append(_ours(model, text, bans, home) if ours_now
                                                          else _theirs(exe, model))
                one.append(_ours(model, text, bans, home, threads=1))  # (what the slow reply's hint says to try)
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
    rows = []
    for condition, words in (("idle", "an idle machine"), ("busy", "one busy process beside")):
        q, t = median(figures[condition]["quipu"]), median(figures[condition]["llama.cpp"])
        rows.append({"what": f"decode tok/s with the default threads (quipu {default_threads()}), {words}: quipu vs "
                             "llama-bench's default", "quipu": round(q, 1), "llama.cpp": round(t, 1),
                     "ratio": round(q / t, 3)})
    rows.append({"what": "quipu with --threads 1 (what a reply that slowed says to try), one busy process beside: "
                         "decode tok/s, against its default threads beside the same", "quipu":
                 round(median(figures["busy"]["one"]), 1),
                 "ratio": round(median(figures["busy"]["one"]) / median(figures["busy"]["quipu"]), 3)})
    for who in ("quipu", "llama.cpp"):
        busy_rate, idle_rate = median(figures["busy"][who]), median(figures["idle"][who])
        rows.append({"what": f"{who}'s default threads: decode with one busy process beside, against idle",
                     "quipu" if who == "quipu" else "llama.cpp": round(busy_rate, 1),
                     "ratio": round(busy_rate / idle_rate, 3)})
    return rows
