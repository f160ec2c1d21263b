"""The layout of llama.cpp's sequence state, as far as quipu relies on it.

`llama_state_seq_get_data` on a context whose memory is a plain attention KV cache writes,
little-endian (`llama_context::state_seq_get_data` in src/llama-context.cpp, then
`llama_kv_cache::state_write` in src/llama-kv-cache.cpp, of the vendored llama.cpp):

    magic                          u32   0xaf143cd8
    seq_id                         i32   (the sequence written)
    n_stream                       u32   (1: a single-stream cache)
    per stream: cell_count         u32
      per cell: pos                i32
                n_seq_id           u32   (1: the cell of one sequence)
                [ext]                    (only for a cache with cell extensions, M-RoPE models)
                seq_id             i32 × n_seq_id
      v_trans                      u32   (1: V stored transposed, as without flash attention)
      n_layer                      u32
      per layer: K type i32, K row size u64, cell_count rows
      per layer: V type i32, then (not transposed) V row size u64, cell_count rows, or
                 (transposed) element size u32, n_embd_v_gqa u32, n_embd_v_gqa runs of
                 cell_count elements

A sliding-window model's memory (`llama_kv_cache_iswa`) writes two such caches after the one
head, from n_stream on: its full-attention layers', then its window layers'.

A session's saves after the first write only the cells a turn added: llama.cpp writes them
itself, as the state of a second sequence that shares those cells (`llama_memory_seq_cp`), and
reads them back the same way, so quipu never takes the bytes apart. What it checks here is
that such a piece is what it must be: one stream, the expected number of cells, each of the
one sequence, at the expected positions, in each cache, of the model's layer count in all, and
nothing after the last layer (a window cache leaves out a long turn's cells gone out of its
window: of a cache of every position, the turn is saved whole; a ring's piece holds the
window's, which are all it needs, in its cells' order: ring.py). Anything else (another llama.cpp's layout, a cache with cell
extensions, a layer without V) is not understood, and the session is saved whole.
"""

from __future__ import annotations

from typing import Any

import struct
from dataclasses import dataclass

from quipu.errors import SnapshotError

_U32 = struct.Struct("<I")
_HEAD = struct.Struct("<Ii")
MAGIC = 0xAF143CD8
_CELL = struct.Struct("<iIi")  # pos, n_seq_id (1), seq_id
_CELL_HEAD = struct.Struct("<iI")  # pos, n_seq_id (then a cell's extension, where the cache has one)
_I32 = struct.Struct("<i")
CELL_EXT = 12  # an M-RoPE cache's cell extension (`llama_kv_cell_ext`: x, y, the token)
_LAYER_K = struct.Struct("<iQ")
_LAYER_V_TRANS = struct.Struct("<iII")
LAYOUT = "llama_kv_cache-1"  # the layout above, as quipu names it in a session's state pieces


class Reader:
    """Reads a state's fields in order from `data`; past its end, SnapshotError saying `what`
    ends early."""

    def __init__(self, data: bytes | memoryview, what: str):
        self.view = memoryview(data).cast("B")
        self.at = 0
        self.what = what

    def take(self, fmt: struct.Struct) -> tuple[Any, ...]:
        return fmt.unpack_from(self.skip(fmt.size), 0)

    def skip(self, size: int) -> memoryview:
        """The next `size` bytes."""
        if self.at + size > len(self.view):
            raise SnapshotError(f"{self.what} ends early")
        self.at += size
        return self.view[self.at - size:self.at]

    @property
    def done(self) -> bool:
        return self.at >= len(self.view)


@dataclass(frozen=True)
class Piece:
    """What a piece of sequence state holds: its cells' positions (first, last) and count, and
    whether its V rows are stored transposed (None: it holds no cells to say)."""

    cells: int
    first: int
    last: int
    v_trans: bool | None


