"""`quipu cache info|clear`: the prompt cache of earlier runs."""

from __future__ import annotations

import json

import typer

from quipu.cli.terminal import human_size
from quipu.cli.terminal import Terminal

app = typer.Typer(rich_markup_mode=None, short_help="Context states of earlier prompts, reused by later runs",
                  help="The prompt cache: context states of earlier prompts, reused by later runs.",
                  no_args_is_help=True)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="cache")


@app.command(short_help="Where the cache is and how much it holds")
def info(context: typer.Context, as_json: bool = typer.Option(False, "--json", help="One JSON object.")) -> None:
    """Where the cache is, how many entries, how much of its budget they use."""
    from quipu.app.cache import cache_info

    data = cache_info(context.obj)
    term = Terminal.detect()
    if as_json:
        term.out(json.dumps(data) + "\n")
    else:
        term.out(f"{data['path']}\n{entries(data['entries'])}, {human_size(data['bytes'])} "
                          f"of {human_size(data['max_bytes'])} (cache.max_bytes)\n")


@app.command()
def clear(context: typer.Context) -> None:
    """Remove every entry."""
    from quipu.app.cache import clear_cache

    removed = clear_cache(context.obj)
    Terminal.detect().err(f"removed {entries(removed)}\n")


def entries(n: int) -> str:
    return f"{n} {'entry' if n == 1 else 'entries'}"
