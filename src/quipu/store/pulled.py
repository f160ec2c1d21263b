"""The record of the models quipu pulled from the Hugging Face Hub, `pulled.json` in quipu's
models folder: which files of which repository, where the cache keeps them, and the chat
template the repository ships. `hf:OWNER/REPO[:QUANT]` is found here without the network, and
`quipu models rm` removes only what is recorded here, never a file quipu did not download.
The files themselves live in the Hugging Face cache, shared with other tools."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from quipu.paths import private_dir
from quipu.store.files import atomic_write

FILENAME = "pulled.json"


@dataclass
class PulledModel:
    repo: str  # OWNER/REPO
    quant: str  # the quantization tag, as the file names spell it (Q4_K_M, ...)
    files: list[str]  # paths in the repository; the first is the one to load (a split model's first part)
    path: str  # the first file, in the cache
    size: int  # bytes, all files
    revision: str = ""  # the commit the files came from
    template: str | None = None  # a chat template file from the repository, in the cache
    blobs: list[str] = field(default_factory=list)  # the cache's blob files behind `files` and `extras`
    extras: list[str] = field(default_factory=list)  # other paths in the repository fetched with it (its template)

    @property
    def ref(self) -> str:
        return f"{self.repo}:{self.quant}"


class PulledRecord:
    """`pulled.json`: read whole, written whole and atomically. A damaged record reads as empty
    (the files are still in the cache; pulling again records them)."""

    def __init__(self, models_dir: Path):
        self.path = models_dir / FILENAME

    def all(self) -> dict[str, PulledModel]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            return {ref: PulledModel(**entry) for ref, entry in data["models"].items()}
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return {}

    def find(self, repo: str, quant: str | None = None) -> PulledModel | None:
        """The pulled model of `repo` (case-insensitive) with `quant`, or with any quant when None."""
        for model in self.all().values():
            if model.repo.lower() == repo.lower() and (quant is None or model.quant.lower() == quant.lower()):
                return model
        return None

    def put(self, model: PulledModel) -> None:
        models = self.all()
        models[model.ref] = model
        self._write(models)

    def remove(self, ref: str) -> None:
        models = self.all()
        models.pop(ref, None)
        self._write(models)

    def _write(self, models: dict[str, PulledModel]) -> None:
        private_dir(self.path.parent, levels=2)  # (the models folder, and quipu's data folder)
        data = {"format": "quipu-pulled", "version": 1, "models": {ref: asdict(m) for ref, m in models.items()}}
        atomic_write(self.path, json.dumps(data, indent=1, ensure_ascii=False).encode("utf-8"))
