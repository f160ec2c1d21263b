"""llama.cpp's native sampler chain, one per stream of tokens: the single context's, and each
row's of a batch; and a context's sampling, a part of `LlamaBackend` (`llama.py`): the chain's
draw from the last logits, with a grammar's mask, filters and processors applied first."""

from __future__ import annotations

import ctypes
import dataclasses
from typing import TYPE_CHECKING, Any, Sequence

from quipu.engine.base import MEDIA_BASE, Draw, LogitsProcessor, SamplerSettings, TokenFilter, draw_seed
from quipu.engine.native import lc
from quipu.errors import EngineError

if TYPE_CHECKING:
    from quipu.engine.constraint import Matcher
    from quipu.engine.grammar import Grammar
    from quipu.engine.llama_context import NativeContext
    from quipu.engine.model import LlamaModel


DRAWS_A_SEED = 64  # draws taken in turn from one seeded generator


class SamplerChain:
    """llama.cpp's sampler chain for one stream of tokens: logit biases, the repeat penalty
    (whose window is the tokens accepted), then greedy, or top-k, top-p, min-p, temperature and
    a draw. A draw is a function of (seed, draw index) alone: draws are taken in turn from a
    generator seeded afresh for each run of `DRAWS_A_SEED` of them, and one asked for elsewhere
    than the generator's next (a restored session, a retry, a batch's row on a shared chain's
    first step) seeds its run's generator and takes it on past the draws before it; so a
    restored session, or a row of a batch, draws what a lone uninterrupted run would. (Seeding a
    generator for every draw cost about 25 us a token after a decode.)"""

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
        self._at: tuple[int, int, int] | None = None  # the generator's (seed, run, draws taken), where known
        self._one: Any = None  # a candidate array of one, which a draw taken past is made on

    def sample(self, ctx: Any, index: int, draw: Draw) -> int:
        """The chain's token from the logits of output `index` of context `ctx`, with `draw`
        (accepted into the chain, as llama.cpp's sampling does)."""
        if not self.draws:
            token: int = lc.llama_sampler_sample(self.ptr, ctx, index)
            return token
        run, taken = divmod(draw.n, DRAWS_A_SEED)
        self._seek(draw.seed, run, taken)
        self._at = None  # (until the draw is made)
        token = lc.llama_sampler_sample(self.ptr, ctx, index)
        self._at = (draw.seed, run, taken + 1)  # (llama.cpp's draw takes one number, whatever the candidates)
        return token

    def _seek(self, seed: int, run: int, taken: int) -> None:
        """Puts the generator where `taken` draws of `run`'s have been taken."""
        at = self._at
        if at is None or at[:2] != (seed, run) or at[2] > taken:
            last = lc.llama_sampler_chain_n(self.ptr) - 1
            lc.llama_sampler_free(lc.llama_sampler_chain_remove(self.ptr, last))
            lc.llama_sampler_chain_add(self.ptr, lc.llama_sampler_init_dist(draw_seed(seed, run)))
            at = (seed, run, 0)
        if at[2] < taken:
            if self._one is None:
                self._one = lc.llama_token_data_array((lc.llama_token_data * 1)(), 1, -1, False)
            dist = lc.llama_sampler_chain_get(self.ptr, lc.llama_sampler_chain_n(self.ptr) - 1)
            for _ in range(taken - at[2]):
                lc.llama_sampler_apply(dist, ctypes.byref(self._one))
        self._at = (seed, run, taken)

    def accept(self, tokens: Sequence[int]) -> None:
        for tok in tokens:
            lc.llama_sampler_accept(self.ptr, tok)

    def reset(self, window: Sequence[int]) -> None:
        lc.llama_sampler_reset(self.ptr)
        self._at = None  # (the generator back at its seed's first draw)
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

    def sample(self, draw: Draw, history: Sequence[int] = (), processors: Sequence[LogitsProcessor] = (),
               token_filter: TokenFilter | None = None) -> int:
        """The chain's draw from the last logits. A grammar's mask, the processors and the filter
        change those logits in place first (ruled-out tokens become -inf), so that the native
        chain draws as it always does, seeded, among the tokens left."""
        chain = self.chain
        if self._grammar is not None or processors or token_filter is not None:
            self._shape(history, processors, token_filter)
        token = chain.sample(self._native.ptr, self._native.logits_index, draw)
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