def check_piece(data: bytes | memoryview, *, seq_id: int, cells: int, first: int, n_layer: int,
                window: int | None = None, recurrent: bool = False) -> Piece:
    """Checks that `data` is the state of `cells` cells of sequence `seq_id` at positions
    `first`, `first` + 1, ... in order, in each cache of the layout above, for a model of
    `n_layer` layers with a cache (not those reusing another's); raises SnapshotError naming what differs. With `window`, a window cache
    (the second) holds only the last `window` of them (a ring's piece: ring.py). A cell has an
    extension (`CELL_EXT`) or none, as the cells are found to have (an M-RoPE model's cache, or a
    model's with per-layer embeddings, has one). `recurrent`: a hybrid model's, whose
    attention cache holds some of the layers, followed by a recurrent state of no cell (the
    state is kept apart: `_check_no_recurrent`)."""
    read = Reader(data, "the piece of context state")
    view, take = read.view, read.take
    magic, written = take(_HEAD)
    if magic != MAGIC or written != seq_id:
        raise SnapshotError("the piece of context state does not begin as llama.cpp's sequence state does")
    layers_seen, v_trans, ring = 0, None, False
    while True:  # a cache, then perhaps a sliding window's (a ring's, with `window`)
        (n_stream,) = take(_U32)
        if n_stream != 1:
            raise SnapshotError(f"the context state has {n_stream} streams, not 1")
        (count,) = take(_U32)
        expected = min(cells, window) if ring and window is not None else cells
        if count != expected:
            raise SnapshotError(f"the piece of context state holds {count} cells, not {expected}")
        if count:
            # (a ring's cells come in cell order: the positions from where it wraps first)
            low = first + cells - count
            turn = _CELL.unpack_from(read.view, read.at)[0] - low if ring and window is not None and \
                read.at + _CELL.size <= len(view) else 0
            wrong = {ext: _cells_wrong(read, count, ext, seq_id, low, turn) for ext in (0, CELL_EXT)}
            ext = next((e for e, why in wrong.items() if why is None), None)
            if ext is None:
                raise SnapshotError(wrong[0] or "the piece's cells are not the ones expected")
            read.skip(count * (_CELL.size + ext))
            trans, layers = take(_U32)[0], take(_U32)[0]
            if trans not in (0, 1) or not 0 < layers <= n_layer - layers_seen or v_trans not in (None, trans):
                raise SnapshotError("the piece of context state is not of this model's layout")
            v_trans, layers_seen = trans, layers_seen + layers
            for _ in range(layers):  # K: a row per cell
                _, row = take(_LAYER_K)
                read.skip(count * row)
            for _ in range(layers):  # V: a row per cell, or transposed: a run per embedding row
                if trans:
                    _, size, rows = take(_LAYER_V_TRANS)
                    read.skip(rows * count * size)
                else:
                    _, row = take(_LAYER_K)
                    read.skip(count * row)
        if recurrent:
            _check_no_recurrent(read, n_layer)
            break
        if read.done or layers_seen >= n_layer:
            break
        ring = True  # (what follows the first cache is the window's)
    if read.at != len(view) or (cells and not recurrent and layers_seen != n_layer):
        raise SnapshotError("the piece of context state is not of the layout quipu reads")
    return Piece(cells, first, first + cells - 1, None if v_trans is None else bool(v_trans))


def _cells_wrong(read: Reader, count: int, ext: int, seq_id: int, low: int, turn: int) -> str | None:
    """What is wrong with the `count` cells at the reader's place, each of `ext` bytes of
    extension, as cells of sequence `seq_id` at positions from `low` (from `turn` on, wrapping:
    a ring's), without moving it; None: nothing."""
    size = _CELL.size + ext
    if read.at + count * size > len(read.view):
        return "the piece of context state ends early"
    for i in range(count):
        pos, n_seq = _CELL_HEAD.unpack_from(read.view, read.at + i * size)
        (seq,) = _I32.unpack_from(read.view, read.at + i * size + _CELL_HEAD.size + ext)
        if n_seq != 1 or seq != seq_id or not 0 <= turn < count or pos != low + (turn + i) % count:
            return f"cell {i} of the piece of context state is not the one expected (position {pos}, {n_seq} sequences)"
    return None


def _check_no_recurrent(read: Reader, n_layer: int) -> None:
    """A sequence's recurrent state of no cell (`llama_memory_recurrent::state_write`; a hybrid
    model's piece keeps its state apart): a count of 0, then its layers' records without rows
    (type i32, row size u64; the layers without a state have none), to the end."""
    (count,) = read.take(_U32)
    if count != 0:
        raise SnapshotError(f"the piece holds a recurrent state of {count} cells, not none")
    trans, layers = read.take(_U32)[0], read.take(_U32)[0]
    if trans != 0 or layers != n_layer:
        raise SnapshotError("the piece's recurrent part is not of this model's layout")
    records = 0
    while not read.done:
        kind, _ = read.take(_LAYER_K)
        if not 0 <= kind < 64:
            raise SnapshotError("the piece's recurrent part is not of the layout quipu reads")
        records += 1
    if records == 0 or records % 2 or records > 2 * n_layer:  # (each layer with a state: its R record and its S)
        raise SnapshotError("the piece's recurrent part is not of the layout quipu reads")


# ---- a plain cache's state in parts: the cells from a position on, and a state put back together --

@dataclass(frozen=True)
class _Cache:
    """A sequence state of one plain attention cache (the layout above, one stream, nothing
    after its layers), read apart without copying: its head, its cells' records (`cell` bytes
    each) and positions, and each layer's K and V blocks (a header, then a row per cell, or
    transposed, per embedding row a run of an element per cell: `(header, [(run, item)])`)."""

    head: bytes
    cell: int
    records: memoryview
    positions: list[int]
    v_trans: int
    blocks: list[tuple[bytes, list[tuple[memoryview, int]]]]  # the K blocks, then the V blocks


