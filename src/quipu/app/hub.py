"""Models from the Hugging Face Hub: `quipu models pull OWNER/REPO[:QUANT]`, the same name as
`--model hf:OWNER/REPO[:QUANT]`, and `quipu models rm`.

Files go into the Hugging Face cache (`HF_HUB_CACHE`, `HF_HOME`), laid out as the Hub's own
client lays it out (`blobs/` named by checksum, `snapshots/COMMIT/` links, `refs/`), so other
tools share them and `quipu models list` finds them as any cached model. The Hub's client
library (`huggingface_hub`, imported only here, only by these commands) lists the repository,
reads each file's metadata (size, checksum, commit, redirects, `HF_TOKEN`, `HF_ENDPOINT`) and
streams it. The one thing done otherwise (`hub_pull.py`) is keeping the partial file between runs: the client's
own download starts over after Ctrl-C, a pull here goes on where it stopped (`BLOB.incomplete`,
asked for with a range). A finished file is checked against the Hub's SHA-256 and for the GGUF
magic before it is linked in; a file that fails is removed and said so.

`pulled.json` (`store/pulled.py`) records what quipu fetched, so that `models rm` removes only that.
(`dirs` below are the command's folders, `Environment.dirs`, where pulled models are recorded.)
"""

from __future__ import annotations

import errno
import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from quipu.errors import QuipuError, UsageError
from quipu.models import is_projector
from quipu.paths import Dirs
from quipu.shown import has_unsafe
from quipu.store.pulled import PulledModel as PulledModel  # (what a pull gives the CLI)
from quipu.store.pulled import PulledRecord

# A quantization tag as GGUF file names spell it: Q4_K_M, IQ4_XS, Q8_0, TQ1_0, BF16, F16, ...
QUANT = re.compile(r"(?i)(?<![a-z0-9])(t?i?q\d(?:_[a-z0-9]+)*|mxfp4|bf16|fp16|f16|f32)(?![a-z0-9])")
SPLIT = re.compile(r"(?i)-(\d{5})-of-(\d{5})\.gguf$")
REF = re.compile(r"(?:hf:)?([A-Za-z0-9][A-Za-z0-9._-]{0,95})/([A-Za-z0-9][A-Za-z0-9._-]{0,95})(?::([A-Za-z0-9_]{1,32}))?")
# Without a tag: Q4_K_M, as llama.cpp's -hf picks; else the nearest in size and quality.
PREFERENCE = ["Q4_K_M", "Q4_K_S", "Q4_0", "MXFP4", "IQ4_XS", "IQ4_NL", "Q5_K_M", "Q5_K_S", "Q5_0", "Q3_K_L", "Q3_K_M",
              "Q6_K", "Q8_0", "Q3_K_S", "IQ3_M", "Q2_K", "F16", "BF16", "F32"]
TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json")
CHUNK = 1 << 20
GGUF_MAGIC = b"GGUF"


class HubError(QuipuError):
    """The Hub could not be used (exit 1): unreachable, a refused token, a damaged download."""


@dataclass(frozen=True)
class HubRef:
    repo: str
    quant: str | None = None

    @classmethod
    def parse(cls, text: str) -> "HubRef":
        """OWNER/REPO[:QUANT] (or hf:...), or a short name (`gemma3:1b`, `known_models.py`)."""
        from quipu.app.known_models import is_short_name, known_model, no_size, sizes_of

        if is_short_name(text):
            known, quant = known_model(text)
            return cls(known.repo, quant)
        found = REF.fullmatch(text.strip())
        if not found and sizes_of(text):
            raise UsageError(no_size(text, sizes_of(text), "quipu models pull {}"))
        if not found:
            raise UsageError(f"'{text}' is not a Hub model: give OWNER/REPO or OWNER/REPO:QUANT "
                             "(for instance ggml-org/gemma-3-1b-it-GGUF:Q4_K_M)")
        return cls(f"{found.group(1)}/{found.group(2)}", found.group(3).upper() if found.group(3) else None)

    def __str__(self) -> str:
        return f"{self.repo}:{self.quant}" if self.quant else self.repo


@dataclass
class HubFile:
    path: str
    size: int
    sha256: str | None  # the Hub's checksum of a file kept with LFS


@dataclass
class PullPlan:
    repo: str
    quant: str
    files: list[HubFile]  # a split model's parts in order
    others: list[str] = field(default_factory=list)  # the repository's other quantizations
    template: str | None = None  # a chat template file the repository has
    projector: HubFile | None = None  # the projector (mmproj) for images and audio the repository has
    commit: str = ""  # the version its listing is of, which every file is fetched at

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


def quant_of(filename: str) -> str | None:
    """The quantization tag a GGUF file's name spells, upper-cased; None when it spells none."""
    stem = SPLIT.sub("", Path(filename).name)
    stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
    found = QUANT.findall(stem)
    return found[-1].upper() if found else None


