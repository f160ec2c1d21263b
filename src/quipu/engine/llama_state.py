"""A context's state as bytes: saved whole, or the cells from a position on (a piece, written
as a second sequence's state that shares them for the moment; see kvstate.py), and restored; a
sliding-window cache laid out as its ring (ring.py). A part of `LlamaBackend` (`llama.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from quipu.engine.llama_context import STATE_HEAD
from quipu.engine.native import lc
from quipu.engine.ring import canonical, parse
from quipu.errors import EngineError, SnapshotError

if TYPE_CHECKING:
    from quipu.engine.llama_context import NativeContext
    from quipu.engine.media import Positions


class StateBytes:
    """A context's state bytes; `positions` says how many tokens of the history it holds."""

    def __init__(self, native: NativeContext, positions: Positions):
        self._native = native
        self._positions = positions
        self._recurrent_size: int | None = None  # (a recurrent state's bytes: `cells_since`)

    def positions(self) -> int:
        """How many tokens of the history the context holds (its positions, where media take as
        many as their cells)."""
        last = self._native.seq_pos_max(0)
        return self._positions.index_after(last) if last >= 0 else 0

    def snapshot_bytes(self) -> memoryview:
        """The context's state, as a view of the one buffer llama.cpp wrote it into (no copy).

        A sliding-window cache's state is written as the whole memory's (sequence -1), which
        keeps the cells gone out of the window: sequence 0's would hold only the window's, and
        read back they would lie from the cache's first cell on, not where they were, so the
        attention that follows would add its terms in another order (llama.cpp splits a decode's
        cells among the threads by index) and drift from the run that never stopped. Every cell
        read back in order lies where it was, and the next token's goes after the last, as then."""
        return self._native.seq_state(-1 if self._native.settings.window_cells else 0)

    # ---- the window cache as a ring (ring.py) ----------------------------------------------

    def ring_state(self) -> memoryview:
        """The window cache's state alone, every cell it holds in cell order."""
        return self._native.seq_state(-1, lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)

    def settle_ring(self, end: int, source: bytes | memoryview | None = None) -> bool:
        """Lays the window cache out as an uninterrupted read of positions [0, `end`) leaves it
        (ring.py), from its own cells or from `source` (a `ring_state` taken before); False,
        changing nothing, where they lack a position of the window before `end`."""
        try:
            state = parse(self.ring_state() if source is None else source)
        except SnapshotError as e:
            raise EngineError(f"llama.cpp's window cache is not of the layout quipu reads: {e}") from None
        ring = canonical(state, end, self._native.ring, self._native.model.n_swa)
        if ring is None:
            return False
        partial = lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        self._native.set_seq_state(ring.whole, -1, "the window cache's cells", partial)
        self._native.seq_rm(1, -1, -1)  # (the placeholders before the head)
        if ring.ahead:
            self._native.set_seq_state(ring.ahead, 1, "the window cache's cells", partial)
            self._native.seq_cp(1, 0, -1, -1)
            self._native.seq_rm(1, -1, -1)
        return True

    def _settle_restored(self) -> None:
        """A restored window cache in its ring's layout; where its cells cannot give it (a
        state that lacks part of its window), the context is emptied and read again."""
        if self._native.ring and not self.settle_ring(self._native.seq_pos_max(0) + 1):
            self._native.clear()

    def partial_state(self, since: int | None = None) -> str | None:
        """Why the state of some cells cannot be saved and restored apart from the rest (None:
        it can): an attention cache of one sequence, whose positions are the tokens', plain or
        with a sliding window (whose state keeps every cell: `snapshot_bytes`). With `since`, why
        not the cells from there on: a window cache leaves out of a sequence's state the cells
        gone out of its window, so a piece longer than the window would not hold them all."""
        model = self._native.model.ptr
        if self._native.settings.n_seq != 1:
            return "a context of several sequences"
        if lc.llama_model_is_recurrent(model) and not lc.llama_model_is_hybrid(model):
            return "a recurrent model's memory (no cells: its state is kept apart)"
        if self._positions.moved_any and \
                lc.llama_model_rope_type(model) in (lc.LLAMA_ROPE_TYPE_MROPE, lc.LLAMA_ROPE_TYPE_IMROPE):
            return "an M-RoPE context with images (their positions are not their cells')"
        if since is not None and self._native.model.n_swa and not self._native.ring and self.positions() - since > self._native.model.n_swa:
            return "a turn longer than the sliding window"
        return None

    def state_since(self, start: int, end: int | None = None) -> memoryview:
        """The state of the cells at positions `start` on (to `end`): llama.cpp writes them as
        the state of a second sequence that shares them for the moment (see kvstate.py)."""
        with self._native.held():
            self._native.seq_cp(0, 1, start, -1 if end is None else end)
            try:
                return self._native.seq_state(1)
            finally:
                self._native.seq_rm(1, -1, -1)

    def cells_since(self, start: int, end: int | None = None) -> bytes:
        """A hybrid or recurrent model's cells at positions `start` on (to `end`), without its
        recurrent state, which is kept apart: the sequence's state as llama.cpp writes it (from 0
        to the end, the history's own, else `state_since`'s), its recurrent state (written last:
        one cell, of one size) replaced by one of no cell (`Opened.no_recurrent`). Restored by
        `restore_pieces`, they leave the context without a recurrent state until one is set."""
        native = self._native
        if native.seq_pos_max(0) < 0:  # (nothing held: its state ends with a recurrent state of no cell)
            size = len(native.opened.no_recurrent)
        else:
            if self._recurrent_size is None:  # (one cell's state, after the head: the same for every state)
                self._recurrent_size = len(native.seq_state(0, lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)) - STATE_HEAD
            size = self._recurrent_size
        state = native.seq_state(0) if start == 0 and end is None else self.state_since(start, end)
        return b"".join([state[:len(state) - size], native.opened.no_recurrent])

    def restore_pieces(self, base: bytes | memoryview, pieces: Sequence[tuple[int, bytes | memoryview]]) -> None:
        """Restores a state saved whole, then pieces of it saved by `state_since`, in order, each
        (the position it was taken from, its bytes): the cells from there on are dropped, the
        piece read as the second sequence's, whose cells then join the first."""
        self.restore_bytes(base)
        for start, piece in pieces:
            with self._native.held():
                self._native.seq_rm(0, start, -1)
                self._native.set_seq_state(piece, 1, "a piece of the saved context state")
                self._native.seq_cp(1, 0, -1, -1)
                self._native.seq_rm(1, -1, -1)
        self._settle_restored()

    def restore_bytes(self, data: bytes | memoryview) -> None:
        self._native.clear()
        self._native.set_seq_state(data, 0, "the saved context state")
        self._settle_restored()
