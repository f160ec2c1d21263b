"""How an `InferenceSession`'s context moves within its history: back (a rewind, a reply's last
token left to read again), forward onto what an earlier session left in it (`take_held`), where
a save of its state starts and ends, and out of the middle (the oldest exchanges dropped)."""

from __future__ import annotations

from typing import Sequence

from quipu.engine.base import MEDIA_BASE, Backend
from quipu.sessions.base import common_prefix
from quipu.sessions.params import SamplingParams
from quipu.sessions.prompt import HeldTokens


class ContextMoves(HeldTokens):
    """The moves of a context and its token history (`tokens`, of which the first `n_decoded`
    are in the KV cache); `InferenceSession` is the rest."""

    backend: Backend
    params: SamplingParams
    n_decoded: int
    _low_water: int
    _logits_at: int
    _held: list[int]
    went_back: str | None

    def _reset_sampler(self) -> None:
        n = self.params.repeat_last_n
        self.backend.sampling.reset(self.tokens[-n:] if n else [])

    def take_low_water(self) -> int:
        """The fewest tokens the context has held since this was last taken (the cells before
        it are as they were then: a save of what changed starts there); from now on it counts
        from what the context holds."""
        low, self._low_water = self._low_water, self.n_decoded
        return low

    def save_point(self, until: int | None) -> int:
        """How many of the decoded tokens a save of the state holds: all of them, or, where the
        next turn is known to keep only `until` of them and the state cannot go back a token,
        as many as its checkpoint there holds (the rest would be read again anyway)."""
        if until is None or until >= self.n_decoded or not self.backend.memory.recurrent:
            return self.n_decoded
        return self.backend.memory.rewinds_to(until) or self.n_decoded

    @property
    def holds_earlier(self) -> bool:
        """Whether the context holds what an earlier session left, not taken yet (`take_held`)."""
        return bool(self._held)

    def take_held(self, tokens: Sequence[int], at_least: int = 0) -> int:
        """Keeps of what an earlier session left in the context the beginning the prompt `tokens`
        shares with it, as far back as a step of the prefill starts (as the prompt cache restores
        one: what is read on computes as in a fresh read), where that is `at_least` tokens (what
        the prompt cache would restore); else empties the context. Returns how many it kept."""
        held, self._held = self._held, []
        if not held:
            return 0
        keep = self.backend.memory.step_start(min(common_prefix(tokens, held), len(tokens) - 1))
        if keep < at_least or any(t >= MEDIA_BASE for t in held[:keep]):  # (a medium is this context's)
            keep = 0
        self.backend.memory.truncate(keep)
        keep = min(keep, self.backend.memory.positions())  # (a recurrent state goes back to a checkpoint)
        self.tokens, self.n_decoded, self._logits_at = list(held[:keep]), keep, -1
        self._low_water = keep
        self._reset_sampler()
        return keep

    def _drop_held(self) -> None:
        if self._held:
            self._held = []
            self.backend.memory.truncate(0)

    def rewind(self, n_keep: int) -> None:
        """Forgets the tokens from `n_keep` on, in the history, the KV cache and the penalty window."""
        self._drop_held()
        if n_keep >= len(self.tokens):
            return
        del self.tokens[n_keep:]
        self._low_water = min(self._low_water, n_keep)
        if self.n_decoded > n_keep:
            self.backend.memory.truncate(n_keep)
            self.went_back = self.backend.memory.last_rewind or self.went_back
            # (a sliding-window cache that cannot go back so far keeps nothing: read again)
            self.n_decoded = min(n_keep, self.backend.memory.positions())
            self._low_water = min(self._low_water, self.n_decoded)
            self._logits_at = -1
        self._reset_sampler()

    def undecode(self, n: int) -> None:
        """Keeps the tokens from `n` on but not their cells: they are read with the next prompt,
        as a reply's last token is (a turn that read it, undone, leaves it as it was before)."""
        if n >= self.n_decoded:
            return
        self._drop_held()
        self.backend.memory.truncate(n)
        self.n_decoded = min(n, self.backend.memory.positions())
        self._low_water = min(self._low_water, self.n_decoded)
        self._logits_at = -1

    def shift_out(self, start: int, end: int) -> bool:
        """Drops tokens [start, end) from the context, moving the cells after them down, where
        the backend can (see `Memory.shift_refused`); False where it cannot (the caller
        reads the rest again). The moved cells keep what they were computed from, the dropped
        tokens included, as llama.cpp's own context shift does."""
        refused = self.backend.memory.shift_refused()
        if refused or not 0 <= start < end <= self.n_decoded:
            return False
        self.backend.memory.shift_out(start, end)
        del self.tokens[start:end]
        self.n_decoded -= end - start
        self._low_water = min(self._low_water, start)
        self._logits_at = -1
        self._reset_sampler()
        return True
