"""Model files' fingerprints remembered across runs (`fingerprints.json` in quipu's cache folder).

`models.fingerprint` hashes the whole of a model file, seconds for a large one that a one-shot or
a resume would spend on every start. A fingerprint is kept here by the file's whole path and its identity
(`models.file_identity`), so a file replaced, written or touched since is hashed again. A damaged
or unreadable record is as good as none: it is never an error.
"""

from __future__ import annotations

from typing import Any

import json
from pathlib import Path

from quipu.paths import private_dir
from quipu.store.files import atomic_write

MAX_ENTRIES = 64  # files remembered; the least recently hashed go first
MAX_BYTES = 1 << 20  # (a record is a few KB; anything larger is not one of ours)


class Fingerprints:
    """The record at `path`: {model file's whole path: [identity..., fingerprint]}, oldest first."""

    def __init__(self, path: Path):
        self.path = path

    def _entries(self) -> dict[str, list[Any]]:
        try:
            with open(self.path, "rb") as fh:
                raw = fh.read(MAX_BYTES + 1)
            found = json.loads(raw) if len(raw) <= MAX_BYTES else None
        except (OSError, ValueError):
            return {}
        return found if isinstance(found, dict) else {}

    def recall(self, model: Path, identity: tuple[int, ...]) -> str | None:
        """The fingerprint kept for `model` when the file is still the one it was made of
        (`models.file_identity`)."""
        entry = self._entries().get(str(model))
        if isinstance(entry, list) and len(entry) == len(identity) + 1 and tuple(entry[:-1]) == identity \
                and isinstance(entry[-1], str):
            return entry[-1]
        return None

    def keep(self, model: Path, identity: tuple[int, ...], fingerprint: str) -> None:
        """Remembers `fingerprint` for `model` as it is now; a disk that refuses is let be."""
        entries = self._entries()
        entries.pop(str(model), None)
        entries[str(model)] = [*identity, fingerprint]
        kept = dict(list(entries.items())[-MAX_ENTRIES:])
        try:
            private_dir(self.path.parent)
            atomic_write(self.path, json.dumps(kept).encode())
        except OSError:
            pass
