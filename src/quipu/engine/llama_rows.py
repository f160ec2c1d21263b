"""The rows of a batch: every sequence of a context several share (`ContextSettings.n_seq`),
driven from one thread, each with a sampler chain and a grammar's matcher of its own. Its steps
are the scheduler's (`scheduler.py`). A part of `LlamaBackend` (`llama.py`), held by the caller
as `backend.rows`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from quipu.engine.base import SamplerSettings
from quipu.engine.native import lc
from quipu.engine.sampler import SamplerChain, matcher_for
from quipu.errors import EngineError

if TYPE_CHECKING:
    from quipu.engine.constraint import MaskBatch, Matcher
    from quipu.engine.llama_context import NativeContext
    from quipu.engine.scheduler import Ask, Scheduler


class BatchRows:
    """A context's rows of a batch (the whole context, its every sequence)."""

    def __init__(self, native: NativeContext, scheduler: Scheduler):
        self._native = native
        self._scheduler = scheduler
        self._masks: MaskBatch | None = None  # for the rows of a batch under grammars
        # A recurrent state where the rows' shared beginning ends (its length, the state), which a
        # sequence that answered a row goes back to for the next (it cannot drop a token).
        self._shared: tuple[int, memoryview] | None = None

    @property
    def n_seq(self) -> int:
        return self._native.settings.n_seq

    @property
    def n_batch(self) -> int:
        return self._native.settings.n_batch

    def begin(self) -> None:
        """Nothing held, in any sequence."""
        lc.llama_memory_clear(self._native.mem, True)
        self._shared = None

    def step(self, waiting: list[Ask]) -> list[Ask]:
        """Decodes the next step of the asks `waiting` (the scheduler's: one token for each of
        several rows, or a row's prompt alone), taken out of it; returns them, each with the batch
        index of its logits."""
        return self._scheduler.step(waiting)

    def seq_keep(self, seq: int, n_keep: int) -> None:
        """Forgets sequence `seq`'s positions from `n_keep` on (0, or the shared beginning's end:
        a recurrent state goes back to that beginning's, kept when it was copied)."""
        mem = self._native.mem
        if lc.llama_memory_seq_rm(mem, seq, n_keep, -1):
            return
        if self._shared is not None and self._shared[0] == n_keep:
            self._native.set_seq_state(self._shared[1], seq, "the shared beginning's recurrent state",
                                       lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
            if lc.llama_memory_seq_rm(mem, seq, n_keep, -1):
                return
        raise EngineError("llama.cpp could not trim a sequence")

    def seq_copy(self, src: int, dst: int) -> None:
        """Sequence `dst` becomes a copy of `src` (which must be all it holds: a shared beginning)."""
        mem = self._native.mem
        if self._shared is None and self._native.recurrent:
            end = lc.llama_memory_seq_pos_max(mem, src) + 1
            self._shared = (end, self._native.seq_state(src, lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY))
        lc.llama_memory_seq_cp(mem, src, dst, -1, -1)

    def row_sampler(self, settings: SamplerSettings) -> SamplerChain:
        """A sampler chain of its own, for one sequence of a batch (free it when done)."""
        return SamplerChain(self._native.model.n_vocab, settings)

    def row_matcher(self, settings: SamplerSettings) -> Matcher | None:
        """A grammar's matcher of its own, for one sequence of a batch (None without a grammar)."""
        return matcher_for(self._native.model, settings)

    def sample_rows(self, rows: Sequence[tuple[SamplerChain, Matcher | None, int, int]]) -> list[int]:
        """One token (sampled and accepted) for each (chain, matcher or None, draw seed, batch
        index) of a step, the chains and matchers this context made (`row_sampler`,
        `row_matcher`). The masks of every row under a grammar are computed together, on
        llguidance's threads, and applied to each row's logits before its chain draws."""
        constrained = [(matcher, k) for k, (_, matcher, _, _) in enumerate(rows)
                       if matcher is not None]
        if constrained:
            import numpy as np

            from quipu.engine.constraint import MaskBatch

            n_vocab = self._native.model.n_vocab
            masks = self._masks
            if masks is None or masks.masks.shape[0] < len(rows):
                masks = self._masks = MaskBatch(n_vocab, max(len(rows), self.n_seq))
            masks.fill(constrained)
            for _, k in constrained:
                logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(self._native.ptr, rows[k][3]), shape=(n_vocab,))
                masks.apply(logits, k)
        tokens = []
        for chain, matcher, draw_seed, index in rows:
            chain.reseed(draw_seed)
            token: int = lc.llama_sampler_sample(chain.ptr, self._native.ptr, index)
            if matcher is not None:
                try:
                    matcher.accept(token)
                except EngineError:
                    raise EngineError("no token is allowed here (the grammar or the biases rule out every one)") from None
            tokens.append(token)
        return tokens
