"""A pull from the Hub (`quipu models pull`, `-m hf:OWNER/REPO[:QUANT]` on first use): the files
`hub.plan_pull` chose, each fetched into the Hugging Face cache as the Hub's client lays it out,
a partial file continued where it stopped (a range request), checked against the Hub's SHA-256
and the GGUF magic, two pulls of one file taking turns; then the model recorded."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from quipu.app.hub import (CHUNK, DISK_MARGIN, GGUF_MAGIC, PLAIN_NAME, HubError, HubErrors, HubFile, HubRef,
                           PullPlan, endpoint, plan_pull, repository_path)
from quipu.errors import QuipuError
from quipu.paths import Dirs, private_dir
from quipu.store.pulled import PulledModel, PulledRecord
from quipu.store.files import atomic_write, flock_until

if TYPE_CHECKING:
    from huggingface_hub import HfFileMetadata


ProgressFn = Callable[[str, int, int], None]  # (file, bytes so far, bytes in all)


def pull(ref: HubRef, dirs: Dirs, *, on_plan: Callable[[PullPlan], None] | None = None,
         on_progress: ProgressFn | None = None, on_wait: Callable[[str], None] | None = None) -> PulledModel:
    """Pulls `ref` into the Hugging Face cache (files already there are not fetched again) and
    records it; the model, with the path to load."""
    plan = plan_pull(ref)
    if on_plan is not None:
        on_plan(plan)
    cache = hub_cache()
    paths, blobs, revision = [], [], ""
    try:
        for f in plan.files:
            path, blob, revision = fetch(plan.repo, f, cache, on_progress, plan.commit, on_wait)
            paths.append(path)
            blobs.append(str(blob))
    except HubError:
        for link in paths:  # (a model of some of its parts is no model: not left to be found)
            link.unlink(missing_ok=True)
        raise
    with open(paths[0], "rb") as head:
        if head.read(4) != GGUF_MAGIC:
            for stored in blobs:
                Path(stored).unlink(missing_ok=True)
            for link in paths:
                link.unlink(missing_ok=True)
            raise HubError(f"{plan.files[0].path} of '{plan.repo}' is not a GGUF file; it was removed")
    template, extras = None, []
    if plan.projector is not None:  # (beside the model in the snapshot: `run -a IMAGE` finds it there)
        _, projector_blob, _ = fetch(plan.repo, plan.projector, cache, on_progress, plan.commit, on_wait)
        extras.append(plan.projector.path)
        blobs.append(str(projector_blob))
    if plan.template is not None:
        try:
            link, template_blob, _ = fetch(plan.repo, HubFile(plan.template, 0, None), cache, None, plan.commit)
            template = repository_template(plan.repo, link, dirs)
            extras.append(plan.template)
            blobs.append(str(template_blob))
        except QuipuError:
            template = None  # a model without its repository's template is still a model
    model = PulledModel(plan.repo, plan.quant, [f.path for f in plan.files], str(paths[0]), plan.size, revision,
                        template, blobs, extras)
    PulledRecord(dirs.models).put(model)
    return model


def repository_template(repo: str, path: Path, dirs: Dirs) -> str | None:
    """The chat template a repository ships, as a file `--chat-template` takes: its
    `chat_template.jinja`, or the `chat_template` of its `tokenizer_config.json` written out."""
    if path.name.endswith(".jinja"):
        return str(path)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    text = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(text, list):  # named templates: the default one
        text = next((t.get("template") for t in text if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(text, str) or not text.strip():
        return None
    out = dirs.models / "templates" / (repo.replace("/", "--") + ".jinja")
    private_dir(out.parent)
    atomic_write(out, text.encode("utf-8"))
    return str(out)


def hub_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def check_room(folder: Path, size: int, repo: str, have: int = 0) -> None:
    """A HubError when the disk under `folder` has no room for `size` bytes (less `have` already
    there) and a margin: said before the download, not when the disk fills."""
    import shutil

    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if size - have + DISK_MARGIN > free:
        raise HubError(f"'{repo}' needs {_gb(size - have)} and the disk at {probe} has {_gb(free)} free; "
                       "nothing more was fetched")


def _gb(n: int) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


@contextlib.contextmanager
def _locked(path: Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """An exclusive lock on `path` (a pull of the same file in another process waits for it,
    `on_wait` told first)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if not flock_until(fd, time.monotonic()):
            if on_wait is not None:
                on_wait()
            flock_until(fd, math.inf)
        yield
    finally:
        os.close(fd)


