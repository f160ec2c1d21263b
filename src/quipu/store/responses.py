"""Responses kept by `quipu serve` (the Responses API's `store`), one JSON file each in the data
folder's `responses/`, written atomically and private: the response as its client had it, the
input it answered, and where its conversation is kept (a session, and how many of its messages,
with their digest, end at this response). A response's id is its file's name, checked before any
path is made of it."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quipu.errors import QuipuError
from quipu.paths import private_dir
from quipu.store.files import atomic_write

ID = re.compile(r"resp_[0-9a-f]{8,64}")


@dataclass(frozen=True)
class KeptResponse:
    """A response kept: its `id`, the session its conversation goes on in, how many of that
    session's messages end at it (`at`) and their digest, the response whole, its input items."""

    id: str
    session: str
    at: int
    digest: str
    response: dict[str, Any]
    input: list[Any]


class ResponseStore:
    def __init__(self, root: Path):
        self.root = root

    def _path(self, ident: str) -> Path | None:
        return self.root / f"{ident}.json" if ID.fullmatch(ident) else None

    def put(self, kept: KeptResponse) -> None:
        path = self._path(kept.id)
        assert path is not None  # (the server makes the ids)
        private_dir(self.root)
        atomic_write(path, json.dumps(asdict(kept), ensure_ascii=False).encode())

    def get(self, ident: str) -> KeptResponse | None:
        """The response kept under `ident`; None where there is none (or `ident` is no response's id)."""
        path = self._path(ident)
        if path is None:
            return None
        try:
            data = json.loads(path.read_bytes())
            return KeptResponse(data["id"], data["session"], int(data["at"]), data["digest"], data["response"],
                                list(data["input"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise QuipuError(f"the kept response {ident} cannot be read ({type(exc).__name__}): remove {path}") from None

    def remove(self, ident: str) -> bool:
        path = self._path(ident)
        if path is None:
            return False
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        return True
