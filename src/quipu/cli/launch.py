"""`quipu launch AGENT`'s command line: a coding agent run on a local model through `quipu serve`
(`quipu.app.launch`), the agent's own arguments after `--`."""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer

from quipu.cli import options as opt, spec

HELP = ("Run a coding agent (claude, codex or opencode) on a local model: quipu serve started for it (or the one on "
        "the port), the agent pointed at it for this run, the server stopped when the agent exits. The agent's own "
        "arguments go after --.")


def register(app: typer.Typer) -> None:
    app.command("launch", help=HELP, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(
        launch)


def launch(
    context: typer.Context,
    agent: Annotated[str, typer.Argument(help="claude, codex or opencode.", show_default=False)],
    model: Annotated[Optional[str], opt.typer_option(spec.OPTS["model"])] = None,
    port: Annotated[Optional[int], opt.typer_option(spec.OPTS["port"])] = None,
    ctx: Annotated[Optional[str], opt.typer_option(spec.OPTS["ctx"])] = None,
    parallel: Annotated[Optional[int], opt.typer_option(spec.OPTS["parallel"])] = None,
    show_only: Annotated[bool, opt.typer_option(spec.OPTS["show_only"])] = False,
    args: Annotated[Optional[List[str]], typer.Argument(hidden=True)] = None,
) -> None:
    from quipu.app.launch import launch as run_launch
    from quipu.cli.terminal import Terminal

    term = Terminal.detect()
    status = run_launch(context.obj, agent, model, port, ctx, parallel, show_only, [*(args or []), *context.args],
                        say=lambda line: term.err(f"quipu launch: {line}\n"), shown_to=term.out)
    raise typer.Exit(status)
