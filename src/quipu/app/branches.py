"""A conversation's branches as a user sees them: a tree whose nodes are the branches, each
hung under the older branch it shares the most messages with (`rows`), and the words `/switch`
takes besides an id (`parent`, `next`, `prev`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from quipu.errors import UsageError
from quipu.sessions.base import common_prefix
from quipu.store.branches import Branch


@dataclass(frozen=True)
class BranchRow:
    """One branch in the tree: `depth` below the first, hung under `under` (None: the first),
    leaving it at its exchange `leaves_at` (1 is the first); `first`, what it says first of its
    own (its first message that is not its parent's; the first branch's, what it says where the
    first of the others leaves it)."""

    id: int
    under: int | None
    depth: int
    leaves_at: int
    first: str
    turns: int
    tokens: int
    updated: str
    current: bool

    def to_json(self) -> dict[str, object]:
        return dict(self.__dict__)


def rows(current: Branch, others: Sequence[Branch]) -> list[BranchRow]:
    """The branches in the order a tree shows them: each under the older branch it shares the
    most messages with, its children after it, oldest first."""
    everyone = sorted([current, *others], key=lambda b: b.id)
    under: dict[int, tuple[int | None, int]] = {}
    for i, b in enumerate(everyone):
        best: tuple[int | None, int] = (None, 0)
        for older in everyone[:i]:
            n = common_prefix(older.messages, b.messages)
            if best[0] is None or n > best[1]:
                best = (older.id, n)
        under[b.id] = best
    out: list[BranchRow] = []

    def visit(b: Branch, depth: int) -> None:
        parent, shared = under[b.id]
        # (the first branch: what it says where the first of the others leaves it)
        parts = [n for child, (up, n) in under.items() if up == b.id and child != b.id]
        at = shared if parent is not None or not parts else min(parts)
        own = [m for m in b.messages[at:] if m["role"] in ("user", "assistant")]
        said = own[0] if own else None
        first = (said["content"] if said is not None and said["role"] == "user" else
                 f"({'another reply' if parent is not None else 'its reply'}) {said['content']}" if said is not None
                 else "(nothing of its own yet)")
        # (where it parts from its parent inside an exchange, at its reply, it leaves that exchange)
        users = sum(1 for m in b.messages[:shared] if m["role"] == "user")
        leaves = users if users and said is not None and said["role"] != "user" else users + 1
        out.append(BranchRow(b.id, parent, depth, leaves, " ".join(first.split()), b.turns, len(b.tokens), b.updated,
                             b is current))
        for child in everyone:
            if child is not b and under[child.id][0] == b.id:
                visit(child, depth + 1)

    visit(everyone[0], 0)
    return out


def chosen(word: str, current: Branch, others: Sequence[Branch]) -> int:
    """The branch `/switch WORD` names: an id the tree shows, or `parent` (the branch this one
    hangs under), `next` or `prev` (a sibling under the same branch, by age)."""
    found = rows(current, others)
    here = next(r for r in found if r.current)
    ids = [r.id for r in found]
    word = word.strip().lower()
    if word.isdigit() and word.isascii():
        if int(word) not in ids:
            raise UsageError(f"no branch {word} (/tree shows them: {', '.join(map(str, sorted(ids)))})")
        return int(word)
    if word == "parent":
        if here.under is None:
            raise UsageError("this branch is the first: it hangs under none")
        return here.under
    if word in ("next", "prev"):
        siblings = sorted(r.id for r in found if r.under == here.under)
        k = siblings.index(here.id) + (1 if word == "next" else -1)
        if not 0 <= k < len(siblings) or len(siblings) == 1:
            raise UsageError(f"no {'later' if word == 'next' else 'earlier'} branch beside this one (/tree shows them)")
        return siblings[k]
    raise UsageError(f"/switch takes a branch's id (/tree shows them), parent, next or prev, not '{word[:40]}'")
