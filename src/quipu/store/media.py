"""The media sessions hold (images, recordings): each file's bytes kept once, under its SHA-256,
in a folder beside the sessions (`media/`), readable by this account alone. A session's
transcript names its media by hash (`Transcript.media`); a file no transcript names any more is
removed (`prune`), so media go with the last session that uses them."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Iterable

from quipu.errors import SessionSaveError, SnapshotError
from quipu.paths import private_dir
from quipu.store.files import atomic_write
from quipu.store.transcript import DIGEST


class MediaStore:
    def __init__(self, root: Path):
        self.root = Path(root)

    def path(self, digest: str) -> Path:
        if not DIGEST.fullmatch(digest):
            raise SnapshotError(f"'{digest[:80]}' is not a medium's SHA-256")
        return self.root / digest

    def put(self, data: bytes) -> str:
        """Keeps `data` (once: the same bytes are one file); returns its SHA-256."""
        digest = hashlib.sha256(data).hexdigest()
        path = self.path(digest)
        try:
            if not path.is_file() or path.stat().st_size != len(data):
                private_dir(self.root, levels=3)  # (the media folder, the sessions folder, quipu's data folder)
                atomic_write(path, data)
            else:
                os.utime(path)  # (kept anew: a prune running meanwhile leaves it, see `prune`)
        except OSError as exc:  # (a full disk, a read-only folder: the session stays as it was)
            raise SessionSaveError(f"cannot keep the medium in {self.root}: {exc.strerror or exc}") from None
        return digest

    def get(self, digest: str) -> bytes:
        """The bytes kept under `digest`; a SnapshotError when they are missing or are not those."""
        path = self.path(digest)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise SnapshotError(f"a medium it holds is missing ({path}: {exc.strerror or exc})") from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise SnapshotError(f"a medium it holds is damaged ({path} does not hash to its name)")
        return data

    def size(self, digests: Iterable[str]) -> int:
        total = 0
        for digest in set(digests):
            try:
                total += self.path(digest).stat().st_size
            except (OSError, SnapshotError):
                continue
        return total

    def prune(self, referenced: Iterable[str], settled_s: float = 600) -> list[str]:
        """Removes every medium not in `referenced`, but those kept in the last `settled_s`
        seconds (a turn that is saving one writes its transcript after its media); returns their
        digests."""
        keep = set(referenced)
        if not self.root.is_dir():
            return []
        removed = []
        now = time.time()
        for path in self.root.iterdir():
            if DIGEST.fullmatch(path.name) and path.name not in keep:
                try:
                    if now - path.stat().st_mtime < settled_s:
                        continue
                    path.unlink()
                except FileNotFoundError:
                    continue
                removed.append(path.name)
        return removed
