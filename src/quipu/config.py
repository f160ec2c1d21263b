"""The user's config file (`config.toml` in the config dir): defaults they never want to type again.

This module reads TOML and checks the shape and types of what it holds; what the values must
be (a temperature of 0 or more, ...) is checked by `quipu.app.environment`, which knows the
settings, and reported here with the file and line (`Config.error`)."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from quipu.errors import UsageError
from quipu.options import SERVE


MAX_CONFIG_BYTES = 4 << 20  # (a config file is a few lines)
SESSION_KEYS = {"max_state_bytes": int}
CACHE_KEYS = {"max_bytes": int}
LOGS_KEYS = {"enabled": bool, "max_records": int, "max_days": float}
MODEL_KEYS = {"huggingface": str, "lmstudio": str, "ollama": str}
REMOTE_KEYS = {"url": str, "api_key_env": str, "model": str, "timeout": float}
CHAT_KEYS = {"markdown": bool, "compact_prompt": str, "compact_keep": int}
SERVE_KEYS = dict(SERVE)  # (the registry's: quipu/options.py)


class ConfigError(UsageError):
    """The config file cannot be read or holds a bad value."""


@dataclass(frozen=True)
class Config:
    path: Path | None = None
    model: str | None = None
    system: str | None = None
    generation: dict[str, Any] = field(default_factory=dict)
    sessions: dict[str, Any] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)
    logs: dict[str, Any] = field(default_factory=dict)  # [logs]: enabled, max_records, max_days
    models: dict[str, str] = field(default_factory=dict)
    remote: dict[str, str] = field(default_factory=dict)
    serve: dict[str, Any] = field(default_factory=dict)  # [serve]: what `quipu serve`'s command line does not give
    chat: dict[str, Any] = field(default_factory=dict)  # [chat]: how `quipu chat` shows replies
    mcp: dict[str, dict[str, Any]] = field(default_factory=dict)  # [mcp.NAME]: command, args, env, timeout
    roles: dict[str, dict[str, Any]] = field(default_factory=dict)  # [roles.NAME]: system, model, prompt, options
    text: str = ""
    warnings: list[str] = field(default_factory=list)  # for the front end to say

    def error(self, key: str, message: str, table: str | None = None) -> ConfigError:
        """An error about `key` (in [table]) that names the file and the line where it is set."""
        return ConfigError(f"{self.path}, line {_line_of(self.text, key, table)}: {message}")


def load_config(path: Path, generation_keys: dict[str, type]) -> Config:
    """Read `path` and check its shape, with `generation_keys` the names and types [generation]
    may hold; a missing file is an empty config. Errors name the file and line."""
    tables: dict[str, dict[str, Any]] = {"generation": generation_keys, "sessions": SESSION_KEYS, "models": MODEL_KEYS, "cache": CACHE_KEYS,
              "logs": LOGS_KEYS, "remote": REMOTE_KEYS, "serve": SERVE_KEYS,
              "chat": CHAT_KEYS}
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        return Config()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror}") from exc
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: the config file is larger than {MAX_CONFIG_BYTES >> 20} MB")
    import tomllib  # (only when there is a file: 3 ms of a plain run's start without one)

    try:
        text = raw.decode("utf-8")
        doc = tomllib.loads(text)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: the config file is not UTF-8 text") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    except ValueError as exc:  # (a number of thousands of digits: Python's limit on reading one)
        raise ConfigError(f"{path}: a number in it is too long to read ({str(exc).split(';')[0]})") from exc
    except RecursionError:
        raise ConfigError(f"{path}: it nests values deeper than quipu reads (arrays or tables in one another)") from None

    fail = Config(path=path, text=text).error  # (an error names the file and the line)
    found: dict[str, Any] = {}
    for key, value in doc.items():
        if key in ("model", "system"):
            if not isinstance(value, str):
                raise fail(key, f"'{key}' must be a string")
            found[key] = value
        elif key == "roles":
            if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
                raise fail(key, "[roles] holds one table a role: [roles.NAME] with system, model, prompt and options")
            found["roles"] = dict(value)  # (each checked where roles are read: app/roles.py)
        elif key == "mcp":
            if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
                raise fail(key, "[mcp] holds one table a server: [mcp.NAME] with command, args and env")
            found["mcp"] = {name: check_mcp_server(server, functools.partial(fail, name, table="mcp"), f"[mcp.{name}]")
                            for name, server in value.items()}
        elif key in tables:
            allowed = tables[key]
            if not isinstance(value, dict):
                raise fail(key, f"[{key}] must be a table")
            read: dict[str, Any] = found.setdefault(key, {})
            for sub, subvalue in value.items():
                if sub not in allowed:
                    raise fail(sub, f"unknown key '{sub}' in [{key}] (known: {', '.join(sorted(allowed))})", key)
                kind = allowed[sub]
                if kind is tuple:  # one text or a list of them
                    texts = [subvalue] if isinstance(subvalue, str) else subvalue
                    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                        raise fail(sub, f"[{key}] {sub} must be a string or a list of strings", key)
                    subvalue = texts
                elif kind is str:
                    if not isinstance(subvalue, str):
                        raise fail(sub, f"[{key}] {sub} must be a string", key)
                elif kind is bool:
                    if not isinstance(subvalue, bool):
                        raise fail(sub, f"[{key}] {sub} must be true or false", key)
                elif kind is object:  # a word or a whole number (gpu_layers = 20, or "auto")
                    if isinstance(subvalue, bool) or not isinstance(subvalue, (str, int)):
                        raise fail(sub, f"[{key}] {sub} must be a string or a whole number", key)
                    kind = type(subvalue)
                elif isinstance(subvalue, bool) or not isinstance(subvalue, (int, float)) or (
                    kind is int and not isinstance(subvalue, int)
                ):
                    raise fail(sub, f"[{key}] {sub} must be {'an integer' if kind is int else 'a number'}", key)
                read[sub] = kind(subvalue)
        else:
            home = [name for name, keys in tables.items() if key in keys]
            if home:  # (a key of a table, written outside it)
                raise fail(key, f"'{key}' goes in a table: [{home[0]}] then {key} = ... under it")
            raise fail(key, f"unknown key '{key}' (known: model, system, [{'], ['.join(tables)}], [mcp.NAME], [roles.NAME])")
    warnings = [f"the config file {path} holds a token or key and other accounts can read it; `chmod 600 {path}` "
                "keeps it to you"] if _readable_by_others(path) and _holds_secret(doc) else []
    return Config(path=path, text=text, warnings=warnings, **found)


SECRET_NAME = re.compile(r"(?i)token|secret|password|passwd|api_?key|credential|auth")


def _holds_secret(value: Any, name: str = "") -> bool:
    """Whether a config's values look like a credential: set under a name that says so."""
    if isinstance(value, dict):
        return any(_holds_secret(v, str(k)) for k, v in value.items())
    if isinstance(value, list):
        return False  # (names, as env_pass lists them: no value of their own)
    return isinstance(value, str) and bool(value) and bool(SECRET_NAME.search(name))


