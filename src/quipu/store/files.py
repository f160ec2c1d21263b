"""Files written safely: atomically (a temporary beside the target, fsynced, renamed), locked
(flock, waited for), copied (a reflink where the file system makes one), and what a killed
writer left behind cleaned away; the store's files and every other file quipu keeps use these."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from quipu.paths import create_private

STALE_TEMP_S = 3600.0


def oldest_first(paths: Iterable[Path]) -> tuple[list[tuple[int, Path]], int]:
    """(size, path) of the files that still exist, least recently written first, and their total."""
    found = []
    for path in paths:
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        found.append((st.st_mtime, st.st_size, path))
    found.sort()
    return [(size, path) for _, size, path in found], sum(size for _, size, _ in found)


def clean_temporaries(root: Path, older_than_s: float = STALE_TEMP_S) -> None:
    """Removes temporary files left in `root` by a process killed mid-write: those whose writer
    is no longer running, and any older than `older_than_s`."""
    if not root.is_dir():
        return
    now = time.time()
    for path in root.glob(".*.tmp-*"):
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


def flock_until(fd: int, deadline: float) -> bool:
    """Takes an exclusive flock on `fd`, polling until `deadline` (`math.inf`: for as long as it
    takes, a Ctrl-C ending the wait); False if it never came free."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


@contextmanager
def _replacing(path: Path) -> Iterator[Path]:
    """A temporary file beside `path` to write, renamed into place (the folder fsynced) when the
    block ends well, removed when it does not."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write(path: Path, data: bytes | memoryview | Sequence[bytes | memoryview]) -> None:
    """Writes `data` (or its pieces, one after another) to a temporary file beside `path`, fsyncs
    it, renames it into place."""
    chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
    with _replacing(path) as tmp:
        fd = create_private(tmp)
        try:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_copy(source: Path, target: Path) -> None:
    """Copies a file as `atomic_write` writes one, the kernel moving the bytes (a reflink where
    the file system shares blocks, else copy_file_range or sendfile): nothing of it passes
    through this process's memory."""
    with _replacing(target) as tmp, open(source, "rb") as src, \
            open(create_private(tmp), "wb") as dst:
        if not _reflink(src.fileno(), dst.fileno()):
            size = os.fstat(src.fileno()).st_size
            done = 0
            while done < size:
                try:
                    moved = os.copy_file_range(src.fileno(), dst.fileno(), size - done)
                except OSError as exc:
                    if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    moved = os.sendfile(dst.fileno(), src.fileno(), done, size - done)
                if moved == 0:
                    break
                done += moved
        os.fsync(dst.fileno())


def _reflink(src: int, dst: int) -> bool:
    """Shares the source's blocks with the target (FICLONE: btrfs, XFS, ...); False where the
    file system cannot."""
    try:
        fcntl.ioctl(dst, 0x40049409, src)  # FICLONE
        return True
    except OSError:
        return False


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


def lone_surrogate(value: Any) -> bool:
    """Whether parsed JSON holds a text with a lone half of a UTF-16 pair (`"\\ud800"`, which
    JSON allows and no tokenizer can take), in a key or a value at any depth."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(lone_surrogate(k) or lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(lone_surrogate(item) for item in value)
    return False