MAX_PARTS = 256  # the parts of one model a pull fetches (the largest models come in a few dozen)


def choose(repo: str, files: list[HubFile], wanted: str | None) -> PullPlan:
    """The files to pull for `wanted` (a tag), or the default quantization."""
    groups: dict[str, list[HubFile]] = {}
    for f in files:
        name = Path(f.path).name
        if not name.lower().endswith(".gguf") or is_projector(name):
            continue
        groups.setdefault(quant_of(name) or SPLIT.sub("", name).removesuffix(".gguf"), []).append(f)
    if not groups:
        raise UsageError(f"'{repo}' has no GGUF file; quipu runs GGUF models (look for a repository named ...-GGUF)")
    tags = sorted(groups)
    if wanted is not None:
        chosen = next((t for t in tags if t.upper() == wanted.upper()), None)
        if chosen is None:
            raise UsageError(f"'{repo}' has no {wanted} file; it has {', '.join(tags)}")
    else:
        chosen = next((t for t in PREFERENCE if t in groups), tags[0])
    parts = sorted(groups[chosen], key=lambda f: f.path)
    first = SPLIT.search(Path(parts[0].path).name)
    if first:  # one model in parts: the parts of the first one's set, in order
        total = first.group(2)
        if not 1 <= int(total) <= MAX_PARTS:
            raise UsageError(f"'{repo}' names its {chosen} model in {int(total)} parts; quipu pulls a model of 1 to "
                             f"{MAX_PARTS} parts")
        prefix = parts[0].path[: -len(first.group(0))]
        parts = [f for f in parts if f.path.startswith(prefix) and (m := SPLIT.search(f.path)) and m.group(2) == total]
        if len(parts) != int(total):
            raise UsageError(f"'{repo}' has {len(parts)} of the {int(total)} parts of its {chosen} model")
    else:
        parts = parts[:1]
    return PullPlan(repo, chosen, parts, [t for t in tags if t != chosen])


# ---- the Hub -------------------------------------------------------------------------------------

def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


REACH_TIMEOUT_S = 8.0  # the longest a first answer from the Hub is waited for


def reach_hub() -> None:
    """Makes sure the Hub answers, at once: the client tries a request it cannot send five more
    times, over 24 s, before it gives up. Its own stderr handler (added when it is imported) is
    taken off, so that what it logs reaches the user through quipu (`--verbose`) alone."""
    import logging

    from huggingface_hub import get_session

    log = logging.getLogger("huggingface_hub")
    log.handlers = [h for h in log.handlers if not (type(h) is logging.StreamHandler and h.formatter is None)]
    get_session().head(endpoint(), timeout=REACH_TIMEOUT_S)  # any answer will do: the Hub is there


class HubErrors:
    """Turns what the Hub's client raises into one-line errors that say what to do."""

    def __init__(self, repo: str):
        self.repo = repo

    def __enter__(self) -> HubErrors:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> Literal[False]:
        if exc is None or isinstance(exc, (QuipuError, KeyboardInterrupt)):
            return False
        from huggingface_hub import errors

        where = endpoint()
        if isinstance(exc, errors.GatedRepoError):
            raise HubError(f"'{self.repo}' is gated: accept its terms on the Hub, then set HF_TOKEN to a token "
                           "of that account") from None
        if isinstance(exc, errors.RepositoryNotFoundError):
            hint = "" if os.environ.get("HF_TOKEN") else " (a private one needs HF_TOKEN)"
            raise UsageError(f"there is no model repository '{self.repo}' on {where}{hint}") from None
        if isinstance(exc, (errors.RevisionNotFoundError, errors.EntryNotFoundError)):
            raise HubError(f"'{self.repo}' changed on {where} while it was read; pull again") from None
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise HubError("the disk is full; free some room and pull again: the download goes on where it "
                           "stopped") from None
        if isinstance(exc, errors.HfHubHTTPError):
            status = getattr(getattr(exc, "response", None), "status_code", "?")
            raise HubError(f"{where} answered {status} for '{self.repo}'") from None
        if isinstance(exc, errors.OfflineModeIsEnabled):
            raise HubError("HF_HUB_OFFLINE is set, so the Hub is not asked: unset it to pull; a model can also be "
                           "given as the path of a .gguf file") from None
        if type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "httpcore2") or isinstance(
                exc, (ConnectionError, TimeoutError)):
            said = clipped(str(exc).splitlines()[0], 120) if str(exc) else type(exc).__name__
            raise HubError(f"cannot reach the Hub at {where} (HF_ENDPOINT): {said}; a model can also be given as "
                           "the path of a .gguf file") from None
        return False