def _readable_by_others(path: Path) -> bool:
    import stat

    try:
        return bool(stat.S_IMODE(path.stat().st_mode) & 0o044)
    except OSError:
        return False


MCP_KEYS = ("command", "args", "env", "env_pass", "timeout", "prefix")


def check_mcp_server(server: dict[str, Any], fail: Callable[[str], Exception], where: str) -> dict[str, Any]:
    """An MCP server's definition (`command`, `args`, `env`, `env_pass`: the names of variables of
    quipu's own environment the server is given, `timeout`, and `prefix`: what its tools' names
    begin with, `NAME_` by default), checked; `fail(message)` makes the error."""
    import re

    unknown = sorted(set(server) - set(MCP_KEYS))
    if unknown:
        raise fail(f"unknown key '{unknown[0]}' in {where} (known: {', '.join(MCP_KEYS)})")
    if not isinstance(server.get("command"), str) or not server["command"]:
        raise fail(f"{where} needs a command (a string)")
    args = server.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise fail(f"{where} args must be a list of strings")
    env = server.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise fail(f"{where} env must be a table of strings")
    passed = server.get("env_pass", [])
    if not isinstance(passed, list) or not all(isinstance(n, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n)
                                              for n in passed):
        raise fail(f"{where} env_pass must be a list of environment variables' names")
    timeout = server.get("timeout", 60)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise fail(f"{where} timeout must be a number of seconds, more than 0")
    prefix = server.get("prefix")
    if prefix is not None and (not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z0-9_.-]*", prefix)):
        raise fail(f"{where} prefix must be letters, digits, '_', '.' or '-' (\"\" for the tools' own names)")
    return {"command": server["command"], "args": list(args), "env": dict(env), "env_pass": list(passed),
            "timeout": float(timeout), "prefix": prefix}


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
