"""What a session's saved context state holds, read from its files' metadata alone: the state
file, then the pieces of its log that follow on from it, as far as the transcript's tokens bear
them out (`held_cells`). A piece holds the cells from its start on, valid only after the cells
the pieces before it left, so the chain ends at the first piece that does not follow; a piece
newer than the transcript (its turn cut short before the transcript was written) is left out."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

from quipu.store.statefile import StateBlob


def tokens_digest(tokens: Sequence[int]) -> str:
    """What a state's metadata names its tokens by."""
    return hashlib.sha256(json.dumps(list(tokens), separators=(",", ":")).encode()).hexdigest()


@dataclass
class Chain:
    """What the state on disk holds: the state file (its nonce, its size) and the pieces of the
    log after it: together, the first `held` tokens' cells."""

    nonce: str | None
    held: int
    pieces: int = 0
    piece_bytes: int = 0
    base_bytes: int = 0
    log_end: int = 0


@dataclass
class Held:
    """The cells the saved state holds of a transcript's tokens: the first `cells` (0: none),
    from the state file and `pieces`, the log read to `log_end`; `why` it holds less than its
    files do, where it does."""

    cells: int
    pieces: list[StateBlob] = field(default_factory=list)
    log_end: int = 0
    why: str | None = None

    def chain(self, meta: dict[str, Any], base_bytes: int) -> Chain:
        return Chain(meta.get("nonce"), self.cells, len(self.pieces), sum(len(p.state) for p in self.pieces),
                     base_bytes, self.log_end)


def held_cells(meta: dict[str, Any], log: tuple[list[tuple[StateBlob, int]], int, str | None], tokens: Sequence[int],
               layout: str) -> Held:
    """How much of `tokens` (the transcript's decoded tokens) the state file whose metadata is
    `meta` and its log (`SessionStore.load_pieces`'s answer) hold; `layout`, the layout of a
    piece quipu reads."""
    records, _, damage = log
    held = meta["n_decoded"]
    chain = []  # the pieces that follow on from the state file, one from another
    for record, end_at in records:
        m = record.meta
        start, end = m.get("start"), m.get("n_decoded")
        if m.get("base") != meta.get("nonce") or meta.get("nonce") is None or m.get("layout") != layout or \
                m.get("build") != meta.get("build") or \
                not isinstance(start, int) or not isinstance(end, int) or not 0 <= start <= held or end < start:
            break
        chain.append((record, end_at))
        held = end
    # Up to the last whose tokens the transcript's begin with: the last one's tokens are those
    # of all the chain keeps.
    while chain:
        m = chain[-1][0].meta
        if m["n_decoded"] <= len(tokens) and m.get("tokens_sha256") == tokens_digest(tokens[:m["n_decoded"]]):
            break
        chain.pop()
    why = "a piece of the saved context state is damaged" if damage == "a piece is damaged" else None
    if chain:
        return Held(chain[-1][0].meta["n_decoded"], [record for record, _ in chain], chain[-1][1], why)
    held = meta["n_decoded"]
    if held > len(tokens) or meta.get("tokens_sha256") != tokens_digest(tokens[:held]):
        # The state file alone, as far as its tokens are the transcript's (a piece after it
        # replaced its last cells, and is lost): the rest is read again.
        saved = meta.get("tokens")
        held = len(os.path.commonprefix([saved, list(tokens)])) if isinstance(saved, list) else 0
        if held == 0:
            return Held(0, why=why or "the saved context state is from another turn")
    return Held(held, why=why)
