"""llama.cpp's native sampler chain, one per stream of tokens: the single context's, and each
row's of a batch."""

from __future__ import annotations

from typing import Sequence

from quipu.engine.base import SamplerSettings
from quipu.engine.native import lc


class SamplerChain:
    """llama.cpp's sampler chain for one stream of tokens: logit biases, the repeat penalty
    (whose window is the tokens accepted), then greedy, or top-k, top-p, min-p, temperature and
    a draw. The draw is a pure function of (seed, draw index): `reseed` puts a fresh one in
    before each token, so a restored session, or a row of a batch, draws what a lone
    uninterrupted run would."""

    def __init__(self, n_vocab: int, settings: SamplerSettings):
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        add = lambda s: lc.llama_sampler_chain_add(chain, s)  # noqa: E731
        if settings.logit_bias:
            biases = (lc.llama_logit_bias * len(settings.logit_bias))(*settings.logit_bias)
            add(lc.llama_sampler_init_logit_bias(n_vocab, len(settings.logit_bias), biases))
        if settings.repeat_penalty != 1.0 and settings.repeat_last_n != 0:
            # The penalty looks every candidate up in its window: over a large vocabulary that
            # costs more than the rest of the chain (1.2 ms a token of Gemma 3's 262k). Above 1
            # it lowers at most one token a window position, so the k it leaves on top are among
            # the k + window on top before it: those are kept first, and the draw is the same.
            kept = 1 if settings.temperature <= 0 else settings.top_k
            if (settings.repeat_penalty > 1.0 and kept > 0 and settings.repeat_last_n > 0
                    and kept + settings.repeat_last_n < n_vocab):
                add(lc.llama_sampler_init_top_k(kept + settings.repeat_last_n))
            add(lc.llama_sampler_init_penalties(n_vocab, settings.repeat_last_n, settings.repeat_penalty, 0.0, 0.0))
        if settings.temperature <= 0:
            add(lc.llama_sampler_init_greedy())
            self.draws = False
        else:
            if settings.top_k > 0:
                add(lc.llama_sampler_init_top_k(settings.top_k))
            if settings.top_p < 1.0:
                add(lc.llama_sampler_init_top_p(settings.top_p, 1))
            if settings.min_p > 0.0:
                add(lc.llama_sampler_init_min_p(settings.min_p, 1))
            add(lc.llama_sampler_init_temp(settings.temperature))
            add(lc.llama_sampler_init_dist(0))
            self.draws = True
        self.ptr = chain

    def reseed(self, draw_seed: int) -> None:
        if self.draws:
            last = lc.llama_sampler_chain_n(self.ptr) - 1
            lc.llama_sampler_free(lc.llama_sampler_chain_remove(self.ptr, last))
            lc.llama_sampler_chain_add(self.ptr, lc.llama_sampler_init_dist(draw_seed & 0xFFFFFFFF))

    def accept(self, tokens: Sequence[int]) -> None:
        for tok in tokens:
            lc.llama_sampler_accept(self.ptr, tok)

    def reset(self, window: Sequence[int]) -> None:
        lc.llama_sampler_reset(self.ptr)
        self.accept(window)

    def free(self) -> None:
        if self.ptr is not None:
            lc.llama_sampler_free(self.ptr)
            self.ptr = None
