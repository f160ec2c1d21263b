"""What a context holds of its history, and how it goes back: its state bytes with the
checkpoints a memory that cannot go back a token keeps (`checkpoints.py`), its pieces, and its
rewinds. Three kinds behind one interface (`base.MemoryPart`): a plain attention cache (`Memory`),
which goes back to any token; a sliding window's ring (`RingMemory`), which goes back to any
token whose window it still holds, or to a checkpoint of the ring; a recurrent state beside it (a
hybrid or recurrent model's, `RecurrentMemory`), which goes back only to its checkpoints, taken
where a prompt is marked and kept with its snapshots. A part of `LlamaBackend` (`llama.py`), held
by the caller as `backend.memory`, made by `memory_for`."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Sequence

from quipu.engine.checkpoints import Checkpoint, Checkpoints, pack, unpack
from quipu.engine.devices import host_available
from quipu.engine.kvstate import Piece, check_piece
from quipu.engine.native import lc
from quipu.errors import EngineError, SnapshotError

if TYPE_CHECKING:
    from quipu.engine.llama_context import NativeContext
    from quipu.engine.llama_state import StateBytes
    from quipu.engine.media import Positions

CHECKPOINTS = 4  # the ring's checkpoints a context keeps (a few prompts back; llama-server keeps 8 by default)
RECURRENT_CHECKPOINTS = 8  # a recurrent state's, in memory (llama-server keeps up to 32 a slot)
# And at most so many bytes of them (but two), and a quarter of the memory the machine has free
# when the context opens: Qwen 3.5 27B's recurrent state is 157 MB.
CHECKPOINT_BYTES = 1 << 30
CARRIED = 2  # the checkpoints a snapshot carries at most (a prompt cache entry's: the last two)
_PARTIAL = lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY


class Memory:
    """A plain attention cache as its history: how much of it it holds, going back to any token,
    its state as bytes and in pieces; and what the other kinds share (their checkpoints)."""

    recurrent = False  # whether the memory holds a state that cannot go back a token
    KEPT = CHECKPOINTS  # the checkpoints it keeps at most

    def __init__(self, native: NativeContext, positions: Positions, state: StateBytes):
        self.native = native
        self._positions = positions
        self.state = state
        self.model = native.model
        self.ring = native.ring
        # The ring's cells, or the recurrent state, where a prompt began to be read (and, for a
        # recurrent state, where the caller marked it).
        self._checkpoints = Checkpoints(self.KEPT, checkpoint_bytes())
        # Where a step of a prompt's reading ended at a caller's mark (counts of the history's
        # tokens): a context cut back to one holds what one read whole with the same marks does.
        self._cuts: set[int] = set()
        self.last_rewind: str | None = None  # how the last rewind went back, where it could not go back exactly

    # ---- its state as bytes ------------------------------------------------------------------

    def snapshot_bytes(self) -> bytes | memoryview:
        """The context's state."""
        return self.state.snapshot_bytes()

    def restore_bytes(self, data: bytes | memoryview) -> None:
        try:
            held, state = unpack(data)
        except SnapshotError as exc:
            raise EngineError(f"the saved context state is damaged: {exc}") from None
        self._checkpoints.clear()
        self._positions.clear()
        self._cuts.clear()
        self.state.restore_bytes(state)
        self._restored(held)

    def _restored(self, held: list[Checkpoint]) -> None:
        """The checkpoints a restored state carried (a recurrent state's)."""

    def partial_state(self, since: int | None = None) -> str | None:
        return self.state.partial_state(since)

    def state_since(self, start: int, end: int | None = None) -> bytes | memoryview:
        """The cells from position `start` on."""
        return self.state.state_since(start)

    def check_piece(self, piece: bytes | memoryview, start: int, cells: int) -> Piece:
        """What a piece of `state_since(start)` holds, checked to be `cells` cells from `start` on
        in the layout quipu reads (kvstate.py); SnapshotError where it is not."""
        _, state = unpack(piece)
        return check_piece(state, seq_id=1, cells=cells, first=start, n_layer=self.model.n_layer_kv,
                           window=self.model.n_swa if self.ring else None, recurrent=self.recurrent)

    def restore_pieces(self, base: bytes | memoryview, pieces: Sequence[tuple[int, bytes | memoryview]],
                       recurrent: Sequence[Checkpoint] = ()) -> None:
        """A state saved whole, then pieces of it, in order (`recurrent`: a recurrent memory's
        states, kept apart)."""
        self.state.restore_pieces(base, pieces)

    def recurrent_at(self, n: int) -> Checkpoint:
        """The recurrent state after the first `n` tokens, which a session's files keep apart
        from the cells (a recurrent memory's)."""
        raise EngineError("this model's memory holds no recurrent state")

    # ---- where it can be cut back to -----------------------------------------------------------

    def positions(self) -> int:
        """How many tokens of the history the context holds (its positions, where media take as
        many as their cells)."""
        return self.state.positions()

    def rewinds_to(self, n_keep: int) -> int:
        """How many of the history's tokens `truncate(n_keep)` would keep."""
        return min(n_keep, self.positions())

    def restore_points(self) -> list[int]:
        """The counts of the history's tokens a restore of `snapshot_bytes` can be cut back to,
        and read on from as a whole read does: an attention cache's step starts (a multiple of
        n_batch) and cuts."""
        held, step = self.positions(), self.native.settings.n_batch
        return sorted(set(range(step, held + 1, step)) | {c for c in self._cuts if c <= held})

    def step_start(self, n: int) -> int:
        """The last count of the history's tokens at or before `n` that a context can be cut
        back to and read on from as a whole read does: a multiple of n_batch, where a prefill
        step starts, or a mark a prompt held was cut at (`LlamaBackend.prefill`). llama.cpp
        computes a token by another road in a step of a few tokens than in a step of many, so the
        last bits of what it keeps differ; a context restored to such a position and read on
        computes what one read from the start (with the same marks) computes."""
        n_batch, held = self.native.settings.n_batch, self.positions()
        return max([n - n % n_batch] + [c for c in self._cuts if c <= min(n, held)])

    def prompt_begins(self, n: int) -> None:
        """A prompt is read from the `n`th token on (`LlamaBackend.prefill`)."""

    def cut(self, n: int, *, kept: bool) -> None:
        """A step of a prompt's reading ended at a mark (`LlamaBackend.prefill`): a point to cut
        back to (`step_start`). `kept`: the prompt goes on past it."""
        self._cuts.add(n)

    def holds_steps(self, points: Sequence[int]) -> None:
        """The context (restored) holds what was read with steps ending at `points`."""
        held = self.positions()
        self._cuts = {p for p in points if 0 < p <= held}

    @property
    def checkpoints(self) -> list[Checkpoint]:
        """The checkpoints the context keeps (a ring's or a recurrent state's), oldest first."""
        return list(self._checkpoints)

    def checkpoint(self, n: int, *, kept: bool = False) -> None:
        """Keeps the ring's cells, or the recurrent state, as they are before the `n`th token is
        read, for a rewind to there or later that the ring no longer holds the window of, or that
        a recurrent state cannot make; the last few of them (`Checkpoints`)."""
        held = self._checkpoints.at(n)
        if held is not None and (held.kept or not kept):
            return
        # (the window's cells alone, which are all a ring laid out for `at` needs of them; the
        # recurrent state alone)
        self._checkpoints.add(Checkpoint(n, self._positions.position(n), self.native.seq_state(0, _PARTIAL), kept))

    # ---- going back, and cells moved -----------------------------------------------------------

    def truncate(self, n_keep: int) -> None:
        """Keeps the first `n_keep` tokens of the history. A memory that cannot go back so far
        goes back to the last checkpoint before them (`positions()` then says fewer, and the rest
        is read again), or is emptied: `positions()` then says 0, and the tokens are read again."""
        self.last_rewind = None
        if n_keep <= 0:
            self.empty()
            return
        self._cuts = {c for c in self._cuts if c <= n_keep}
        keep = self._positions.position(n_keep)
        self._positions.forget(n_keep)
        self._rewind(n_keep, keep)

    def _rewind(self, n_keep: int, keep: int) -> None:
        """Goes back to the first `n_keep` tokens (`keep` positions). A sliding-window cache of
        every cell that no longer holds the window those positions end with
        (llama_memory_seq_pos_min past it) is emptied."""
        if not self.native.seq_rm(0, keep, -1):
            raise EngineError("llama.cpp could not trim the context")
        n_swa = self.model.n_swa
        if n_swa > 0 and self.native.seq_pos_min(0) > max(0, keep - n_swa):
            self.empty()

    def _back_to_checkpoint(self, c: Checkpoint, n_keep: int) -> None:
        """The memory went back to checkpoint `c` on the way to `n_keep` tokens."""
        self._positions.forget(c.n)
        self._checkpoints.keep_to(c.at)
        if c.n < n_keep:
            self.last_rewind = f"went back to its checkpoint at token {c.n} (the prompt shares {n_keep}) and reads on from there"

    def _none_to_go_back_to(self, n_keep: int) -> None:
        self.empty()
        self.last_rewind = f"had no checkpoint at or before token {n_keep}: it is read again from the start"

    def empty(self) -> None:
        """Nothing held: the cells, the media's places, the checkpoints."""
        self.native.clear()
        self._positions.clear()
        self._checkpoints.clear()
        self._cuts.clear()

    def shift_refused(self) -> str | None:
        """Why cells cannot be dropped from the middle of the context with those after them
        moved down (None: they can). llama.cpp moves a cache's positions (re-rotating RoPE keys)
        where `llama_memory_can_shift` says so: a plain attention cache of a model with one
        position per token (not M-RoPE); not a sliding-window cache, whose evicted cells a shift
        cannot bring back, nor a recurrent model's state, which is not kept a token a cell."""
        why = self.partial_state() or ("a sliding-window cache" if self.model.n_swa > 0 else None)
        if why:
            return why
        if not lc.llama_memory_can_shift(self.native.mem):
            return "this model's cache cannot move its positions"
        return None

    def shift_out(self, start: int, end: int) -> None:
        """Drops positions [start, end) and moves those after them down by end - start."""
        if not self.native.seq_rm(0, start, end):
            raise EngineError("llama.cpp could not drop part of the context")
        self.native.seq_add(0, end, -1, start - end)


