"""Checkpoints of the part of a context's memory that cannot go back a token: the states a rewind
comes back to.

A recurrent layer (Gated DeltaNet, Mamba, a short convolution) keeps one state per sequence, not
a cell per token: llama.cpp's memory refuses to drop the last few positions of a hybrid model
(`llama_memory_seq_rm` returns false), and a sliding-window ring writes over the cells of
positions gone out of its window. What such a memory holds apart from its attention cells
(`LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`: the recurrent state, or the window's cells) is kept at a few
positions where a later prompt is known to part from this one, as llama-server's context
checkpoints are; a rewind sets the nearest one at or before its point back, and then the
attention cells past it can go. `Checkpoints` holds them, bounded in count, newest last.

A snapshot of a hybrid context (a prompt cache entry) carries the last two checkpoints taken
where a caller marked a prompt, so that a context restored from it rewinds there as the one that
made it would (a session's files keep the recurrent state apart instead: `Memory.recurrent_at`).
`pack` puts them before the state llama.cpp wrote, little-endian:

    magic                b"QCKP"
    version              u32   (1)
    count                u32
    per checkpoint:      n u64, position u64, size u64, the PARTIAL_ONLY state
    the whole state      (the rest)

`unpack` reads it back, bounds checked; bytes without the magic are a plain state (written
before checkpoints were kept, or by a model that has none).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterator, Sequence

from quipu.engine.kvstate import Reader
from quipu.errors import SnapshotError

MAGIC = b"QCKP"
_HEAD = struct.Struct("<4sII")
_ENTRY = struct.Struct("<QQQ")
VERSION = 1


@dataclass(frozen=True)
class Checkpoint:
    """The memory's partial state after the first `n` tokens of the history (at position `at`:
    media take as many positions as their cells). `kept`: one a snapshot may carry (where a caller
    marked a prompt, or read back from a snapshot or a session's files); the others (where a
    prompt began, where a reply began) serve this process's rewinds alone."""

    n: int
    at: int
    state: bytes | memoryview
    kept: bool = False


class Checkpoints:
    """A context's checkpoints, oldest first, at most `limit` and `max_bytes` of them (but two): a
    new one replaces those at or after its position (the history went another way there), and
    the oldest go first."""

    def __init__(self, limit: int, max_bytes: int):
        self.limit = limit
        self.max_bytes = max_bytes
        self._held: list[Checkpoint] = []

    def __iter__(self) -> Iterator[Checkpoint]:
        return iter(self._held)

    def add(self, checkpoint: Checkpoint) -> None:
        kept = [c for c in self._held if c.at < checkpoint.at]
        self.replace(kept + [checkpoint])

    def at(self, n: int) -> Checkpoint | None:
        """The one after the first `n` tokens, if any."""
        return next((c for c in self._held if c.n == n), None)

    def keep_to(self, at: int) -> None:
        """Forgets those past position `at` (the context went back there)."""
        self._held = [c for c in self._held if c.at <= at]

    def latest(self, n: int) -> list[Checkpoint]:
        """Those at or before the `n`th token, the nearest first."""
        return [c for c in reversed(self._held) if c.n <= n]

    def replace(self, held: Sequence[Checkpoint]) -> None:
        held = list(held)[-self.limit:]
        while len(held) > 2 and sum(len(c.state) for c in held) > self.max_bytes:
            held.pop(0)
        self._held = held

    def clear(self) -> None:
        self._held = []


def pack(checkpoints: Sequence[Checkpoint], state: bytes | memoryview) -> bytes:
    """A snapshot: the checkpoints, then the whole state."""
    out = [_HEAD.pack(MAGIC, VERSION, len(checkpoints))]
    for c in checkpoints:
        out += [_ENTRY.pack(c.n, c.at, len(c.state)), bytes(c.state)]
    out.append(bytes(state))
    return b"".join(out)


def unpack(data: bytes | memoryview) -> tuple[list[Checkpoint], memoryview]:
    """The checkpoints and the whole state of a snapshot (none, and the bytes as they are, for a
    plain state); raises SnapshotError where the checkpoints are not whole."""
    view = memoryview(data).cast("B")
    if bytes(view[:len(MAGIC)]) != MAGIC:
        return [], view
    read = Reader(view, "the context's checkpoints")
    _, version, count = read.take(_HEAD)
    if version != VERSION:
        raise SnapshotError(f"the context's checkpoints are of version {version}, not {VERSION}")
    held = []
    for _ in range(count):
        n, at, size = read.take(_ENTRY)
        if size > len(view):
            raise SnapshotError("the context's checkpoints end early")
        held.append(Checkpoint(n, at, read.skip(size), kept=True))
    return held, view[read.at:]
