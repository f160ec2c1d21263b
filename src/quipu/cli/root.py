"""The root of the command: `--version`, and the one Environment every command reads."""

from __future__ import annotations

import sys

import typer


def root(
    context: typer.Context,
    version: bool = typer.Option(False, "--version", help="Show the version and exit.", is_eager=True),
) -> None:
    if version:
        from quipu import __version__
        from quipu.cli.terminal import say_plainly

        say_plainly(f"quipu {__version__}\n", sys.stdout)
        raise typer.Exit()
    from quipu.app.environment import Environment

    context.obj = Environment.load()  # built once here; each command reads it from its context
