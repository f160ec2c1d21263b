"""SessionStore: named sessions on disk, written atomically, one writer at a time.

Each session NAME is two files in the sessions folder:

- `NAME.json`, the transcript: messages, settings, seed, model fingerprint, the exact context
  token history. It is the truth, readable, and never deleted to save space.
- `NAME.kv`, the state file (see snapshot.py): a cache of the context that makes resuming
  instant. It may be missing, stale or damaged; the transcript then rebuilds it.

`NAME.lock` is held (flock) by whichever process is working on the session.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import secrets
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from quipu.errors import (
    SessionExists,
    SessionLocked,
    SessionNameError,
    SessionNotFound,
    SessionSaveError,
    SnapshotError,
)
from quipu.sessions.snapshot import StateBlob, decode_state, encode_state

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
TRANSCRIPT_FORMAT = "quipu-session"
TRANSCRIPT_VERSION = 1
LOCK_WAIT_S = 3.0
STALE_TEMP_S = 3600.0
DEFAULT_MAX_STATE_BYTES = 4 << 30


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        shown = name if isinstance(name, str) and len(name) <= 80 and name.isprintable() else repr(name)[:80]
        raise SessionNameError(
            f"bad session name {shown!s}: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return name


@dataclass
class SessionInfo:
    name: str
    model: str
    turns: int
    tokens: int
    size_bytes: int
    updated: str
    has_state: bool

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class SessionStore:
    def __init__(self, root: Path):
        self.root = Path(root)

    # ---- paths ---------------------------------------------------------------------------

    def transcript_path(self, name: str) -> Path:
        return self.root / f"{validate_name(name)}.json"

    def state_path(self, name: str) -> Path:
        return self.root / f"{validate_name(name)}.kv"

    def exists(self, name: str) -> bool:
        return self.transcript_path(name).exists()

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.stem for p in self.root.glob("*.json") if NAME_RE.fullmatch(p.stem))

    # ---- locking -------------------------------------------------------------------------

    @contextmanager
    def lock(self, name: str, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
        """Holds the session's lock; waits up to `wait_s`, then fails with a clear message."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / f"{validate_name(name)}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                    if time.monotonic() >= deadline:
                        raise SessionLocked(
                            f"session '{name}' is in use by another quipu process; try again when it is done"
                        ) from None
                    time.sleep(0.05)
            yield
        finally:
            os.close(fd)

    # ---- reading -------------------------------------------------------------------------

    def load_transcript(self, name: str) -> dict[str, Any]:
        path = self.transcript_path(name)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise SessionNotFound(f"no session named '{name}' (see `quipu sessions list`)") from None
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise SnapshotError(f"session '{name}' is damaged: {path} is not valid JSON; it was left as it is") from None
        problem = check_transcript(record)
        if problem:
            raise SnapshotError(f"session '{name}' is damaged: {problem}; {path} was left as it is")
        return record

    def load_state(self, name: str) -> tuple[StateBlob | None, str | None]:
        """(the verified state, None) or (None, why there is none usable)."""
        path = self.state_path(name)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None, "no saved context state"
        except OSError as exc:
            return None, f"the state file cannot be read ({exc.strerror})"
        try:
            return decode_state(data), None
        except SnapshotError as exc:
            return None, str(exc)

    # ---- writing -------------------------------------------------------------------------

    def save(self, name: str, record: dict[str, Any], state: bytes | None, state_meta: dict[str, Any] | None) -> None:
        """Writes the state file (or removes a stale one), then the transcript, each atomically.
        A failed write (disk full, read-only folder) leaves the previous save as it was."""
        body = json.dumps(record, ensure_ascii=False, indent=1).encode("utf-8")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if state is not None and state_meta is not None:
                atomic_write(self.state_path(name), encode_state(state_meta, state))
            else:
                self.state_path(name).unlink(missing_ok=True)
            atomic_write(self.transcript_path(name), body)
        except OSError as exc:
            raise SessionSaveError(
                f"could not save session '{name}' in {self.root}: {exc.strerror or exc}; "
                "the previous save is intact"
            ) from exc

    def remove(self, name: str) -> None:
        if not self.exists(name):
            raise SessionNotFound(f"no session named '{name}'")
        with self.lock(name):
            self.state_path(name).unlink(missing_ok=True)
            self.transcript_path(name).unlink()
        (self.root / f"{name}.lock").unlink(missing_ok=True)

    def rename(self, old: str, new: str) -> None:
        self._copy_or_move(old, new, move=True)

    def fork(self, src: str, dst: str, *, src_locked: bool = False) -> None:
        """Copies `src` to the new name `dst`; `src_locked` when this process holds src's lock."""
        self._copy_or_move(src, dst, move=False, src_locked=src_locked)

    def _copy_or_move(self, src: str, dst: str, *, move: bool, src_locked: bool = False) -> None:
        validate_name(dst)
        if not self.exists(src):
            raise SessionNotFound(f"no session named '{src}'")
        if self.exists(dst):
            raise SessionExists(f"a session named '{dst}' exists already")
        with ExitStack() as locks:
            if not src_locked:
                locks.enter_context(self.lock(src))
            locks.enter_context(self.lock(dst))
            for path_of in (self.state_path, self.transcript_path):  # transcript last: it marks existence
                source, target = path_of(src), path_of(dst)
                if not source.exists():
                    continue
                if move:
                    os.replace(source, target)
                else:
                    atomic_write(target, source.read_bytes())
            fsync_dir(self.root)
        if move:
            (self.root / f"{src}.lock").unlink(missing_ok=True)

    # ---- listing and disk use ------------------------------------------------------------

    def info(self, name: str) -> SessionInfo:
        record = self.load_transcript(name)
        state = self.state_path(name)
        size = self.transcript_path(name).stat().st_size + (state.stat().st_size if state.exists() else 0)
        messages = record["messages"]
        return SessionInfo(
            name=name,
            model=record["model"].get("name", "?"),
            turns=sum(1 for m in messages if m.get("role") == "assistant"),
            tokens=len(record["tokens"]),
            size_bytes=size,
            updated=record.get("updated", ""),
            has_state=state.exists(),
        )

    def list(self) -> tuple[list[SessionInfo], list[str]]:
        """Every session, most recently used first, and the names of damaged ones."""
        infos, damaged = [], []
        for name in self.names():
            try:
                infos.append(self.info(name))
            except SnapshotError:
                damaged.append(name)
        infos.sort(key=lambda i: i.updated, reverse=True)
        return infos, damaged

    def most_recent(self) -> str | None:
        infos, _ = self.list()
        return infos[0].name if infos else None

    def enforce_budget(self, max_bytes: int, keep: str | None = None) -> list[str]:
        """Drops the state files of the least recently used sessions until the rest fit in
        `max_bytes`. Transcripts stay. Returns the sessions whose state was dropped."""
        if not self.root.is_dir():
            return []
        states = []
        for path in self.root.glob("*.kv"):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            states.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in states)
        dropped = []
        for _, size, path in sorted(states):
            if total <= max_bytes:
                break
            if path.stem == keep:
                continue
            try:
                with self.lock(path.stem, wait_s=0):
                    path.unlink(missing_ok=True)
            except SessionLocked:
                continue
            total -= size
            dropped.append(path.stem)
        return dropped

    def clean_temporaries(self, older_than_s: float = STALE_TEMP_S) -> None:
        """Removes temporary files left by a process killed mid-write: those whose writer is no
        longer running, and any older than `older_than_s`."""
        if not self.root.is_dir():
            return
        now = time.time()
        for path in self.root.glob(".*.tmp-*"):
            match = re.search(r"\.tmp-(\d+)-", path.name)
            try:
                if (match and not _alive(int(match.group(1)))) or now - path.stat().st_mtime > older_than_s:
                    path.unlink()
            except FileNotFoundError:
                pass


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_transcript(record: Any) -> str | None:
    """What is wrong with a transcript, or None."""
    if not isinstance(record, dict):
        return "the transcript is not a JSON object"
    if record.get("format") != TRANSCRIPT_FORMAT:
        return "the transcript is not a quipu session"
    if record.get("version") != TRANSCRIPT_VERSION:
        return f"transcript version {record.get('version')!r} is not one this quipu reads"
    if not isinstance(record.get("model"), dict):
        return "the transcript has no model"
    messages = record.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return "the transcript's messages are not a list of objects"
    tokens = record.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        return "the transcript's tokens are not a list of token ids"
    for key in ("n_decoded", "draws"):
        value = record.get(key)
        if type(value) is not int or value < 0:
            return f"the transcript's {key} is not a count"
    if record["n_decoded"] > len(tokens):
        return "the transcript's n_decoded is past its tokens"
    if not isinstance(record.get("params"), dict) or not isinstance(record.get("context"), dict):
        return "the transcript has no settings"
    return None


def atomic_write(path: Path, data: bytes) -> None:
    """Writes `data` to a temporary file beside `path`, fsyncs it, renames it into place."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
