"""Where quipu reads and writes: one function, one environment override (QUIPU_HOME)."""

from __future__ import annotations

import os
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
