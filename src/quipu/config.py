"""The user's config file (`config.toml` in the config dir): defaults they never want to type again."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quipu.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

GENERATION_KEYS = {
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "repeat_penalty": float,
    "max_tokens": int,
    "ctx": int,
    "threads": int,
    "seed": int,
}
SESSION_KEYS = {"max_state_bytes": int}


class ConfigError(UsageError):
    """The config file cannot be read or holds a bad value."""


@dataclass
class Config:
    path: Path | None = None
    model: str | None = None
    system: str | None = None
    generation: dict[str, Any] = field(default_factory=dict)
    sessions: dict[str, Any] = field(default_factory=dict)


def load_config(path: Path) -> Config:
    """Read and check `path`; a missing file is an empty config."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return Config()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror}") from exc
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: the config file is not UTF-8 text") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    config = Config(path=path)
    for key, value in doc.items():
        if key in ("model", "system"):
            if not isinstance(value, str):
                raise ConfigError(f"{path}: '{key}' must be a string")
            setattr(config, key, value)
        elif key in ("generation", "sessions"):
            allowed = GENERATION_KEYS if key == "generation" else SESSION_KEYS
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: [{key}] must be a table")
            for sub, subvalue in value.items():
                if sub not in allowed:
                    raise ConfigError(
                        f"{path}: unknown key '{sub}' in [{key}] (known: {', '.join(sorted(allowed))})"
                    )
                kind = allowed[sub]
                if isinstance(subvalue, bool) or not isinstance(subvalue, (int, float)) or (
                    kind is int and not isinstance(subvalue, int)
                ):
                    raise ConfigError(f"{path}: [{key}] {sub} must be {'an integer' if kind is int else 'a number'}")
                getattr(config, key)[sub] = kind(subvalue)
        else:
            raise ConfigError(f"{path}: unknown key '{key}' (known: model, system, [generation], [sessions])")
    return config
