"""The options of `spec.py` as Typer parameters: the aliases `chat` and `embed` annotate with,
and whole signatures for commands declared as a table (`run`)."""

from __future__ import annotations

import inspect
from typing import Annotated, Any, Callable, List, Mapping, Optional

import typer

from quipu.cli import spec


def annotated(option: spec.Opt | spec.Arg) -> Any:
    """`Annotated[type, typer.Option(...)]` for an option (or the argument) declared in spec.py."""
    if isinstance(option, spec.Arg):
        return Annotated[Optional[str], typer.Argument(help=option.help, metavar="PROMPT")]
    kind: Any = List[option.type] if option.multiple else option.type  # type: ignore[name-defined]  # (a type made at run time, for Typer)
    if not option.multiple and option.default is None:
        kind = Optional[kind]
    return Annotated[kind, typer_option(option)]


def typer_option(option: spec.Opt) -> Any:
    """The `typer.Option(...)` of an option declared in spec.py."""
    metavar = None if option.type is bool else option.shown
    return typer.Option(*option.decls, help=option.help, autocompletion=option.complete, metavar=metavar)


WORDS = {"str": "TEXT", "int": "N", "float": "NUMBER", "path": "PATH", "bool": ""}


def plain_help() -> None:
    """Help that reads like a person wrote it: a flag shows no `<bool>` tag, a value its kind in
    words (N, NUMBER, TEXT, PATH) where it was not named where it is declared, and an argument on
    the usage line as Unix usage writes it (`usage_name`)."""
    from typer.core import TyperArgument, TyperOption

    for kind in (TyperOption, TyperArgument):
        if getattr(kind, "_quipu_plain", False):
            continue
        shown = kind.display_type_rich

        def display_type_rich(self: Any, ctx: Any, shown: Any = shown) -> str | None:
            if getattr(self, "is_flag", False):
                return None
            said = shown(self, ctx)
            if not isinstance(said, str) or not (said.startswith("<") and ">" in said):
                return None if said is None else str(said)
            inner, _, rest = said[1:].partition(">")
            inner = inner[5:-1] if inner.startswith("list[") else inner
            return (WORDS.get(inner, inner.upper()) + rest) or None

        kind.display_type_rich = display_type_rich  # type: ignore[method-assign]  # (Typer's own method, replaced once)
        kind._quipu_plain = True  # type: ignore[union-attr]  # (a mark: replaced already)
    if getattr(TyperArgument, "_usage_display_name", None) is not None:
        TyperArgument._usage_display_name = usage_name  # type: ignore[method-assign, assignment]  # (as above)
    from typer.core import TyperCommand, TyperGroup

    if not getattr(TyperGroup, "_quipu_short", False):  # (click's, replaced once)
        TyperCommand.get_short_help_str = short_help  # type: ignore[method-assign, assignment]
        TyperGroup.get_short_help_str = short_help  # type: ignore[method-assign, assignment]
        TyperCommand.format_options = grouped_options  # type: ignore[method-assign, assignment]
        TyperGroup._quipu_short = True  # type: ignore[attr-defined]  # (a mark: replaced already)


# The sections a command's options are listed in, by their group in the registry (`quipu.options`).
SECTIONS = {"generation": "Sampling, context and placement", "shaping": "Template, reasoning and structured output",
            "tools": "Tools", "logging": "The log of answers"}
# The options a user types most, listed first, in this order, whatever their kind.
FIRST = ("model", "system", "session", "max_tokens", "temperature", "attach", "as_json")


def grouped_options(command: Any, ctx: Any, formatter: Any) -> None:  # (a click command, its context, formatter)
    """A command's arguments, the options a user types most (`FIRST`), then the others in
    sections by their kind (`SECTIONS`), the command's own first: a long list read in parts."""
    from quipu.options import OPTIONS

    sections: dict[str, list[tuple[str, str]]] = {"Arguments": [], "Most used": [], "Options": []}
    params = sorted(command.get_params(ctx), key=lambda p: FIRST.index(p.name) if p.name in FIRST else len(FIRST))
    for param in params:
        record = param.get_help_record(ctx)
        if record is None:
            continue
        option = OPTIONS.get(param.name or "")
        title = "Arguments" if getattr(param, "param_type_name", "") == "argument" else "Most used" \
            if param.name in FIRST else SECTIONS.get(option.group if option is not None else "", "Options")
        sections.setdefault(title, []).append(record)
    for title, records in sections.items():
        if records:
            with formatter.section(title):
                formatter.write_dl(records)


def short_help(command: Any, limit: int = 45) -> str:  # (a click command)
    """A command's line in its group's list: its help's first sentence, or the first part of it
    that fits in `limit` characters, cut where a clause ends (never in the middle, with "...")."""
    if command.short_help:
        return str(command.short_help)
    text = " ".join((command.help or "").split("\n\n")[0].split())
    sentence = text.split(". ")[0].rstrip(".")
    for cut in ("", ": ", " (", "; ", ", "):
        head = sentence.split(cut)[0] if cut else sentence
        if len(head) <= limit:
            return head
    return sentence[:limit].rsplit(" ", 1)[0]


def usage_name(argument: Any) -> str:  # (a TyperArgument)
    """An argument on a usage line as Unix usage writes it: NAME when it must be given, [NAME]
    when it may be, NAME... for several (Typer writes `{name}`)."""
    name: str = argument.metavar or argument.name.upper()
    if not argument.required:
        name = f"[{name}]"
    return name + ("..." if argument.nargs != 1 else "")


def command(params: Mapping[str, spec.Opt | spec.Arg], run: Callable[..., int]) -> Callable[..., int]:
    """A command for Typer declared as a table: its parameters are `params`, and it runs
    `run(env, **given)` (the Environment Typer's context holds)."""
    def typer_command(context: typer.Context, **given: Any) -> int:
        return run(context.obj, **given)

    typer_command.__dict__["__signature__"] = signature(params)  # (what Typer reads the parameters from)
    return typer_command


def signature(params: Mapping[str, spec.Opt | spec.Arg]) -> inspect.Signature:
    """A command's signature for Typer: the context, then the declared parameters in order."""
    context = inspect.Parameter("context", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
    return inspect.Signature([context] + [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotated(option),
                          default=None if isinstance(option, spec.Arg) else option.default)
        for name, option in params.items()
    ])

