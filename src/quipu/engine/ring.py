"""A sliding-window model's window cache as a ring, kept in one layout that is a function of
the positions it holds, so that a context restored, rewound or continued computes what the
one that never stopped computes.

llama.cpp's window cache (`llama_kv_cache_iswa` with `swa_full = false`) has R cells (the window
for each sequence plus a step, padded to 256). A token at position p goes into the first cell,
from the cache's head on and wrapping at R, that is empty or holds a position out of every
window; read from an empty cache in order, that is cell p mod R, and the head is after it. The
attention adds its terms in cell order (and a decode's cells are shared out among threads by
index), so the bits of what follows depend on which cell holds which position and where the
head is, not only on what the cells hold.

A whole-state read puts the cells from cell 0 on with the head at 0, and a rewind frees cells
and moves the head back to the first one it freed: neither leaves that layout. `canonical`
composes, from a state of the window cache alone (`LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`, the
layout of kvstate.py), the ring as an uninterrupted read of positions [0, e) leaves it: cell
p mod R for each of the last R positions (those gone out of every window, whose values are
never read, as zeros where the state no longer has them), and the head at e mod R. llama.cpp
is given it in two reads: the whole cache with the cells before the head held by placeholders
of a second sequence, which are then dropped, and the cells before the head as that second
sequence's own state (its cells go in from the head, which is 0, and the head ends after the
last), which then joins the first.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from quipu.engine.kvstate import MAGIC, Reader
from quipu.errors import SnapshotError

_U32 = struct.Struct("<I")
_HEAD = struct.Struct("<Ii")
_CELL_HEAD = struct.Struct("<iI")
_LAYER_K = struct.Struct("<iQ")
_LAYER_V_TRANS = struct.Struct("<iII")


def ring_size(n_swa: int, n_seq: int, n_ubatch: int, n_cells: int) -> int:
    """The cells of llama.cpp's window cache (`llama_kv_cache_iswa`'s size_swa) for a unified
    cache of `n_seq` sequences beside a full cache of `n_cells`."""
    pad = 256
    return -(-min(n_cells, n_swa * n_seq + n_ubatch) // pad) * pad


@dataclass
class Layer:
    """One layer's rows: K (a row per cell), then V (a row per cell, or, transposed, a run of
    cell_count elements per embedding row); `head` is the bytes before the rows."""

    head: bytes
    row: int  # bytes a cell takes (in each of `runs` runs when transposed)
    data: memoryview
    runs: int = 0  # 0: a row per cell; else the transposed V's embedding rows


@dataclass
class WindowState:
    """A window cache's state as llama.cpp writes it for the whole memory: its cells' positions
    (in cell order) and each layer's rows."""

    positions: list[int]
    v_trans: int
    k: list[Layer]
    v: list[Layer]


def parse(data: bytes | memoryview) -> WindowState:
    """Reads a window cache's state (one stream; each cell of one sequence); raises
    SnapshotError where it is not that layout."""
    read = Reader(data, "the window cache's state")
    take, rows = read.take, read.skip
    magic, _ = take(_HEAD)
    (n_stream,) = take(_U32)
    if magic != MAGIC or n_stream != 1:
        raise SnapshotError("the window cache's state is not of the layout quipu reads")
    (count,) = take(_U32)
    positions = []
    for _ in range(count):
        pos, n_seq = take(_CELL_HEAD)
        if n_seq != 1:
            raise SnapshotError("a cell of the window cache is not of one sequence")
        take(_U32)
        positions.append(pos)
    if not count:
        return WindowState([], 0, [], [])
    (v_trans,), (n_layer,) = take(_U32), take(_U32)
    k = []
    for _ in range(n_layer):
        head = take(_LAYER_K)
        k.append(Layer(_LAYER_K.pack(*head), head[1], rows(head[1] * count)))
    v = []
    for _ in range(n_layer):
        if v_trans:
            head = take(_LAYER_V_TRANS)
            v.append(Layer(_LAYER_V_TRANS.pack(*head), head[1], rows(head[1] * head[2] * count), head[2]))
        else:
            head = take(_LAYER_K)
            v.append(Layer(_LAYER_K.pack(*head), head[1], rows(head[1] * count)))
    if not read.done:
        raise SnapshotError("the window cache's state is not of the layout quipu reads")
    return WindowState(positions, v_trans, k, v)


def compose(state: WindowState, cells: list[tuple[int, int, int]]) -> bytes:
    """A whole-memory state of the window cache holding `cells`, in order: each (position,
    sequence, the index of its cell in `state`, or -1 for a cell of zeros)."""
    import numpy as np

    out = [_HEAD.pack(MAGIC, -1), _U32.pack(1), _U32.pack(len(cells))]
    out += [_CELL_HEAD.pack(pos, 1) + _U32.pack(seq) for pos, seq, _ in cells]
    if not cells:
        return b"".join(out)
    out += [_U32.pack(state.v_trans), _U32.pack(len(state.k))]
    count = len(state.positions)
    take = np.array([max(i, 0) for _, _, i in cells], dtype=np.int64)
    blank = np.array([i < 0 for _, _, i in cells])

    def gather(layer: Layer) -> bytes:
        shape = (layer.runs, count, layer.row) if layer.runs else (count, layer.row)
        rows = np.frombuffer(layer.data, dtype=np.uint8).reshape(shape).take(take, axis=len(shape) - 2)
        rows[..., blank, :] = 0  # (the cells the state no longer has)
        return layer.head + rows.tobytes()

    out += [gather(layer) for layer in state.k]
    out += [gather(layer) for layer in state.v]
    return b"".join(out)


@dataclass(frozen=True)
class Ring:
    """The two reads that give llama.cpp's window cache its layout for positions [0, end):
    `whole` (the whole cache, placeholders of sequence 1 first) and `ahead` (sequence 1's
    state: the cells before the head), either empty (b"")."""

    whole: bytes
    ahead: bytes


def canonical(state: WindowState, end: int, size: int, window: int) -> Ring | None:
    """The layout of a ring of `size` cells after positions [0, end) were read in order, from
    `state`'s cells; None where the state lacks one of the last `window` positions before `end`
    (the next token's window), which only reading them again can give."""
    where = {pos: i for i, pos in enumerate(state.positions)}
    if any(p not in where for p in range(max(0, end - window), end)):
        return None
    head = end % size if end >= size else end
    older = range(end - size, end - head) if end >= size else range(0)
    newer = range(end - head, end)
    whole: list[tuple[int, int, int]] = []
    if len(older):
        whole = [(end + i, 1, -1) for i in range(head)] + [(p, 0, where.get(p, -1)) for p in older]
    return Ring(compose(state, whole) if whole else compose(state, []),
                compose(state, [(p, 1, where.get(p, -1)) for p in newer]) if head else b"")
