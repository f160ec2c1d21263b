"""Where quipu reads and writes: one function, one environment override (QUIPU_HOME); and how:
what a user said stays readable by that user alone. Every folder quipu makes for a user's
conversations, cache and history is 0700 and every file in it 0600, whatever the umask (as
`~/.bash_history` and ssh's keys are kept). Files are created private before data goes in, never
chmod-ed afterwards; a wider file or folder left by an older version is narrowed when quipu next
writes there."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping


@dataclass(frozen=True)
class Dirs:
    data: Path
    config: Path
    state: Path
    cache: Path

    @property
    def sessions(self) -> Path:
        return self.data / "sessions"

    @property
    def models(self) -> Path:
        return self.data / "models"

    @property
    def prompt_cache(self) -> Path:
        return self.cache / "prompts"

    @property
    def checked_projectors(self) -> Path:
        """A mark for each projector that encoded a first medium apart (`engine/projector_check.py`)."""
        return self.cache / "projectors"

    @property
    def config_file(self) -> Path:
        return self.config / "config.toml"


def dirs(environ: Mapping[str, str] | None = None) -> Dirs:
    """The directories for this environment: `$QUIPU_HOME/{data,config,state,cache}` or platformdirs'."""
    environ = os.environ if environ is None else environ
    home = environ.get("QUIPU_HOME")
    if home:
        root = Path(home).expanduser().absolute()  # a relative one means where quipu was started, once
        return Dirs(root / "data", root / "config", root / "state", root / "cache")
    import platformdirs

    return Dirs(
        Path(platformdirs.user_data_dir("quipu")),
        Path(platformdirs.user_config_dir("quipu")),
        Path(platformdirs.user_state_dir("quipu")),
        Path(platformdirs.user_cache_dir("quipu")),
    )


# ---- private files and folders ----------------------------------------------------------------

FILE_MODE = 0o600
DIR_MODE = 0o700


def private_dir(path: Path, levels: int = 1) -> Path:
    """`path`, made with its missing parents at 0700 (the umask can only take bits away, so the
    mode is set as well); it and the `levels - 1` folders above it, quipu's own, narrowed to
    their owner when they are there already."""
    missing = []
    at = path
    while not at.exists():
        missing.append(at)
        if at.parent == at:
            break
        at = at.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, DIR_MODE)
        except FileExistsError:
            pass
        os.chmod(folder, DIR_MODE)
    for folder in [path, *path.parents][:levels]:
        narrow(folder)
    return path


def narrow(path: Path) -> None:
    """A folder kept to its owner: group's and others' bits removed."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        os.chmod(path, mode & 0o700)


def open_private(path: Path, flags: int) -> int:
    """`os.open` of a file that is 0600 once open (made so whatever the umask, before any data
    goes in, and narrowed when it was there already with a wider mode)."""
    fd = os.open(path, flags | os.O_CREAT, FILE_MODE)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != FILE_MODE:
            os.fchmod(fd, FILE_MODE)  # (a umask that took the owner's bits away, or an older wide file)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_private(path: Path) -> int:
    """A new file (`O_EXCL`) for writing, 0600 whatever the umask, before any data goes in."""
    return open_private(path, os.O_WRONLY | os.O_EXCL)


def shared_with_others(path: Path) -> bool:
    """Whether another account may read or enter `path`."""
    try:
        return bool(stat.S_IMODE(os.stat(path).st_mode) & 0o077)
    except OSError:
        return False
