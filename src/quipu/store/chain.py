"""What a session's saved context state holds, read from its files' metadata alone: the state
file, then pieces of its log. Each piece holds the cells from its start on, made on top of the
state another piece (its `parent`) or the state file left: the pieces form a tree, a branch of
the conversation a path in it. The state of some tokens (a branch's) is the deepest piece whose
tokens they begin with, and the pieces on its path from the state file (`held_cells`); a piece
newer than the transcript (its turn cut short before the transcript was written), damaged, or
on a damaged path is left out. (A log written before pieces named their parents is a line, each
piece the child of the one before it.)"""

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
    """What the state on disk holds for the context in memory: the state file (its nonce, its
    size) and the pieces of the log on the context's path: together, the first `held` tokens'
    cells. `tip`: the last piece of the path (None: the state file alone); `log_end`: where the
    log's next piece goes."""

    nonce: str | None
    held: int
    pieces: int = 0
    piece_bytes: int = 0
    base_bytes: int = 0
    log_end: int = 0
    tip: str | None = None


@dataclass
class Held:
    """The cells the saved state holds of a transcript's tokens: the first `cells` (0: none),
    from the state file and `pieces` (a path of the log's tree, in order); the log's intact
    records end at `log_end`; `why` it holds less than its files do, where it does."""

    cells: int
    pieces: list[StateBlob] = field(default_factory=list)
    log_end: int = 0
    why: str | None = None

    def chain(self, meta: dict[str, Any], base_bytes: int) -> Chain:
        return Chain(meta.get("nonce"), self.cells, len(self.pieces), sum(len(p.state) for p in self.pieces),
                     base_bytes, self.log_end, self.pieces[-1].meta.get("id") if self.pieces else None)


def held_cells(meta: dict[str, Any], log: tuple[list[tuple[StateBlob, int]], int, str | None], tokens: Sequence[int],
               layout: str) -> Held:
    """How much of `tokens` (a branch's decoded tokens) the state file whose metadata is `meta`
    and its log (`SessionStore.load_pieces`'s answer) hold; `layout`, the layout of a piece
    quipu reads."""
    records, log_end, damage = log
    nonce = meta.get("nonce")
    by_id: dict[str, StateBlob] = {}
    previous = nonce
    for record, _ in records:  # (a piece without an id is the child of the one before it)
        m = record.meta
        if not isinstance(m.get("id"), str):
            m["id"], m["parent"] = f"#{len(by_id)}", previous
        previous = m["id"]
        by_id.setdefault(m["id"], record)

    def path(piece: StateBlob) -> list[StateBlob] | None:
        """The pieces from the state file to `piece`, each following on from the one before."""
        out = [piece]
        while out[-1].meta["start"] > 0 and out[-1].meta.get("parent") != nonce:
            parent = by_id.get(out[-1].meta.get("parent"))  # type: ignore[arg-type]
            if parent is None or parent in out or not _fits(parent.meta, meta, layout) \
                    or not _follows(out[-1].meta, parent.meta):
                return None
            out.append(parent)
        if out[-1].meta["start"] > meta["n_decoded"]:
            return None
        return out[::-1]

    found = [r for r in by_id.values() if _fits(r.meta, meta, layout) and r.meta["n_decoded"] <= len(tokens)]
    found.sort(key=lambda r: r.meta["n_decoded"], reverse=True)
    digests: dict[int, str] = {}
    for record in found:
        n = record.meta["n_decoded"]
        if n not in digests:
            digests[n] = tokens_digest(tokens[:n])
        if record.meta.get("tokens_sha256") != digests[n]:
            continue
        pieces = path(record)
        if pieces is not None:  # (damage elsewhere in the log, on another path, costs these tokens nothing)
            return Held(n, pieces, log_end, _said(damage) if n < len(tokens) else None)
    held = meta["n_decoded"]
    if held > len(tokens) or meta.get("tokens_sha256") != tokens_digest(tokens[:held]):
        # The state file alone, as far as its tokens are these (a piece after it replaced its
        # last cells, and is lost): the rest is read again.
        saved = meta.get("tokens")
        held = len(os.path.commonprefix([saved, list(tokens)])) if isinstance(saved, list) else 0
        if held == 0:
            return Held(0, log_end=log_end, why=_said(damage) or "the saved context state is from another turn")
    return Held(held, log_end=log_end, why=_said(damage))


def _fits(m: dict[str, Any], meta: dict[str, Any], layout: str) -> bool:
    """Whether a piece was made on this state file, by this build, in the layout quipu reads."""
    start, end = m.get("start"), m.get("n_decoded")
    return (m.get("base") == meta.get("nonce") and meta.get("nonce") is not None and m.get("layout") == layout
            and m.get("build") == meta.get("build") and isinstance(start, int) and isinstance(end, int)
            and 0 <= start <= end)


def _follows(child: dict[str, Any], parent: dict[str, Any]) -> bool:
    """Whether a piece's cells go on from where its parent's end (its start within them)."""
    return bool(child["start"] <= parent["n_decoded"])


def _said(damage: str | None) -> str | None:
    return "a piece of the saved context state is damaged" if damage == "a piece is damaged" else None
