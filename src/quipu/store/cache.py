"""The prompt cache: context states of earlier prompts, so that a run whose prompt begins as an
earlier one did (a long system prompt, few-shot examples, the same piped document) restores
that beginning instead of reading it again.

Each entry is a state file (statefile.py: checksummed, written atomically) in the cache
folder, named by a digest of what it depends on (model fingerprint, llama.cpp build, context
settings) and of its tokens, which its metadata holds. An entry may hold only the cells it adds
to an earlier one (its `parent`, from the position `start` on), so that a long beginning many
prompts share (an agent's system prompt and tools, a conversation that grows a turn at a time) is
kept once and each prompt writes what it added. A lookup reads only the entries' metadata and
picks the one sharing the longest beginning with the new prompt, then the entries it goes on
from; the caller restores their state and keeps that beginning. Entries are used least recently
first out of a size budget (an entry used, or gone on from, makes those it goes on from used
too, so that they go after it). A damaged entry is dropped, never trusted and never an error.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from quipu.errors import SnapshotError
from quipu.paths import private_dir
from quipu.store.statefile import read_meta, read_state, state_chunks
from quipu.store.files import atomic_write, clean_temporaries, oldest_first

DEFAULT_MAX_BYTES = 2 << 30
MIN_TOKENS = 128  # a shorter beginning is read faster than a file is
SUFFIX = ".kv"
MAX_CHAIN = 64  # entries a lookup reads, one going on from the next, at most (a longer chain: a whole entry)


@dataclass
class CacheHit:
    tokens: list[int]  # the tokens the entry's state holds
    # How many of them begin the new prompt; where the entry says where its state may be cut
    # back to (`stops`), the last of them before the new prompt's last token.
    reuse: int
    state: bytes | memoryview  # the state of the first entry of its chain, whole
    path: Path
    stops: list[int] | None = None
    # The cells each entry after the first adds, from its position on (the first's child first).
    pieces: list[tuple[int, bytes | memoryview]] = field(default_factory=list)


@dataclass(frozen=True)
class Parent:
    """An entry a new one may go on from: where it is, how many of its tokens begin the new
    entry's, where its state may be cut back to (None: anywhere), how many entries its chain holds."""

    path: Path
    shared: int
    stops: list[int] | None
    depth: int


