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
MODEL_KEYS = {"huggingface": str, "lmstudio": str, "ollama": str}
TABLES = {"generation": GENERATION_KEYS, "sessions": SESSION_KEYS, "models": MODEL_KEYS}


class ConfigError(UsageError):
    """The config file cannot be read or holds a bad value."""


@dataclass
class Config:
    path: Path | None = None
    model: str | None = None
    system: str | None = None
    generation: dict[str, Any] = field(default_factory=dict)
    sessions: dict[str, Any] = field(default_factory=dict)
    models: dict[str, str] = field(default_factory=dict)


def load_config(path: Path) -> Config:
    """Read and check `path`; a missing file is an empty config. Errors name the file and line."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return Config()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror}") from exc
    try:
        text = raw.decode("utf-8")
        doc = tomllib.loads(text)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: the config file is not UTF-8 text") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from exc

    def fail(key: str, message: str, table: str | None = None) -> ConfigError:
        return ConfigError(f"{path}, line {_line_of(text, key, table)}: {message}")

    config = Config(path=path)
    for key, value in doc.items():
        if key in ("model", "system"):
            if not isinstance(value, str):
                raise fail(key, f"'{key}' must be a string")
            setattr(config, key, value)
        elif key in TABLES:
            allowed = TABLES[key]
            if not isinstance(value, dict):
                raise fail(key, f"[{key}] must be a table")
            for sub, subvalue in value.items():
                if sub not in allowed:
                    raise fail(sub, f"unknown key '{sub}' in [{key}] (known: {', '.join(sorted(allowed))})", key)
                kind = allowed[sub]
                if kind is str:
                    if not isinstance(subvalue, str):
                        raise fail(sub, f"[{key}] {sub} must be a string", key)
                elif isinstance(subvalue, bool) or not isinstance(subvalue, (int, float)) or (
                    kind is int and not isinstance(subvalue, int)
                ):
                    raise fail(sub, f"[{key}] {sub} must be {'an integer' if kind is int else 'a number'}", key)
                getattr(config, key)[sub] = kind(subvalue)
        else:
            raise fail(key, f"unknown key '{key}' (known: model, system, [{'], ['.join(TABLES)}])")
    _check_values(config, fail)
    return config


def _check_values(config: Config, fail) -> None:
    from quipu.errors import InvalidParameter
    from quipu.sessions.params import SamplingParams

    gen = config.generation
    try:
        SamplingParams().replace(**{k: v for k, v in gen.items() if k in SamplingParams.__dataclass_fields__})
    except InvalidParameter as exc:
        key = str(exc).split(" ", 1)[0].replace("-", "_")
        raise fail(key, str(exc), "generation") from None
    for key in ("max_tokens", "ctx", "threads"):
        if key in gen and gen[key] <= 0:
            raise fail(key, f"{key} must be more than 0, got {gen[key]}", "generation")
    if config.sessions.get("max_state_bytes", 0) < 0:
        raise fail("max_state_bytes", "max_state_bytes must be 0 or more", "sessions")


def _line_of(text: str, key: str, table: str | None) -> int:
    """The line where `key` is set (inside [table] when given); 1 when it cannot be found."""
    import re

    current = None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        header = re.match(r"\[\s*([^\]]+?)\s*\]", stripped)
        if header:
            current = header.group(1)
            if table is None and current == key:
                return number
            continue
        if re.match(rf"{re.escape(key)}\s*=", stripped) and (table is None or current == table):
            return number
        if table and re.match(rf"{re.escape(table)}\.{re.escape(key)}\s*=", stripped):
            return number
    return 1