class RingMemory(Memory):
    """A sliding window's cache laid out as a ring of the window and a step (ring.py): it goes
    back to any token whose window it still holds, else to a checkpoint of the ring's cells taken
    where a prompt began."""

    def prompt_begins(self, n: int) -> None:
        self.checkpoint(n)  # (where a rewind comes back to)

    def _rewind(self, n_keep: int, keep: int) -> None:
        if not self.native.seq_rm(0, keep, -1):
            raise EngineError("llama.cpp could not trim the context")
        self._checkpoints.keep_to(keep)
        if self.state.settle_ring(keep):
            return
        for c in self._checkpoints.latest(n_keep):
            self.native.seq_rm(0, c.at, -1)
            if self.state.settle_ring(c.at, c.state):
                self._back_to_checkpoint(c, n_keep)
                return
        self._none_to_go_back_to(n_keep)


class RecurrentMemory(Memory):
    """A recurrent state (a hybrid model's, beside its attention cells; or a recurrent model's
    alone), which cannot go back a token: it goes back to its checkpoints, taken where a prompt
    begins and where its caller marks it, the last two of which its snapshots carry. Its pieces
    are its attention cells alone: a session's files keep its recurrent state apart
    (`recurrent_at`), and a restore of them sets it after the cells (`restore_pieces`)."""

    recurrent = True
    # Three or four a turn (where its prompt began, where a piped text ends, where its reply's
    # generation prompt begins, where the reply begins), so the last two or three turns.
    KEPT = RECURRENT_CHECKPOINTS

    def snapshot_bytes(self) -> bytes | memoryview:
        """The context's state, with the checkpoints it carries (`checkpoints.pack`)."""
        return pack(self._carried(), self.state.snapshot_bytes())

    def _carried(self) -> list[Checkpoint]:
        """The checkpoints a snapshot (a prompt cache entry) carries: the last two the history
        keeps (where the reply's prompt began to differ from its messages, where a retry or a
        follow-up parts; and the one before: where a piped text ends, or the system prompt)."""
        return [c for c in self._checkpoints if c.kept][-CARRIED:]

    def _restored(self, held: list[Checkpoint]) -> None:
        last = self.native.seq_pos_max(0)
        self._checkpoints.replace([c for c in held if c.at <= last + 1])

    def state_since(self, start: int, end: int | None = None) -> bytes | memoryview:
        """The attention cells from position `start` on (to `end`), without the recurrent state:
        a session's files keep that apart (`recurrent_at`), so that a turn's piece holds none."""
        return self.state.cells_since(start, end)

    def recurrent_at(self, n: int) -> Checkpoint:
        """The recurrent state after the first `n` tokens: the context's own where it holds `n`,
        else its checkpoint there."""
        if n == self.positions():
            return Checkpoint(n, self._positions.position(n), self.native.seq_state(0, _PARTIAL), kept=True)
        held = self._checkpoints.at(n)
        if held is None:
            raise EngineError(f"the recurrent state has no checkpoint at token {n}")
        return held

    def restore_pieces(self, base: bytes | memoryview, pieces: Sequence[tuple[int, bytes | memoryview]],
                       recurrent: Sequence[Checkpoint] = ()) -> None:
        """The attention cells saved whole, then pieces of them (`state_since`), in order; then
        the recurrent state `recurrent[-1]`, the cells past it dropped, the states before it
        kept as checkpoints (the rewinds a resumed session makes: an /undo, a retry). A state
        that does not end where the cells say is not trusted: EngineError, the context emptied."""
        self.empty()
        self.state.restore_pieces(base, pieces)  # (the cells alone: no recurrent state yet)
        if not recurrent:
            self.empty()
            raise EngineError("the saved context state holds no recurrent state")
        end = recurrent[-1]
        self.native.set_seq_state(end.state, 0, "the saved recurrent state", _PARTIAL)
        # (the cells reach its end, and the state is at it: not before, the context would say
        # that; not after, the cells past it could then not go)
        if self.native.seq_pos_max(0) != end.at - 1 or not self.native.seq_rm(0, end.at, -1):
            self.empty()
            raise EngineError("the saved recurrent state does not end where it says")
        self._checkpoints.replace([replace(c, kept=True) for c in recurrent[:-1] if c.at < end.at])

    def rewinds_to(self, n_keep: int) -> int:
        """How many of the history's tokens `truncate(n_keep)` would keep: the nearest
        checkpoint's (or nothing)."""
        if n_keep >= self.positions():
            return self.positions()
        return max([c.n for c in self._checkpoints.latest(n_keep)] + [0])

    def restore_points(self) -> list[int]:
        """The checkpoints a snapshot carries, and its end."""
        return [c.n for c in self._carried()] + [self.positions()]

    def step_start(self, n: int) -> int:
        """A recurrent state goes back to its checkpoints, where a step ends: `n`."""
        return n

    def prompt_begins(self, n: int) -> None:
        self.checkpoint(n)  # (where a rewind comes back to)

    def cut(self, n: int, *, kept: bool) -> None:
        """A checkpoint where a prompt's reading was marked (`kept`: carried by snapshots, the
        prompt going on past it)."""
        self.checkpoint(n, kept=kept)

    def holds_steps(self, points: Sequence[int]) -> None:
        """(Its restore points are its checkpoints.)"""

    def _rewind(self, n_keep: int, keep: int) -> None:
        """Where the state ends before `keep`, only attention cells go; else the nearest
        checkpoint at or before `n_keep` is set back first, and the context holds what it held
        there (`positions()` says how much: the rest is read again); with none, nothing."""
        if self.native.seq_rm(0, keep, -1):  # (the state ends before `keep`: nothing of it to undo)
            self._checkpoints.keep_to(keep)
            return
        for c in self._checkpoints.latest(n_keep):
            try:
                self.native.set_seq_state(c.state, 0, "a checkpoint of the recurrent state", _PARTIAL)
            except EngineError:
                break  # (the context was emptied)
            # (the state set back must end where the checkpoint says, the attention cells going on
            # past it: one read from a file that says otherwise is not trusted, and is read again)
            if self.native.seq_pos_max(0) == c.at - 1 and self.native.seq_rm(0, c.at, -1):
                self._back_to_checkpoint(c, n_keep)
                return
        self._none_to_go_back_to(n_keep)

    def shift_refused(self) -> str | None:
        return "a recurrent or hybrid model's memory"


def checkpoint_bytes() -> int:
    """What a context's checkpoints may take in memory: CHECKPOINT_BYTES, or a quarter of what the
    machine has free, where that is less."""
    free = host_available()
    return CHECKPOINT_BYTES if free is None else min(CHECKPOINT_BYTES, free // 4)


def memory_for(native: NativeContext, positions: Positions, state: StateBytes) -> Memory:
    """The kind of memory `native`'s model and layout have."""
    if native.recurrent:
        return RecurrentMemory(native, positions, state)
    if native.ring:
        return RingMemory(native, positions, state)
    return Memory(native, positions, state)