def fetch(repo: str, f: HubFile, cache: Path, on_progress: ProgressFn | None, commit: str,
          on_wait: Callable[[str], None] | None = None) -> tuple[Path, Path, str]:
    """One file of `repo` at version `commit` into the cache: (its snapshot path, its blob, the
    commit). A partial download is kept as `BLOB.incomplete` and continued with a range request
    next time; two pulls of one file take turns (the Hub client's `.locks/`: `on_wait` is told
    when this one waits for another)."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import repo_folder_name

    with HubErrors(repo):
        meta = get_hf_file_metadata(hf_hub_url(repo, f.path, revision=commit),
                                    token=os.environ.get("HF_TOKEN") or None)
        if not meta.commit_hash or not meta.etag:
            raise HubError(f"{endpoint()} did not say which version of {f.path} it serves")
        if meta.commit_hash != commit:
            raise HubError(f"'{repo}' moved to another version while it was pulled ({f.path} came at "
                           f"{meta.commit_hash[:12]}, its listing at {commit[:12]}); nothing was recorded: pull again")
        for what, value in (("version", meta.commit_hash), ("checksum", meta.etag)):
            if not PLAIN_NAME.fullmatch(value):
                raise HubError(f"{endpoint()} gave {f.path} of '{repo}' a {what} that is not a plain name "
                               f"({value[:80]!r}); nothing was fetched")
        folder = cache / repo_folder_name(repo_id=repo, repo_type="model")
        blob = folder / "blobs" / meta.etag
        snapshots = folder / "snapshots" / meta.commit_hash
        snapshot = snapshots / repository_path(f.path, repo)
        if not os.path.normpath(snapshot).startswith(os.path.normpath(snapshots) + os.sep):
            raise HubError(f"'{repo}' lists {f.path!r}, which is not a path inside the repository")
        size = meta.size if meta.size is not None else f.size
        if not blob.exists():
            blob.parent.mkdir(parents=True, exist_ok=True)
            partial = blob.with_name(blob.name + ".incomplete")
            # (where the Hub's own client locks a blob, so that its downloads and quipu's take turns too)
            lock = cache / ".locks" / folder.name / f"{meta.etag}.lock"
            lock.parent.mkdir(parents=True, exist_ok=True)
            with _locked(lock, lambda: on_wait(f"another download of {f.path} is under way (another quipu, or the "
                                                 "Hugging Face client); waiting for it to finish (Ctrl-C stops)")
                         if on_wait is not None else None):
                if not blob.exists():  # (another pull may have finished it while this one waited)
                    _download(repo, f, meta, partial, size, on_progress)
                    os.replace(partial, blob)
        snapshot.parent.mkdir(parents=True, exist_ok=True)
        if not snapshot.exists():
            snapshot.unlink(missing_ok=True)  # a link left dangling
            snapshot.symlink_to(os.path.relpath(blob, snapshot.parent))
        refs = folder / "refs" / constants.DEFAULT_REVISION
        refs.parent.mkdir(parents=True, exist_ok=True)
        refs.write_text(meta.commit_hash)
    return snapshot, blob, commit


def _download(repo: str, f: HubFile, meta: HfFileMetadata, partial: Path, size: int, on_progress: ProgressFn | None) -> None:
    """The file into `partial`, from where an earlier pull left it, checked against the Hub's checksum."""
    from huggingface_hub.file_download import http_get

    with open(partial, "ab") as out:
        have = out.tell()
        check_room(partial.parent, size, repo, have)
        if on_progress is not None:
            on_progress(f.path, have, size)
        if have < size or size == 0:
            http_get(meta.location, out, resume_size=have, headers=_auth_for(meta.location),
                     expected_size=size, tqdm_class=_progress_class(f.path, on_progress, size, repo))
    expected = f.sha256 or (meta.etag if re.fullmatch(r"[0-9a-f]{64}", meta.etag or "") else None)
    if expected is not None and sha256_of(partial) != expected:
        partial.unlink()
        raise HubError(f"{f.path} of '{repo}' does not match the Hub's checksum; the download was removed, "
                       "pull again")


def _auth_for(url: str) -> dict[str, str]:
    """The token, for a file the Hub serves itself; never for the content server it redirects to
    (a signed address), as the Hub's client does."""
    from urllib.parse import urlsplit

    token = os.environ.get("HF_TOKEN")
    same = urlsplit(url)[:2] == urlsplit(endpoint())[:2]
    return {"authorization": f"Bearer {token}"} if token and same else {}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _progress_class(name: str, on_progress: ProgressFn | None, size: int = 0, repo: str = "") -> type:
    """A tqdm class for the client's download loop that hands its counts to `on_progress`, draws
    nothing, and stops a download that runs past the `size` the Hub said (before it is written:
    the client counts a chunk, then writes it)."""
    from tqdm import tqdm  # (tqdm ships no types: Any here, as pyproject.toml says)

    class Progress(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.update(disable=False, file=open(os.devnull, "w"))
            super().__init__(*args, **kwargs)

        def update(self, n: int = 1) -> None:
            super().update(n)
            if size and self.n > size:
                raise HubError(f"{name} of '{repo}' is longer than the {size:,} bytes the Hub said; the download "
                               "was stopped")
            if on_progress is not None:
                on_progress(name, int(self.n), int(self.total or 0))

        def close(self) -> None:
            file = self.fp
            super().close()
            file.close()

    return Progress
