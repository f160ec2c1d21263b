"""`quipu config path|show`: where the config file is, and what is in force."""

from __future__ import annotations

import json

import typer

from quipu.cli.terminal import Terminal

app = typer.Typer(rich_markup_mode=None, help="Show the config file and the settings in force.", no_args_is_help=True)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="config")


@app.command()
def path(context: typer.Context) -> None:
    """Print the config file's path (it need not exist)."""
    Terminal.detect().out(f"{context.obj.dirs.config_file}\n")


@app.command()
def show(context: typer.Context, as_json: bool = typer.Option(False, "--json", help="One JSON object.")) -> None:
    """The effective settings and where each came from."""
    term = Terminal.detect()
    rows = context.obj.effective_settings()
    if as_json:
        term.out(json.dumps({k: {"value": v, "source": s} for k, v, s in rows}, indent=1) + "\n")
        return
    term.table(("setting", "value", "from"), ((key, "" if value is None else str(value), source)
                                              for key, value, source in rows))