def clipped(text: str, most: int) -> str:
    """`text`, or as much of it as `most` characters hold, cut where a word ends."""
    if len(text) <= most:
        return text
    cut = text[:most].rsplit(" ", 1)[0] if " " in text[:most] else text[:most]
    return cut.rstrip(" ,;:") + "…"


# A name the Hub gives a version or a blob (a commit's 40 hex digits, a checksum): joined to a
# folder of the cache only when it is one plain name.
PLAIN_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")
MAX_LISTING = 100_000  # files a repository's listing may name
DISK_MARGIN = 16 << 20  # bytes a pull leaves free beyond what it fetches


def repository_path(path: object, repo: str) -> str:
    """`path` from the Hub's listing of `repo`, when it is a relative POSIX path inside the
    repository (no absolute path, `..`, backslash, NUL or drive letter) with nothing a terminal
    would act on (`quipu.shown`); else a HubError."""
    if (not isinstance(path, str) or not path or len(path) > 1024 or path.startswith("/") or "\\" in path
            or "\0" in path or re.match(r"[A-Za-z]:", path) or has_unsafe(path)
            or any(part in ("", ".", "..") for part in path.split("/"))):
        shown = repr(path)[:120]
        raise HubError(f"'{repo}' lists a file named {shown}, which is not a path inside the repository; "
                       "nothing was fetched")
    return path


