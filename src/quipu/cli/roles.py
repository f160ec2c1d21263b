"""`quipu roles ...`: list, show, add, rm."""

from __future__ import annotations

import json
from typing import Any, List, Optional

import typer

from quipu.cli.terminal import Dim, Terminal
from quipu.errors import UsageError
from quipu.shown import shown

app = typer.Typer(rich_markup_mode=None, no_args_is_help=True,
                  short_help="A system prompt, a model, a prompt and options kept by name",
                  help="Roles: a system prompt, a model, a prompt and options kept under a name (--role NAME).")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="roles")


@app.command("list")
def list_(context: typer.Context, as_json: bool = typer.Option(False, "--json", help="One JSON object.")) -> None:
    """List the roles, from the config and their own files."""
    from quipu.app.roles import load_roles

    term = Terminal.detect()
    found = load_roles(context.obj)
    if as_json:
        term.out(json.dumps({n: {**r.values, "source": r.source} for n, r in found.items()},
                                     ensure_ascii=False) + "\n")
    elif not found:
        term.err("no roles yet: `quipu roles add NAME --system TEXT` makes one\n")
    for name, r in sorted(found.items()) if not as_json else ():
        about = r.values.get("system") or r.values.get("prompt") or ", ".join(r.values)
        flat = " ".join(str(about).split())
        term.out(f"{shown(name)}  ", Dim(shown(flat[:80] + ('…' if len(flat) > 80 else ''))), "\n")


@app.command()
def show(context: typer.Context, name: str = typer.Argument(..., help="The role.")) -> None:
    """Show a role's values and where it is kept."""
    from quipu.app.roles import role

    r = role(context.obj, name)
    term = Terminal.detect()
    term.out(Dim('# ' + shown(r.source)), "\n")
    for key, value in r.values.items():
        term.out(f"{key} = {shown(json.dumps(list(value) if isinstance(value, tuple) else value, ensure_ascii=False))}\n")


@app.command()
def add(context: typer.Context, name: str = typer.Argument(..., help="The role's name."),
        system: Optional[str] = typer.Option(None, "--system", "-s", help="Its system prompt."),
        prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Its prompt: $input stands for what a run "
                                             "or a chat message gives (else that follows it)."),
        model: Optional[str] = typer.Option(None, "--model", "-m", help="Its model."),
        options: Optional[List[str]] = typer.Option(None, "--set", help="KEY=VALUE: any option of run and chat, by "
                                                    "its config name (temperature=0.2, max_tokens=300, "
                                                    "stop=[\"END\"]); repeatable.", metavar="KEY=VALUE"),
        replace: bool = typer.Option(False, "--replace", help="Write it again if it is there.")) -> None:
    """Keep a role in a file of its own (roles/NAME.toml in the config folder)."""
    from quipu.app.roles import add_role

    values: dict[str, Any] = {k: v for k, v in (("system", system), ("prompt", prompt), ("model", model)) if v is not None}
    for item in options or ():
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set takes KEY=VALUE, not {json.dumps(item)}")
        values[key.strip()] = _value(text.strip())
    path = add_role(context.obj, name, values, replace=replace)
    Terminal.detect().err(f"role '{name}' kept in {path}\n")


def _value(text: str) -> Any:
    """A value as TOML reads it (0.2, 300, true, ["a", "b"], "text"); anything else, as text."""
    import tomllib

    try:
        return tomllib.loads(f"v = {text}")["v"]
    except (tomllib.TOMLDecodeError, ValueError):
        return text
    except RecursionError:
        raise UsageError(f"--set {text[:20]}...: the value nests deeper than quipu reads") from None


@app.command()
def rm(context: typer.Context, name: str = typer.Argument(..., help="The role.")) -> None:
    """Remove a role kept in a file of its own."""
    from quipu.app.roles import remove_role

    remove_role(context.obj, name)
    Terminal.detect().err(f"role '{name}' removed\n")
