"""Options as plain data, and a parser for `quipu run` that needs no Typer.

A whole `quipu run` is a short process, and Typer (with the pydantic it coerces every value
through) costs about a fifth of it. So the options of `run` and `chat` are declared as data
(the registry, `quipu/options.py`, read here): `options.py` turns them into Typer parameters
(help, completion, errors), and `parse` reads a plain, well-formed `quipu run` command line
from the same declarations. `parse` answers None for anything it is not sure of (help, a value that needs converting
beyond plain digits, an unknown option, `--`), and the command line then goes to Typer,
which gives the answer or the error message it always gave.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from quipu.options import OPTIONS, Option, group

if TYPE_CHECKING:
    from quipu.app.environment import Environment
    from quipu.app.modes import Mode
    from quipu.app.roles import Role
    from quipu.app.turn_options import TurnOptions


def complete_model(incomplete: str) -> list[str]:
    from quipu.cli.completion import complete_models

    return complete_models(incomplete)


def complete_session(incomplete: str) -> list[str]:
    from quipu.cli.completion import complete_sessions

    return complete_sessions(incomplete)


@dataclass(frozen=True)
class Opt:
    """One option: its spellings (a `--x/--no-x` pair for an on/off switch), the type of its
    value (`bool` for a flag), and whether it may be given more than once."""

    decls: tuple[str, ...]
    type: type
    help: str
    multiple: bool = False
    complete: Optional[Callable[[str], list[str]]] = None
    metavar: str | None = None  # what help shows for the value (default: by its type)

    @property
    def shown(self) -> str:
        """The value's name in help: N for a whole number, NUMBER, TEXT, or the declared one."""
        return self.metavar or {int: "N", float: "NUMBER"}.get(self.type, "TEXT")

    @property
    def default(self) -> list[str] | bool | None:
        if self.multiple:
            return []
        return False if self.type is bool and not self.switch else None

    @property
    def switch(self) -> bool:
        return any("/" in d for d in self.decls)


@dataclass(frozen=True)
class Arg:
    """The one positional argument of a command, optional."""

    help: str


def complete_role(incomplete: str) -> list[str]:
    from quipu.cli.completion import complete_roles

    return complete_roles(incomplete)


COMPLETE = {"model": complete_model, "session": complete_session, "role": complete_role}


def declared(option: Option) -> Opt:
    """An option of the registry (`quipu.options`) as the command line declares it."""
    return Opt(option.flags, option.kind, option.help, option.multiple,
               COMPLETE[option.complete] if option.complete else None, option.metavar)


# Every option of `run` and `chat` that has a spelling, by its parameter's name; the prompt.
OPTS: dict[str, Opt] = {name: declared(option) for name, option in OPTIONS.items() if option.flags}
PROMPT = Arg(OPTIONS["prompt"].help)
# The options of a turn that `run` and `chat` share, by group, in the order their help lists them.
GENERATION = {name: OPTS[name] for name in group("generation")}
LOGGING = {name: OPTS[name] for name in group("logging")}  # the log of answers
SHAPING = {name: OPTS[name] for name in group("shaping")}  # the template, reasoning and constraints
TOOLS = {name: OPTS[name] for name in group("tools")}


def params(*names: str) -> dict[str, Opt | Arg]:
    """A command's parameters, in order, by name (the prompt its argument)."""
    return {name: PROMPT if name == "prompt" else OPTS[name] for name in names}


# ---- the fast parser -----------------------------------------------------------------------

_INT = re.compile(r"[+-]?\d{1,18}")
_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _convert(spec: Opt, text: str) -> Any:
    if spec.type is int:
        return int(text) if _INT.fullmatch(text) else None
    if spec.type is float:
        return float(text) if _FLOAT.fullmatch(text) else None
    return text


def parse(params: dict[str, Opt | Arg], args: list[str]) -> dict[str, Any] | None:
    """The parameters a plain command line gives, by name (defaults for the rest); None when
    Typer should read it instead."""
    given: dict[str, Any] = {name: (None if isinstance(spec, Arg) else spec.default) for name, spec in params.items()}
    spellings: dict[str, tuple[str, Opt, bool]] = {}
    positional: str | None = None
    for name, spec in params.items():
        if isinstance(spec, Arg):
            positional = name
            continue
        for decl in spec.decls:
            on, _, off = decl.partition("/")
            spellings[on] = (name, spec, True)
            if off:
                spellings[off] = (name, spec, False)
    rest = list(args)
    seen_positional = False
    while rest:
        word = rest.pop(0)
        if word.startswith("-") and word != "-":
            spelling, eq, inline = word.partition("=")
            if eq and not spelling.startswith("--"):
                return None
            found = spellings.get(spelling)
            if found is None:
                return None  # help, `--`, a short option run together with its value, a mistake
            name, spec, switched_on = found
            if spec.type is bool:
                if eq:
                    return None
                given[name] = switched_on
                continue
            if not eq:
                if not rest or rest[0].startswith("-"):
                    return None
                inline = rest.pop(0)
            value = _convert(spec, inline)
            if value is None:
                return None
            if spec.multiple:
                given[name] = [*given[name], value]
            else:
                given[name] = value
        else:
            if positional is None or seen_positional:
                return None
            given[positional] = word
            seen_positional = True
    return given


def habits(given: dict[str, Any]) -> list[str]:
    """Warnings for values that look like another tool's habit: `-t 8`, llama.cpp's threads, is a
    temperature here."""
    t = given.get("temperature")
    if isinstance(t, (int, float)) and t >= 3 and float(t).is_integer():
        return [f"-t {t:g} is the temperature here, which makes near-random text; the threads are --threads"]
    return []


def turn_options(given: dict[str, Any], env: Environment) -> TurnOptions:
    """A TurnOptions from a command's parameters, by name: each option of a turn is a field of
    TurnOptions under its parameter's name (a repeatable one as a tuple), but --url, which is
    settled into the server the command talks to (with QUIPU_URL, or the config's [remote] url);
    the rest are the command's own."""
    from quipu.app.choose import server_of
    from quipu.app.turn_options import TurnOptions

    held = {name for name, option in OPTIONS.items() if option.held_as == name}
    return TurnOptions.of_command_line({k: v for k, v in given.items() if k in held},
                          server=server_of(given.get("url"), given.get("model"), env))


def turn_options_of_role(given: dict[str, Any], env: Environment,
                         mode: Mode | None) -> tuple[TurnOptions, Role | None]:
    """`turn_options`, with the values of the role that --role names where the parameters give
    none (roles are read only then); `mode` is the command's, else the options' own."""
    opts = turn_options(given, env)
    if opts.role is None:
        return opts, None
    from quipu.app.roles import with_role

    return with_role(opts, opts.role, env, mode)
