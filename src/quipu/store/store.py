"""SessionStore: named sessions on disk, written atomically, one writer at a time.

Each session NAME is these files in the sessions folder:

- `NAME.json`, the transcript (see transcript.py): messages, settings, seed, model
  fingerprint, the exact context token history. It is the truth, readable, and never deleted
  to save space.
- `NAME.kv`, the state file (see statefile.py): a cache of the context that makes resuming
  instant. It may be missing, stale or damaged; the transcript then rebuilds it.
- `NAME.kvlog`, the state log: the pieces of the context later turns added to it, after the
  state file, each checksummed. A piece that does not follow on from the state file, or is cut
  short or damaged, ends what the log gives; the transcript rebuilds the rest.
- `NAME.kvr0`, `NAME.kvr1`: a hybrid or recurrent model's recurrent state, kept apart from the
  cells (statefile.py's layout, each written whole and atomically): the state where the last
  save ended, and the one before (where the last turn's prompt began).

`NAME.lock` is held (flock) by whichever process is working on the session. A lock file is
only ever removed by its holder, and a waiter that wins a lock checks that the file it locked
is still the one at the path (see `lock`), so two processes never both hold "the" lock.
"""

from __future__ import annotations

import builtins
import os
import re
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
from quipu.paths import open_private, private_dir
from quipu.store.files import (STALE_TEMP_S, atomic_copy, atomic_write, clean_temporaries, flock_until, fsync_dir,
                               oldest_first, same_file)
from quipu.store.statefile import StateBlob, append_record, read_log, read_meta, read_state, state_chunks
from quipu.store.transcript import Transcript, TranscriptError

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
KEEP_STATE = object()  # `save(..., state=KEEP_STATE)`: the state file on disk is still current
LOCK_WAIT_S = 3.0
DEFAULT_MAX_STATE_BYTES = 4 << 30
RECURRENT_SLOTS = 2  # the recurrent states a session keeps on disk


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
    saved_ns: int = 0  # when the transcript was last written, for ordering

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "saved_ns"}


MEDIA_FOLDER = "media"  # beside the sessions: the images and recordings they hold (`media.py`)


