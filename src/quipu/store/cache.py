"""The prompt cache: context states of earlier prompts, so that a run whose prompt begins as an
earlier one did (a long system prompt, few-shot examples, the same piped document) restores
that beginning instead of reading it again.

Each entry is a state file (statefile.py: checksummed, written atomically) in the cache
folder, named by a digest of what it depends on (model fingerprint, llama.cpp build, context
settings) and of its tokens, which its metadata holds. A lookup reads only the entries'
metadata and picks the one sharing the longest beginning with the new prompt; the caller
restores its state and keeps that beginning. Entries are used least recently first out of a
size budget. A damaged entry is dropped, never trusted and never an error.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from quipu.errors import SnapshotError
from quipu.paths import private_dir
from quipu.store.statefile import read_meta, read_state, state_chunks
from quipu.store.files import atomic_write, clean_temporaries, oldest_first

DEFAULT_MAX_BYTES = 2 << 30
MIN_TOKENS = 128  # a shorter beginning is read faster than a file is
SUFFIX = ".kv"


@dataclass
class CacheHit:
    tokens: list[int]  # the tokens the entry's state holds
    # How many of them begin the new prompt; where the entry says where its state may be cut
    # back to (`stops`), the last of them before the new prompt's last token.
    reuse: int
    state: bytes | memoryview
    path: Path
    stops: list[int] | None = None


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
        MIN_TOKENS of it), its state verified; None when there is none."""
        best = self._best(key, tokens)
        if best is None:
            return None
        reuse, path, held, stops = best
        try:
            blob = read_state(path)
        except (OSError, SnapshotError) as exc:
            self.drop(path, str(exc))
            return None
        if blob.meta.get("tokens") != held:
            self.drop(path, "its metadata changed while it was read")
            return None
        try:
            os.utime(path)  # used: the last to go
        except OSError:
            pass
        return CacheHit(held, reuse, blob.state, path, stops)

    def save(self, key: dict[str, Any], tokens: Sequence[int], state: bytes | memoryview,
             stops: Sequence[int] | None = None) -> Path | None:
        """Keeps the state of a context holding `tokens`; None when too short to be worth a file
        or when the disk refuses (a cache must never fail a run). `stops`: the only counts of its
        tokens the state can be cut back to (a recurrent state's checkpoints), None: any."""
        if len(tokens) < MIN_TOKENS:
            return None
        path = self.root / f"{self._digest(key, tokens)[:40]}{SUFFIX}"
        meta: dict[str, Any] = {"key": self._digest(key), "tokens": list(tokens), "n_tokens": len(tokens)}
        if stops is not None:
            meta["stops"] = sorted(set(stops))
        try:
            private_dir(self.root, levels=2)  # (the prompts folder, and quipu's cache folder)
            atomic_write(path, state_chunks(meta, state))
        except (OSError, SnapshotError) as exc:
            self.notes.append(f"prompt cache: could not save an entry: {exc}")
            return None
        self.enforce_budget(keep=path)
        return path

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