class CacheEntries:
    """The prompt cache's entries on disk, in their folder, within a budget of bytes (the prompt
    cache as a session uses it is `app.prompt_cache.PromptCache`)."""

    def __init__(self, root: Path, max_bytes: int = DEFAULT_MAX_BYTES):
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.notes: list[str] = []  # what was dropped and why, for --verbose

    @staticmethod
    def _digest(key: dict[str, Any], tokens: Sequence[int] = ()) -> str:
        data = json.dumps(key, sort_keys=True) + json.dumps(list(tokens), separators=(",", ":"))
        return hashlib.sha256(data.encode()).hexdigest()

    def entries(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob(f"*{SUFFIX}") if not p.name.startswith("."))

    def _best(self, key: dict[str, Any], tokens: Sequence[int]
              ) -> tuple[int, Path, list[int], list[int] | None] | None:
        """The entry made under `key` sharing the longest beginning with `tokens` (at least
        MIN_TOKENS), by its metadata alone: how much (`CacheHit.reuse`), its path, its tokens,
        its stops."""
        clean_temporaries(self.root)
        want = self._digest(key)
        wanted = list(tokens)
        best: tuple[int, Path, list[int], list[int] | None] | None = None
        for path in self.entries():
            try:
                meta = read_meta(path)
            except (OSError, SnapshotError) as exc:
                self.drop(path, str(exc))
                continue
            held = meta.get("tokens")
            if meta.get("key") != want:
                continue
            if not (isinstance(held, list) and all(type(t) is int for t in held)):
                self.drop(path, "its tokens are not token ids")
                continue
            reuse = len(os.path.commonprefix([held, wanted]))  # (it takes any sequences, not only paths)
            stops = meta.get("stops")
            if isinstance(stops, list) and all(type(s) is int for s in stops):  # (where its state can go back to)
                reuse = max([s for s in stops if s <= min(reuse, len(wanted) - 1)] + [0])
            else:
                stops = None
            if reuse >= MIN_TOKENS and (best is None or reuse > best[0]):
                best = (reuse, path, held, stops)
        return best

    def peek(self, key: dict[str, Any], tokens: Sequence[int]) -> tuple[int, bool]:
        """How many of `tokens` `lookup` would find (its state not yet verified; 0 for none), and
        whether the entry said where its state may be cut back to (`CacheHit.stops`)."""
        best = self._best(key, tokens)
        return (0, False) if best is None else (best[0], best[3] is not None)

    def lookup(self, key: dict[str, Any], tokens: Sequence[int]) -> CacheHit | None:
        """The entry made under `key` that shares the longest beginning with `tokens` (at least
        MIN_TOKENS of it), its state and those of the entries it goes on from verified; None
        when there is none."""
        best = self._best(key, tokens)
        if best is None:
            return None
        reuse, path, held, stops = best
        chain = self._chain(path, held)
        if chain is None:
            return None
        for link in chain:
            used(link[0])  # (used: the last to go, those it goes on from after it)
        (_, first, _), rest = chain[-1], chain[-2::-1]
        return CacheHit(held, reuse, first, path, stops, [(start, state) for _, state, start in rest])

    def _chain(self, path: Path, held: list[int]) -> list[tuple[Path, bytes | memoryview, int]] | None:
        """Entry `path` (holding `held`) and those it goes on from, each with its state and the
        position its cells start at, the entry first; None where one is missing or damaged (the
        entry is dropped: nothing can be made of it)."""
        chain: list[tuple[Path, bytes | memoryview, int]] = []
        tokens: list[int] = held
        while len(chain) < MAX_CHAIN:
            try:
                blob = read_state(path)
            except (OSError, SnapshotError) as exc:
                self.drop(chain[0][0] if chain else path, str(exc))
                return None
            meta = blob.meta
            if not chain and meta.get("tokens") != held:
                self.drop(path, "its metadata changed while it was read")
                return None
            start, parent = meta.get("start", 0), meta.get("parent")
            if chain and meta.get("tokens", [])[:chain[-1][2]] != tokens[:chain[-1][2]]:
                self.drop(chain[0][0], "an entry it goes on from holds other tokens")
                return None
            chain.append((path, blob.state, start if parent is not None else 0))
            if parent is None:
                return chain
            if not isinstance(parent, str) or not isinstance(start, int) or "/" in parent or not parent.endswith(SUFFIX):
                self.drop(chain[0][0], "it names no entry to go on from")
                return None
            path, tokens = self.root / parent, meta.get("tokens", [])
        self.drop(chain[0][0], "it goes on from too many entries")
        return None

    def parent_for(self, key: dict[str, Any], tokens: Sequence[int]) -> Parent | None:
        """The entry made under `key` a new entry of `tokens` may go on from: the one sharing the
        longest beginning with them (at least MIN_TOKENS), by its metadata alone."""
        best = self._best(key, list(tokens) + [-1])  # (every token of them may be shared)
        if best is None:
            return None
        reuse, path, _, stops = best
        try:
            depth = int(read_meta(path).get("depth", 1))
        except (OSError, SnapshotError, ValueError, TypeError):
            return None
        return Parent(path, reuse, stops, depth)

    def save(self, key: dict[str, Any], tokens: Sequence[int], state: bytes | memoryview,
             stops: Sequence[int] | None = None, parent: Parent | None = None, start: int = 0) -> Path | None:
        """Keeps the state of a context holding `tokens` (with `parent`: the state of its cells
        from position `start` on, which goes on from that entry's first `start`); None when too
        short to be worth a file or when the disk refuses (a cache must never fail a run).
        `stops`: the only counts of its tokens the state can be cut back to (a recurrent state's
        checkpoints), None: any."""
        if len(tokens) < MIN_TOKENS:
            return None
        path = self.root / f"{self._digest(key, tokens)[:40]}{SUFFIX}"
        meta: dict[str, Any] = {"key": self._digest(key), "tokens": list(tokens), "n_tokens": len(tokens)}
        if stops is not None:
            meta["stops"] = sorted(set(stops))
        if parent is not None:
            if parent.path == path:
                return path  # (the same tokens again: the entry there holds them)
            meta.update(parent=parent.path.name, start=start, depth=parent.depth + 1)
        try:
            private_dir(self.root, levels=2)  # (the prompts folder, and quipu's cache folder)
            atomic_write(path, state_chunks(meta, state))
        except (OSError, SnapshotError) as exc:
            self.notes.append(f"prompt cache: could not save an entry: {exc}")
            return None
        if parent is not None:
            self._used_from(parent.path)
        self.enforce_budget(keep=path)
        return path

    def _used_from(self, path: Path) -> None:
        """Entry `path` and those it goes on from count as used now, after what goes on from them."""
        for _ in range(MAX_CHAIN):
            used(path)
            try:
                parent = read_meta(path).get("parent")
            except (OSError, SnapshotError):
                return
            if not isinstance(parent, str) or "/" in parent:
                return
            path = self.root / parent

    def enforce_budget(self, keep: Path | None = None) -> None:
        """Removes the least recently used entries until the rest fit in the budget."""
        sized, total = oldest_first(self.entries())
        for size, path in sized:
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            path.unlink(missing_ok=True)
            total -= size

    def info(self) -> dict[str, Any]:
        sizes = []
        for path in self.entries():
            try:
                sizes.append(path.stat().st_size)
            except FileNotFoundError:
                pass
        return {"path": str(self.root), "entries": len(sizes), "bytes": sum(sizes), "max_bytes": self.max_bytes}

    def clear(self) -> int:
        removed = 0
        for path in self.entries():
            path.unlink(missing_ok=True)
            removed += 1
        return removed

    def drop(self, path: Path, why: str) -> None:
        """Removes a damaged or unusable entry, noting why."""
        self.notes.append(f"prompt cache: dropped {path.name}: {why}")
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass


def used(path: Path) -> None:
    """Marks an entry used now (the budget lets the least lately used go first)."""
    try:
        os.utime(path)
    except OSError:
        pass
