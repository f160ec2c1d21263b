"""Host work per token: what a reply's loop spends outside llama.cpp's decode, in one process on
the bundled model, so that a GPU's speed is not lost in Python. The reply's wall time less the
time inside `llama_decode`, a token, split into llama.cpp's sampler chain (`llama_sampler_sample`)
and the rest (quipu's own: the history, the text, stop strings, the sink); for greedy and for
the default sampling chain."""

from __future__ import annotations

import time
from typing import Any, Callable

from bench.common import median, model_path, prompt_of

N_TOKENS = 256


class _Timed:
    """A llama.cpp function that adds the seconds each call takes to `spent`."""

    def __init__(self, function: Callable[..., Any]):
        self.function, self.spent = function, 0.0

    def __call__(self, *args: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.function(*args)
        finally:
            self.spent += time.perf_counter() - started


def _one(model: str, threads: int, temperature: float) -> tuple[float, float, float]:
    """(seconds a token outside decode, of which in the sampler chain, the decode's) of one reply."""
    from quipu.engine.llama import LlamaBackend
    from quipu.engine.native import lc
    from quipu.engine.settings import ContextSettings
    from quipu.sessions.inference import InferenceSession
    from quipu.sessions.params import SamplingParams

    decode, sample = _Timed(lc.llama_decode), _Timed(lc.llama_sampler_sample)
    with LlamaBackend(model, ContextSettings(n_ctx=1024, n_threads=threads)) as backend:
        no_end = tuple((t, float("-inf")) for t in range(backend.n_vocab) if backend.is_eog(t))
        session = InferenceSession(backend, SamplingParams(seed=1, temperature=temperature, logit_bias=no_end))
        session.feed_prompt(backend.tokenize(prompt_of(64), add_special=True, parse_special=False))
        session.infer(1)  # (the prompt read, and a first token)
        lc.llama_decode, lc.llama_sampler_sample = decode, sample
        try:
            started = time.perf_counter()
            gen = session.infer(N_TOKENS)
            wall = time.perf_counter() - started
        finally:
            lc.llama_decode, lc.llama_sampler_sample = decode.function, sample.function
    n = len(gen.tokens)
    return (wall - decode.spent) / n, sample.spent / n, decode.spent / n


def bench_host(threads: int, repeats: int) -> list[dict]:
    model = model_path()
    rows = []
    for name, temperature in (("greedy", 0.0), ("the default sampling chain", 0.8)):
        runs = [_one(model, threads, temperature) for _ in range(repeats)]
        host, sampler, decode = (median([r[i] for r in runs]) * 1e6 for i in range(3))
        rows.append({"what": f"host work a token outside llama.cpp's decode (us), {name}: quipu's own and "
                             "llama.cpp's sampler chain (ratio: of the decode's time)",
                     "quipu": f"{host:.1f} ({host - sampler:.1f} quipu's, {sampler:.1f} the sampler's)",
                     "llama.cpp": f"{decode:.0f} (the decode)", "ratio": round(host / decode, 3)})
    return rows
