"""Host work per token: what a reply's loop spends outside llama.cpp's decode, in one process on
the bundled model, so that a GPU's speed is not lost in Python. The reply's wall time less the
time inside `llama_decode`, a token, split into llama.cpp's sampler chain (`llama_sampler_sample`)
and the rest (quipu's own: the history, the seeded draw, the text, stop strings, the sink); for
greedy and for the default sampling chain. Beside it the floor of any loop in Python: a bare
ctypes loop over the same calls (a token's draw, its text, its decode) on the same context and
chain, timed alike, the two taking turns."""

from __future__ import annotations

import ctypes
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


def _timed(reply: Callable[[], int]) -> tuple[float, float, float]:
    """(seconds a token outside decode, of which in the sampler chain, the decode's) of `reply`,
    which makes a reply and says how many tokens it has."""
    from quipu.engine.native import lc

    decode, sample = _Timed(lc.llama_decode), _Timed(lc.llama_sampler_sample)
    lc.llama_decode, lc.llama_sampler_sample = decode, sample
    try:
        started = time.perf_counter()
        n = reply()
        wall = time.perf_counter() - started
    finally:
        lc.llama_decode, lc.llama_sampler_sample = decode.function, sample.function
    return (wall - decode.spent) / n, sample.spent / n, decode.spent / n


def _pair(model: str, threads: int, temperature: float) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """quipu's reply and the bare loop's, on one context (the same prompt read before each)."""
    from quipu.engine.llama import LlamaBackend
    from quipu.engine.native import lc
    from quipu.engine.sampler import SamplerChain
    from quipu.engine.settings import ContextSettings
    from quipu.sessions.inference import InferenceSession
    from quipu.sessions.params import SamplingParams

    with LlamaBackend(model, ContextSettings(n_ctx=1024, n_threads=threads)) as backend:
        no_end = tuple((t, float("-inf")) for t in range(backend.n_vocab) if backend.vocab.is_eog(t))
        params = SamplingParams(seed=1, temperature=temperature, logit_bias=no_end)
        prompt = backend.vocab.tokenize(prompt_of(64), add_special=True, parse_special=False)
        session = InferenceSession(backend, params)
        session.feed_prompt(prompt)
        session.infer(1)  # (the prompt read, and a first token)
        ours = _timed(lambda: len(session.infer(N_TOKENS).tokens))

        ctx, vocab = backend.native.ptr, backend.model.vocab
        chain = SamplerChain(backend.n_vocab, params)
        backend.memory.truncate(0)
        backend.prefill(prompt, 0)
        tok, buf = (lc.llama_token * 1)(), ctypes.create_string_buffer(64)

        def bare() -> int:
            for _ in range(N_TOKENS):
                tok[0] = lc.llama_sampler_sample(chain.ptr, ctx, -1)
                lc.llama_token_to_piece(vocab, tok[0], buf, 64, 0, False)
                assert lc.llama_decode(ctx, lc.llama_batch_get_one(tok, 1)) == 0
            return N_TOKENS

        theirs = _timed(bare)
        chain.free()
        session.close()
    return ours, theirs


def bench_host(threads: int, repeats: int) -> list[dict]:
    model = model_path()
    rows = []
    for name, temperature in (("greedy", 0.0), ("the default sampling chain", 0.8)):
        pairs = [_pair(model, threads, temperature) for _ in range(repeats)]
        host, sampler, decode = (median([p[0][i] for p in pairs]) * 1e6 for i in range(3))
        floor, floor_sampler = (median([p[1][i] for p in pairs]) * 1e6 for i in range(2))
        rows.append({"what": f"host work a token outside llama.cpp's decode (us), {name}: quipu's own and "
                             "llama.cpp's sampler chain, against a bare ctypes loop's (ratio: quipu's own to "
                             "the decode's time)",
                     "quipu": f"{host:.1f} ({host - sampler:.1f} quipu's, {sampler:.1f} the sampler's)",
                     "plain ctypes loop": f"{floor:.1f} ({floor - floor_sampler:.1f} the loop's, "
                                          f"{floor_sampler:.1f} the sampler's)",
                     "llama.cpp": f"{decode:.0f} (the decode)", "ratio": round((host - sampler) / decode, 4)})
    return rows