class SessionStore:
    def __init__(self, root: Path):
        self.root = Path(root)

    # ---- paths ---------------------------------------------------------------------------

    def transcript_path(self, name: str) -> Path:
        return self.root / f"{validate_name(name)}.json"

    def state_path(self, name: str) -> Path:
        return self.root / f"{validate_name(name)}.kv"

    def log_path(self, name: str) -> Path:
        return self.root / f"{validate_name(name)}.kvlog"

    def recurrent_paths(self, name: str) -> list[Path]:
        return [self.root / f"{validate_name(name)}.kvr{slot}" for slot in range(RECURRENT_SLOTS)]

    def _state_paths(self, name: str) -> list[Path]:
        """The files of a session's saved context state."""
        return [self.state_path(name), self.log_path(name), *self.recurrent_paths(name)]

    def exists(self, name: str) -> bool:
        return self.transcript_path(name).exists()

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.stem for p in self.root.glob("*.json") if NAME_RE.fullmatch(p.stem))

    # ---- locking -------------------------------------------------------------------------

    def lock_path(self, name: str) -> Path:
        return self.root / f"{validate_name(name)}.lock"

    @contextmanager
    def lock(self, name: str, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
        """Holds the session's lock; waits up to `wait_s`, then fails with a clear message."""
        private_dir(self.root, levels=2)  # (the sessions folder, and quipu's data folder it is in)
        path = self.lock_path(name)
        deadline = time.monotonic() + wait_s
        while True:
            fd = open_private(path, os.O_RDWR)
            try:
                got = flock_until(fd, deadline)
                # The holder may have removed the file (rm, rename) while we waited: then we hold
                # a lock on a file nobody else will ever open. Start again on the one at the path.
                if got and same_file(fd, path):
                    break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
            if not got:
                raise SessionLocked(f"session '{name}' is in use by another quipu process; try again when it is done")
        try:
            yield
        finally:
            if not self.exists(name) and same_file(fd, path):
                # A session that was never made (or was removed) leaves no lock file behind; a
                # waiter on this file sees it is gone and locks the one at the path instead. (Only
                # while the path is still this file: once a removal unlinked it, the file at the
                # path is another process's, which it may hold.)
                path.unlink(missing_ok=True)
            os.close(fd)

    # ---- reading -------------------------------------------------------------------------

    def load_transcript(self, name: str) -> Transcript:
        path = self.transcript_path(name)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise SessionNotFound(f"no session named '{name}' (see `quipu sessions list`)") from None
        except OSError as exc:
            raise SnapshotError(f"session '{name}' cannot be read: {exc.strerror}") from None
        try:
            return Transcript.decode(raw)
        except TranscriptError as exc:
            raise SnapshotError(f"session '{name}' is damaged: {exc}; {path} was left as it is") from None

    def has_state(self, name: str) -> bool:
        return self.state_path(name).exists()

    def load_state(self, name: str) -> tuple[StateBlob | None, str | None]:
        """(the verified state, None) or (None, why there is none usable)."""
        path = self.state_path(name)
        try:
            return read_state(path), None
        except FileNotFoundError:
            return None, "no saved context state"
        except OSError as exc:
            return None, f"the state file cannot be read ({exc.strerror})"
        except SnapshotError as exc:
            return None, str(exc)

    def load_pieces(self, name: str) -> tuple[list[tuple[StateBlob, int]], int, str | None]:
        """The verified pieces of the state log, in order, each with the byte it ends at; the
        bytes they fill; what is wrong after them."""
        try:
            return read_log(self.log_path(name))
        except OSError as exc:
            return [], 0, f"the state log cannot be read ({exc.strerror})"

    def load_recurrent(self, name: str) -> tuple[builtins.list[StateBlob], str | None]:
        """The verified recurrent states; what was wrong with one that was there, if any (a
        damaged one is left out)."""
        found, wrong = [], None
        for path in self.recurrent_paths(name):
            try:
                found.append(read_state(path))
            except FileNotFoundError:
                continue
            except OSError as exc:
                wrong = f"a saved recurrent state cannot be read ({exc.strerror})"
            except SnapshotError as exc:
                wrong = f"a saved recurrent state is damaged ({exc})"
        return found, wrong

    def recurrent_metas(self, name: str) -> builtins.list[dict[str, Any] | None]:
        """Each recurrent state file's metadata, read without its state (None: none readable)."""
        metas: builtins.list[dict[str, Any] | None] = []
        for path in self.recurrent_paths(name):
            try:
                metas.append(read_meta(path))
            except (OSError, SnapshotError):
                metas.append(None)
        return metas

    # ---- writing -------------------------------------------------------------------------

    @contextmanager
    def _writing(self, name: str) -> Iterator[None]:
        """The sessions folder made; a failed write (disk full, a read-only folder) one clear
        error, the previous save as it was."""
        try:
            private_dir(self.root, levels=2)  # (the sessions folder, and quipu's data folder it is in)
            yield
        except OSError as exc:
            raise SessionSaveError(
                f"could not save session '{name}' in {self.root}: {exc.strerror or exc}; "
                "the previous save is intact"
            ) from exc

    def _replace_state(self, name: str, state: bytes | memoryview, meta: dict[str, Any]) -> None:
        atomic_write(self.state_path(name), state_chunks(meta, state))
        self.log_path(name).unlink(missing_ok=True)  # (its pieces followed the old state)

    def write_state(self, name: str, state: bytes | memoryview, meta: dict[str, Any]) -> None:
        """Writes the state file whole, atomically (the log after the old one goes); the
        transcript is the caller's to write (see `save`)."""
        with self._writing(name):
            self._replace_state(name, state, meta)

    def append_piece(self, name: str, meta: dict[str, Any], state: bytes | memoryview, at: int) -> int:
        """Adds a piece to the state log at byte `at` (a piece cut short after it goes); returns
        the log's length. The transcript is saved after it (see `save`)."""
        with self._writing(name):
            return append_record(self.log_path(name), meta, state, at)

    def write_recurrent(self, name: str, slot: int, state: bytes | memoryview, meta: dict[str, Any]) -> None:
        """Writes a recurrent state into `slot`, whole and atomically (the other slot's stays)."""
        with self._writing(name):
            atomic_write(self.recurrent_paths(name)[slot], state_chunks(meta, state))

    def save(self, name: str, transcript: Transcript, state: bytes | object | None,
             state_meta: dict[str, Any] | None = None) -> None:
        """Writes the state file (or removes a stale one, or keeps it with KEEP_STATE), then the
        transcript, each atomically. A failed write (disk full, read-only folder) leaves the
        previous save as it was."""
        with self._writing(name):
            if isinstance(state, (bytes, memoryview)) and state_meta is not None:
                self._replace_state(name, state, state_meta)
            elif state is not KEEP_STATE:
                for path in self._state_paths(name):
                    path.unlink(missing_ok=True)
            atomic_write(self.transcript_path(name), transcript.encode())

    def remove(self, name: str) -> None:
        if not self.exists(name):
            raise SessionNotFound(f"no session named '{name}'")
        with self.lock(name):
            self.drop_locked(name)

    def drop_locked(self, name: str) -> None:
        """Removes a session whose lock the caller holds."""
        for path in self._state_paths(name):
            path.unlink(missing_ok=True)
        self.transcript_path(name).unlink(missing_ok=True)
        self.lock_path(name).unlink(missing_ok=True)  # while held: see `lock`

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
            # (the transcript last: it marks existence)
            for source, target in zip(self._state_paths(src) + [self.transcript_path(src)],
                                      self._state_paths(dst) + [self.transcript_path(dst)], strict=True):
                if not source.exists():
                    continue
                if move:
                    os.replace(source, target)
                else:
                    atomic_copy(source, target)
            if move:
                self.lock_path(src).unlink(missing_ok=True)  # while held: see `lock`
            fsync_dir(self.root)

    # ---- listing and disk use ------------------------------------------------------------

    def info(self, name: str) -> SessionInfo:
        record = self.load_transcript(name)
        state = self.state_path(name)
        transcript_stat = self.transcript_path(name).stat()
        state_size = state.stat().st_size if state.exists() else None
        others = sum(path.stat().st_size for path in self._state_paths(name)[1:] if path.exists())
        return SessionInfo(
            name=name,
            model=str(record.model.get("name", "?")),
            turns=record.turns,
            tokens=len(record.tokens),
            size_bytes=transcript_stat.st_size + (state_size or 0) + others,  # (its log and recurrent states too)
            updated=record.updated,
            has_state=state_size is not None,
            saved_ns=transcript_stat.st_mtime_ns,
        )

    def list(self) -> tuple[list[SessionInfo], list[str]]:
        """Every session, most recently used first, and the names of damaged ones."""
        infos, damaged = [], []
        for name in self.names():
            try:
                infos.append(self.info(name))
            except (SnapshotError, FileNotFoundError):
                damaged.append(name)
        # `updated` is to the second; the transcript's write time orders saves within one.
        infos.sort(key=lambda i: (i.updated, i.saved_ns), reverse=True)
        return infos, damaged

    def enforce_budget(self, max_bytes: int, keep: str | None = None) -> builtins.list[str]:
        """Drops the saved context states of the least recently used sessions (by the last write
        of any of a state's files) until the rest fit in `max_bytes`. Transcripts stay. Returns
        the sessions whose state was dropped."""
        if not self.root.is_dir():
            return []
        sessions: dict[str, tuple[int, int]] = {}  # (each state's size in all, its last write)
        for pattern in ("*.kv", "*.kvlog", "*.kvr[0-9]"):
            for path in self.root.glob(pattern):
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue
                size, last = sessions.get(path.stem, (0, 0))
                sessions[path.stem] = (size + st.st_size, max(last, st.st_mtime_ns))
        total = sum(size for size, _ in sessions.values())
        total += oldest_first((self.root / MEDIA_FOLDER).glob("*"))[1]  # (the sessions' media count too)
        dropped = []
        for name, (size, _) in sorted(sessions.items(), key=lambda item: item[1][1]):
            if total <= max_bytes:
                break
            if name == keep or not NAME_RE.fullmatch(name):
                continue
            try:
                with self.lock(name, wait_s=0):
                    for part in self._state_paths(name):
                        part.unlink(missing_ok=True)
            except SessionLocked:
                continue
            total -= size
            dropped.append(name)
        return dropped

    def clean_temporaries(self, older_than_s: float = STALE_TEMP_S) -> None:
        clean_temporaries(self.root, older_than_s)
