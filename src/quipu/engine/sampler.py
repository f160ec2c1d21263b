"""llama.cpp's native sampler chain, one per stream of tokens: the single context's, and each
row's of a batch; and a context's sampling, a part of `LlamaBackend` (`llama.py`): the chain's
draw from the last logits, with a grammar's mask, filters and processors applied first."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Sequence

from quipu.engine.base import MEDIA_BASE, LogitsProcessor, SamplerSettings, TokenFilter
from quipu.engine.native import lc
from quipu.errors import EngineError

if TYPE_CHECKING:
    from quipu.engine.constraint import Matcher
    from quipu.engine.grammar import Grammar
    from quipu.engine.llama_context import NativeContext
    from quipu.engine.model import LlamaModel


class SamplerChain:
    """llama.cpp's sampler chain for one stream of tokens: logit biases, the repeat penalty
    (whose window is the tokens accepted), then greedy, or top-k, top-p, min-p, temperature and
    a draw. The draw is a pure function of (seed, draw index): `reseed` puts a fresh one in
    before each token, so a restored session, or a row of a batch, draws what a lone
    uninterrupted run would."""

    def __init__(self, n_vocab: int, settings: SamplerSettings):
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())

        def add(sampler: Any) -> None:
            lc.llama_sampler_chain_add(chain, sampler)

        if settings.logit_bias:
            biases = (lc.llama_logit_bias * len(settings.logit_bias))(*settings.logit_bias)
            add(lc.llama_sampler_init_logit_bias(n_vocab, len(settings.logit_bias), biases))
        penalized = settings.repeat_penalty != 1.0 or settings.presence_penalty != 0 or settings.frequency_penalty != 0
        if penalized and settings.repeat_last_n != 0:
            # The penalties look every candidate up in their window: over a large vocabulary that
            # costs more than the rest of the chain (1.2 ms a token of Gemma 3's 262k). Where they
            # only lower tokens, they lower at most one a window position, so the k they leave on
            # top are among the k + window on top before them: those are kept first, and the draw
            # is the same.
            kept = 1 if settings.temperature <= 0 else settings.top_k
            lowers = settings.repeat_penalty >= 1.0 and settings.presence_penalty >= 0 \
                and settings.frequency_penalty >= 0
            if lowers and kept > 0 and settings.repeat_last_n > 0 and kept + settings.repeat_last_n < n_vocab:
                add(lc.llama_sampler_init_top_k(kept + settings.repeat_last_n))
            add(lc.llama_sampler_init_penalties(n_vocab, settings.repeat_last_n, settings.repeat_penalty,
                                                settings.frequency_penalty, settings.presence_penalty))
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


def matcher_for(model: LlamaModel, settings: SamplerSettings) -> Matcher | None:
    """A matcher of `settings`' grammar on `model`'s vocabulary (None without one)."""
    if settings.grammar is None:
        return None
    from quipu.engine.constraint import Matcher  # llguidance: only for a constrained reply

    return Matcher(model, settings.grammar)


class Sampling:
    """A context's sampling: its chain, and the grammar a reply keeps to."""

    def __init__(self, native: NativeContext):
        self._native = native
        self._chain: SamplerChain | None = None
        self._grammar: Matcher | None = None  # while replies keep to a grammar
        self._settings = SamplerSettings()

    def set_settings(self, settings: SamplerSettings) -> None:
        matcher = matcher_for(self._native.model, settings)  # a bad grammar is refused before anything changes
        self.close()
        self._settings = settings
        self._grammar = matcher
        self._chain = SamplerChain(self._native.model.n_vocab, settings)

    def close(self) -> None:
        if self._chain is not None:
            self._chain.free()
            self._chain = None
        self._grammar = None

    @property
    def chain(self) -> SamplerChain:
        """The sampler chain (made by `set_settings`, which a session calls first)."""
        if self._chain is None:
            raise EngineError("no sampler is set on this context")
        return self._chain

    def reset(self, window: Sequence[int]) -> None:
        self.chain.reset([t for t in window if t < MEDIA_BASE])  # (a medium is no token to penalize)

    def accept(self, tokens: Sequence[int]) -> None:
        self.chain.accept([t for t in tokens if t < MEDIA_BASE])

    def set_constraint(self, grammar: Grammar | None) -> None:
        """From the next token on, the reply keeps to `grammar` (from its start), or, with None,
        to the sampler settings' own grammar again."""
        self._grammar = matcher_for(self._native.model, self._settings if grammar is None else
                                    dataclasses.replace(self._settings, grammar=grammar))

    def constraint_reset(self, reply: Sequence[int]) -> None:
        if self._grammar is not None:
            self._grammar.replay(reply)

    def sample(self, draw_seed: int, history: Sequence[int] = (), processors: Sequence[LogitsProcessor] = (),
               token_filter: TokenFilter | None = None) -> int:
        """The chain's draw from the last logits. A grammar's mask, the processors and the filter
        change those logits in place first (ruled-out tokens become -inf), so that the native
        chain draws as it always does, seeded, among the tokens left."""
        chain = self.chain
        chain.reseed(draw_seed)
        if self._grammar is not None or processors or token_filter is not None:
            self._shape(history, processors, token_filter)
        token: int = lc.llama_sampler_sample(chain.ptr, self._native.ptr, self._native.logits_index)
        self._native.logits_read()
        if self._grammar is not None:
            try:
                self._grammar.accept(token)
            except EngineError:
                raise EngineError("no token is allowed here (the grammar, the filter or the biases rule out "
                                  "every one)") from None
        return token

    def _shape(self, history: Sequence[int], processors: Sequence[LogitsProcessor],
               token_filter: TokenFilter | None) -> None:
        import numpy as np

        n_vocab = self._native.model.n_vocab
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(self._native.ptr, self._native.logits_index), shape=(n_vocab,))
        for processor in processors:
            processor(history, logits)
        if token_filter is not None:
            allowed = token_filter(history)
            if allowed is not None:
                keep = np.fromiter(allowed, dtype=np.int64)
                kept = logits[keep].copy()
                logits.fill(-np.inf)
                logits[keep] = kept
        if self._grammar is not None:
            self._grammar.apply(logits)
