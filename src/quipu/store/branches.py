"""A session's branches, as its transcript keeps them: the current branch is the transcript's own
messages and tokens; every other branch (`tree.branches`) is kept as what it adds to the current
one's beginning: the count of the current's messages (`shared`) and context tokens
(`tokens_shared`) it begins with, then its own. A branch's context state is found in the state
log by its tokens (`chain.py`), so nothing here names a file.

    "tree": {"current": {"id": 3, "parent": 1, "made": ISO},
             "next": 4,
             "branches": [{"id": 1, "parent": null, "made": ISO, "updated": ISO,
                           "shared": 2, "messages": [...], "tokens_shared": 812, "tokens": [...],
                           "n_decoded": 1200, "draws": 40, "media": [...]}]}

Ids are small numbers, given in the order branches are made; a branch whose messages begin
another's (what an /undo leaves behind, once another branch goes on from it) is not kept apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from quipu.store.transcript import Transcript


@dataclass
class Branch:
    """One branch, whole: its messages and context tokens from the first."""

    id: int
    parent: int | None
    made: str
    updated: str
    messages: list[dict[str, Any]]
    tokens: list[int]
    n_decoded: int
    draws: int
    media: list[dict[str, Any]] = field(default_factory=list)

    @property
    def turns(self) -> int:
        return sum(1 for m in self.messages if m["role"] == "assistant")


def _shared(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def current_branch(record: Transcript) -> Branch:
    """The transcript's current branch (a transcript made before branches: branch 1)."""
    head = (record.tree or {}).get("current") or {}
    return Branch(int(head.get("id", 1)), head.get("parent"), str(head.get("made", record.created)), record.updated,
                  list(record.messages), list(record.tokens), record.n_decoded, record.draws, list(record.media))


def other_branches(record: Transcript) -> list[Branch]:
    """Every branch of the transcript but the current one, whole."""
    out = []
    for b in (record.tree or {}).get("branches", ()):
        out.append(Branch(b["id"], b.get("parent"), b["made"], b["updated"],
                          list(record.messages[:b["shared"]]) + list(b["messages"]),
                          list(record.tokens[:b["tokens_shared"]]) + list(b["tokens"]), b["n_decoded"], b["draws"],
                          list(b.get("media") or [])))
    return out


def next_id(record: Transcript) -> int:
    tree = record.tree or {}
    return int(tree.get("next", 1 + max([b.id for b in other_branches(record)] + [current_branch(record).id])))


def kept_apart(current: Branch, others: Sequence[Branch]) -> list[Branch]:
    """The branches worth keeping beside `current`: none whose messages begin a longer branch's
    or are the current's (nothing of them would be lost), the first of two the same."""
    out: list[Branch] = []
    for b in others:
        if begins(b, current) or any(o is not b and begins(b, o) and len(o.messages) > len(b.messages)
                                     for o in others) or any(begins(b, o) for o in out):
            continue
        out.append(b)
    return out


def begins(b: Branch, o: Branch) -> bool:
    """Whether `b`'s messages are the first of `o`'s."""
    return _shared(o.messages, b.messages) == len(b.messages)


def tree_field(current: Branch, others: Sequence[Branch], next_free: int) -> dict[str, Any] | None:
    """The transcript's `tree` for `current` and the `others` (None for a session that never
    branched: its transcript stays as it was)."""
    others = kept_apart(current, others)
    if not others and current.id == 1 and current.parent is None:
        return None
    branches = []
    for b in others:
        shared = _shared(current.messages, b.messages)
        tokens_shared = _shared(current.tokens, b.tokens)
        branches.append({"id": b.id, "parent": b.parent, "made": b.made, "updated": b.updated, "shared": shared,
                         "messages": b.messages[shared:], "tokens_shared": tokens_shared,
                         "tokens": b.tokens[tokens_shared:], "n_decoded": b.n_decoded, "draws": b.draws,
                         **({"media": b.media} if b.media else {})})
    return {"current": {"id": current.id, "parent": current.parent, "made": current.made},
            "next": max(next_free, current.id + 1, *(b.id + 1 for b in others)), "branches": branches}


def switched(record: Transcript, to: int) -> Transcript:
    """The transcript with branch `to` current (the one that was, kept among the others)."""
    here = current_branch(record)
    others = other_branches(record)
    target = next((b for b in others if b.id == to), None)
    if target is None:
        raise KeyError(to)
    rest = [b for b in others if b.id != to] + [here]
    return replace(record, messages=target.messages, tokens=target.tokens, n_decoded=target.n_decoded,
                   draws=target.draws, media=target.media,
                   tree=tree_field(target, rest, next_id(record)))


def only(record: Transcript, to: int) -> Transcript:
    """The transcript of branch `to` alone (a branch made a session of its own)."""
    chosen = record if current_branch(record).id == to else switched(record, to)
    return replace(chosen, tree=None)