def _size(value: object, repo: str, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise HubError(f"'{repo}' lists {path!r} with a size that is not a number of bytes; nothing was fetched")
    return value


MAX_PAGES = 200  # pages a listing may take (the Hub's hold a thousand entries each)
MAX_PAGE_BYTES = 16 << 20  # the largest page of a listing (the Hub's are a few hundred KB)


def _get_json(repo: str, url: str, params: dict[str, Any] | None, what: str) -> tuple[Any, str | None]:
    """(the JSON a Hub API answers at `url`, read within MAX_PAGE_BYTES, the next page's address)."""
    from huggingface_hub import get_session
    from huggingface_hub.utils._headers import build_hf_headers

    headers = build_hf_headers(token=os.environ.get("HF_TOKEN") or None)
    with get_session().stream("GET", url, params=params, headers=headers, timeout=60.0) as r:
        if r.status_code >= 400:
            code = r.headers.get("X-Error-Code", "")
            if code == "GatedRepo" or r.status_code in (401, 403):
                raise HubError(f"'{repo}' is gated: accept its terms on the Hub, then set HF_TOKEN to a token of that "
                               "account")
            if code == "RepoNotFound" or r.status_code == 404:
                hint = "" if os.environ.get("HF_TOKEN") else " (a private one needs HF_TOKEN)"
                raise UsageError(f"there is no model repository '{repo}' on {endpoint()}{hint}")
            raise HubError(f"{endpoint()} answered {r.status_code} for '{repo}'")
        body = bytearray()
        for chunk in r.iter_bytes():
            body += chunk
            if len(body) > MAX_PAGE_BYTES:
                raise HubError(f"{endpoint()} answered {what} of '{repo}' larger than {MAX_PAGE_BYTES >> 20} MB; "
                               "nothing was fetched")
        following = r.links.get("next", {}).get("url")
    try:
        return json.loads(body), following
    except ValueError:
        raise HubError(f"{endpoint()} answered {what} of '{repo}' that cannot be read; nothing was fetched") from None


def _head_commit(repo: str) -> str:
    """The version the repository's main branch is at now, which a pull is pinned to."""
    from urllib.parse import quote

    from huggingface_hub import constants

    found, _ = _get_json(repo, f"{endpoint()}/api/models/{repo}/revision/{quote(constants.DEFAULT_REVISION, safe='')}",
                         {"expand[]": "sha"}, "what it knows")
    commit = found.get("sha") if isinstance(found, dict) else None
    if not isinstance(commit, str) or not commit:
        raise HubError(f"{endpoint()} did not say which version of '{repo}' it serves; nothing was fetched")
    if not PLAIN_NAME.fullmatch(commit):
        raise HubError(f"{endpoint()} gave '{repo}' a version that is not a plain name ({commit[:80]!r}); "
                       "nothing was fetched")
    return commit


def _tree(repo: str, commit: str) -> list[dict[str, Any]]:
    """Every entry of the repository's listing at `commit`, its pages followed and bounded: in
    number, in bytes each, in entries in all, and a page with nothing on it that points to
    another refused (a listing that pages forever)."""
    url: str | None = f"{endpoint()}/api/models/{repo}/tree/{commit}"
    params: dict[str, Any] | None = {"recursive": "true"}
    entries: list[dict[str, Any]] = []
    pages = 0
    while url is not None:
        pages += 1
        if pages > MAX_PAGES:
            raise HubError(f"the listing of '{repo}' runs past {MAX_PAGES:,} pages; nothing was fetched")
        page, url = _get_json(repo, url, params, "a listing")
        params = None  # (the next page's address holds them)
        if not isinstance(page, list) or not all(isinstance(e, dict) for e in page):
            raise HubError(f"{endpoint()} answered a listing of '{repo}' that cannot be read; nothing was fetched")
        if not page and url is not None:
            raise HubError(f"{endpoint()} answered an empty page of the listing of '{repo}' that points to another; "
                           "nothing was fetched")
        entries += page
        if len(entries) > MAX_LISTING:
            raise HubError(f"'{repo}' lists more than {MAX_LISTING:,} files; nothing was fetched")
    return entries


def plan_pull(ref: HubRef) -> PullPlan:
    """What pulling `ref` would fetch, asked of the Hub at the version its main branch is at now
    (every file is fetched at that version); every path it lists checked first."""
    with HubErrors(ref.repo):
        reach_hub()
        commit = _head_commit(ref.repo)
        entries = _tree(ref.repo, commit)
    files = []
    for e in entries:
        path = repository_path(e.get("path"), ref.repo)
        if e.get("type", "file") == "file":
            lfs = e.get("lfs")
            sha = lfs.get("oid") if isinstance(lfs, dict) else None
            files.append(HubFile(path, _size(e.get("size"), ref.repo, path), sha if isinstance(sha, str) else None))
    plan = choose(ref.repo, files, ref.quant)
    paths = {f.path for f in files}
    return replace(plan, template=next((t for t in TEMPLATE_FILES if t in paths), None),
                   projector=projector_of(files, plan.files[0].path), commit=commit)


# Which projector of several a pull takes, as llama.cpp's -hf does: full precision first.
PROJECTOR_PREFERENCE = ("F16", "BF16", "F32", "Q8_0")


def projector_of(files: list[HubFile], model: str) -> HubFile | None:
    """The projector (`mmproj*.gguf`) beside the model file in its repository, the most precise
    of them where there are several; None for none."""
    folder = str(Path(model).parent)
    found = sorted((f for f in files if is_projector(Path(f.path).name) and str(Path(f.path).parent) == folder),
                   key=lambda f: f.path)
    if not found:
        return None
    for tag in PROJECTOR_PREFERENCE:
        for f in found:
            if quant_of(f.path) == tag:
                return f
    return found[0]


# ---- what was pulled -----------------------------------------------------------------------------

def pulled(ref: HubRef, dirs: Dirs) -> PulledModel | None:
    """The pulled model `ref` names, when its files are still in the cache."""
    model = PulledRecord(dirs.models).find(ref.repo, ref.quant)
    if model is None or not Path(model.path).is_file():
        return None
    return model


def pulled_paths(dirs: Dirs) -> set[str]:
    return {m.path for m in PulledRecord(dirs.models).all().values()}


def remove(name: str, dirs: Dirs) -> PulledModel:
    """Removes a pulled model's files from the cache (a blob only when nothing else links to it)
    and from the record; a model quipu did not pull is refused."""
    record = PulledRecord(dirs.models)
    models = record.all().values()
    from quipu.app.known_models import is_short_name

    if is_short_name(name):
        name = str(HubRef.parse(name))
    model = next((m for m in models if name.lower() in (m.ref.lower(), m.repo.lower(), f"hf:{m.ref}".lower(),
                                                          hf_name(m).lower())), None)
    if model is None:
        raise UsageError(f"'{name}' is not a model quipu pulled; `quipu models list` says where each came from "
                         "(quipu removes only what it downloaded)")
    if [m for m in models if m.repo.lower() == model.repo.lower()] != [model] and name.lower() == model.repo.lower():
        raise UsageError(f"quipu pulled several quantizations of '{model.repo}'; name one ({model.repo}:QUANT)")
    snapshot_dir = Path(model.path).parent
    for _ in Path(model.files[0]).parts[:-1]:
        snapshot_dir = snapshot_dir.parent
    others = [m for m in models if m is not model]
    shared = {p for m in others for p in m.extras}  # another pulled quantization's template stays
    links = [snapshot_dir / f for f in model.files + [e for e in model.extras if e not in shared]]
    for link in links:
        link.unlink(missing_ok=True)
    if model.template and Path(model.template).parent == dirs.models / "templates" and not shared:
        Path(model.template).unlink(missing_ok=True)
    folder = snapshot_dir.parent.parent
    still = {os.path.realpath(p) for p in (folder / "snapshots").rglob("*") if p.is_symlink()}
    for blob in model.blobs:
        if os.path.realpath(blob) not in still:
            Path(blob).unlink(missing_ok=True)
    record.remove(model.ref)
    return model


def hf_name(model: PulledModel) -> str:
    """The name `quipu models list` gives the pulled file (OWNER/REPO/FILE-STEM)."""
    owner, repo = model.repo.split("/", 1)
    return f"{owner}/{repo}/{Path(model.files[0]).stem}"