def _read_cache(data: bytes | memoryview) -> _Cache | None:
    """`data` read as `_Cache`; None where it is not one plain cache of the layout above."""
    read = Reader(data, "the context state")
    try:
        head = bytes(read.skip(_HEAD.size))
        magic, _ = _HEAD.unpack(head)
        (n_stream,) = read.take(_U32)
        (count,) = read.take(_U32)
        if magic != MAGIC or n_stream != 1 or not count:
            return None
        ext = next((e for e in (0, CELL_EXT) if _one_sequence(read, count, e)), None)
        if ext is None:
            return None
        cell = _CELL.size + ext
        records = read.skip(count * cell)
        positions = [_I32.unpack_from(records, i * cell)[0] for i in range(count)]
        trans, layers = read.take(_U32)[0], read.take(_U32)[0]
        blocks: list[tuple[bytes, list[tuple[memoryview, int]]]] = []
        for _ in range(layers):  # K: a row per cell
            header = bytes(read.skip(_LAYER_K.size))
            row = _LAYER_K.unpack(header)[1]
            blocks.append((header, [(read.skip(count * row), row)]))
        for _ in range(layers):  # V: a row per cell, or transposed: a run of an element per cell per embedding row
            if trans:
                header = bytes(read.skip(_LAYER_V_TRANS.size))
                _, item, rows = _LAYER_V_TRANS.unpack(header)
                blocks.append((header, [(read.skip(count * item), item) for _ in range(rows)]))
            else:
                header = bytes(read.skip(_LAYER_K.size))
                row = _LAYER_K.unpack(header)[1]
                blocks.append((header, [(read.skip(count * row), row)]))
    except SnapshotError:
        return None
    return _Cache(head, cell, records, positions, trans, blocks) if read.done else None


def _one_sequence(read: Reader, count: int, ext: int) -> bool:
    size = _CELL.size + ext
    if read.at + count * size > len(read.view):
        return False
    return all(_CELL_HEAD.unpack_from(read.view, read.at + i * size)[1] == 1 for i in range(count))


def _spans(keep: list[bool]) -> list[tuple[int, int]]:
    """The runs of cells `keep` says, as (first, end) index ranges."""
    spans: list[tuple[int, int]] = []
    for i, k in enumerate(keep):
        if k and spans and spans[-1][1] == i:
            spans[-1] = (spans[-1][0], i + 1)
        elif k:
            spans.append((i, i + 1))
    return spans


def _write(parts: list[tuple[_Cache, list[tuple[int, int]]]]) -> bytes:
    """The cells of each cache that its spans say, in order, as one state (the first's layout)."""
    first = parts[0][0]
    count = sum(end - start for _, spans in parts for start, end in spans)

    def picked(block: Any, size: int, spans: list[tuple[int, int]]) -> list[memoryview]:
        return [block[start * size:end * size] for start, end in spans]

    out: list[bytes | memoryview] = [first.head, _U32.pack(1), _U32.pack(count)]
    for cache, spans in parts:
        out += picked(cache.records, cache.cell, spans)
    out += [_U32.pack(first.v_trans), _U32.pack(len(first.blocks) // 2)]
    for b, (header, runs) in enumerate(first.blocks):
        out.append(header)
        for r in range(len(runs)):
            for cache, spans in parts:
                block, size = cache.blocks[b][1][r]
                out += picked(block, size, spans)
    return b"".join(out)


def cells_from(data: bytes | memoryview, start: int) -> bytes | None:
    """The state of the cells of `data` (a whole sequence state) at positions `start` on, as
    one plain cache's state; None where `data` is not one plain cache of the layout above (a
    sliding window's, a recurrent model's: they are kept whole)."""
    cache = _read_cache(data)
    if cache is None:
        return None
    return _write([(cache, _spans([p >= start for p in cache.positions]))])


def joined(base: bytes | memoryview, start: int, piece: bytes | memoryview) -> bytes:
    """The state whose cells are `base`'s before position `start`, then `piece`'s (a
    `cells_from(..., start)` of a state that began as `base` did); SnapshotError where the two are
    not of one layout."""
    below, above = _read_cache(base), _read_cache(piece)
    if below is None or above is None or below.cell != above.cell or below.v_trans != above.v_trans \
            or [(h, [size for _, size in runs]) for h, runs in below.blocks] \
            != [(h, [size for _, size in runs]) for h, runs in above.blocks] \
            or min(above.positions) != start or sorted(p for p in below.positions if p < start) != list(range(start)):
        raise SnapshotError("a cached piece of context state does not go on from the state it was made on")
    return _write([(below, _spans([p < start for p in below.positions])), (above, [(0, len(above.positions))])])
