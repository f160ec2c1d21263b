"""Roles: a system prompt, a model, a prompt and any options of `run` and `chat`, kept under a
name, in the config (`[roles.NAME]`) or a file of their own (`roles/NAME.toml` in the config
folder, which `quipu roles add` writes; a file's role goes before the config's of that name).
`--role NAME` gives a turn the role's values where the command line gives none (the command line
over the role, the role over the config). A role's `prompt` holds the input where `$input`
stands in it (else the input follows it, after a blank line)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quipu.app.environment import Environment
from quipu.app.turn_options import TurnOptions
from quipu.errors import UsageError
from quipu.options import ROLE
from quipu.paths import create_private, private_dir

if TYPE_CHECKING:
    from quipu.app.modes import Mode

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
INPUT = "$input"
@dataclass(frozen=True)
class Role:
    name: str
    values: dict[str, Any]  # what a role may set (`quipu.options.ROLE`), and "prompt"
    source: str  # where it is kept: a file, or the config

    @property
    def prompt(self) -> str | None:
        return self.values.get("prompt")

    def fill(self, text: str | None) -> str | None:
        """The input as the role's prompt holds it (the input alone where it has none)."""
        if self.prompt is None:
            return text
        if INPUT in self.prompt:
            return self.prompt.replace(INPUT, text or "")
        return self.prompt + ("\n\n" + text if text else "")


def roles_dir(env: Environment) -> Path:
    return env.dirs.config / "roles"


def check_name(name: str) -> str:
    if not NAME.fullmatch(name):
        raise UsageError(f"a role's name is letters, digits, '.', '_' and '-' (at most 64, from a letter or digit), "
                         f"not {json.dumps(name)}")
    return name


def check_values(values: dict[str, Any], where: str) -> dict[str, Any]:
    """A role's values, each of its type; an unknown key or a wrong type is one line naming it."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        kind = str if key == "prompt" else ROLE.get(key)
        if kind is None:
            raise UsageError(f"{where}: unknown key '{key}' (known: prompt, {', '.join(ROLE)})")
        if kind is tuple:
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise UsageError(f"{where}: {key} must be a string or a list of strings")
            value = tuple(value)
        elif kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UsageError(f"{where}: {key} must be a number")
            value = float(value)
            if not math.isfinite(value):
                raise UsageError(f"{where}: {key} must be a finite number, not {value}")
        elif kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise UsageError(f"{where}: {key} must be a whole number")
        elif kind is str and key == "ctx":
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise UsageError(f"{where}: ctx must be a number of tokens or \"auto\"")
            value = str(value)
        elif not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise UsageError(f"{where}: {key} must be {'true or false' if kind is bool else 'a string'}")
        out[key] = value
    return out


def load_roles(env: Environment) -> dict[str, Role]:
    """Every role: the config's, and the files' (which go before the config's of a name)."""
    found = {name: Role(name, check_values(values, f"[roles.{name}] in {env.config.path}"), "config")
             for name, values in env.config.roles.items() if NAME.fullmatch(name)}
    folder = roles_dir(env)
    if folder.is_dir():
        for path in sorted(folder.glob("*.toml")):
            if NAME.fullmatch(path.stem):
                found[path.stem] = _read_role(path)
    return found


def _read_role(path: Path) -> Role:
    import tomllib

    from quipu.app.user_files import MAX_FILE_BYTES, read_user_file

    try:  # (through the reader that a stop reaches: a role's file may be a FIFO nobody writes)
        data = read_user_file(path, MAX_FILE_BYTES)
        if len(data) > MAX_FILE_BYTES:
            raise ValueError(f"larger than {MAX_FILE_BYTES >> 20} MB")
        values = tomllib.loads(data.decode("utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, ValueError) as exc:
        raise UsageError(f"{path}: the role cannot be read ({str(exc).split(';')[0]})") from None
    except RecursionError:
        raise UsageError(f"{path}: the role cannot be read (it nests values deeper than quipu reads)") from None
    return Role(path.stem, check_values(values, str(path)), str(path))


def role(env: Environment, name: str) -> Role:
    """The role `name`: its file's, else the config's (another role's file that cannot be read
    does not stand in its way)."""
    path = roles_dir(env) / f"{check_name(name)}.toml"
    if path.is_file():
        return _read_role(path)
    values = env.config.roles.get(name)
    if values is None:
        raise UsageError(f"no role '{name}' (`quipu roles list` lists them; `quipu roles add` makes one)")
    return Role(name, check_values(values, f"[roles.{name}] in {env.config.path}"), "config")


def with_role(opts: TurnOptions, name: str, env: Environment,
              mode: "Mode | None" = None) -> tuple[TurnOptions, Role]:
    """The options with the values of the role `name` (`--role`) where the command line gave
    none; an option of the role that the command's mode (the options' own by default) refuses is
    said in one line."""
    from quipu.app.modes import asked_of, check_options, mode_of

    found = role(env, name)
    values = {k: v for k, v in found.values.items() if k != "prompt"}
    unset = {f.name: f.default for f in dataclasses.fields(TurnOptions)}
    try:
        own = TurnOptions.of_command_line(values)
        merged = dataclasses.replace(opts, sampling={**own.sampling, **opts.sampling},
                                     **{k: getattr(own, k) for k in values if k in unset and getattr(opts, k) == unset[k]})
        check_options(asked_of(own.given), mode or mode_of(merged.given))
    except UsageError as exc:
        raise UsageError(f"role '{found.name}' ({found.source}): {exc}") from None
    return merged, found


def add_role(env: Environment, name: str, values: dict[str, Any], *, replace: bool = False) -> Path:
    """Writes the role `name` to its own file (0600); refused where it is there already, unless
    `replace`."""
    check_name(name)
    values = check_values(values, f"role '{name}'")
    if not values:
        raise UsageError("a role holds at least one of --system, --prompt, -m or an option")
    path = private_dir(roles_dir(env)) / f"{name}.toml"
    if path.exists() and not replace:
        raise UsageError(f"role '{name}' is there already ({path}); --replace writes it again")
    temporary = path.with_name(f".{name}.toml.{os.getpid()}")
    fd = create_private(temporary)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write("".join(f"{k} = {_toml(v)}\n" for k, v in values.items()))
    os.replace(temporary, path)
    return path


def remove_role(env: Environment, name: str) -> None:
    """Removes the role's file (one that cannot be read too)."""
    path = roles_dir(env) / f"{check_name(name)}.toml"
    if path.is_file():
        path.unlink()
        return
    if name in env.config.roles:
        raise UsageError(f"role '{name}' is in the config file ({env.config.path}): remove its [roles.{name}] there")
    raise UsageError(f"no role '{name}' (`quipu roles list` lists them; `quipu roles add` makes one)")


def _toml(value: Any) -> str:
    """A TOML value: JSON's spelling of strings is TOML's basic string (but that TOML escapes
    DEL too), and of lists of them an array; numbers are finite (`check_values`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
