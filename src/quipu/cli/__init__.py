"""The `quipu` command: assembles the sub-apps; `main` is the one error boundary."""

from __future__ import annotations

import sys


def build_app():
    import typer

    from quipu.cli import chat, config, embed, models, root, run, sessions

    app = typer.Typer(
        name="quipu",
        help="Chat with local GGUF models. Sessions resume exactly and instantly.",
        no_args_is_help=True,
        context_settings={"help_option_names": ["-h", "--help"]},
        pretty_exceptions_enable=False,
    )

    app.callback()(root.root)
    run.register(app)
    chat.register(app)
    sessions.register(app)
    models.register(app)
    config.register(app)
    embed.register(app)
    return app


def main(argv: list[str] | None = None) -> None:
    """Entry point of the console script and `python -m quipu`."""
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--version"]:  # answered before anything heavy is imported
        from quipu import __version__

        print(f"quipu {__version__}")
        return
    from quipu.cli.boundary import run_app

    sys.exit(run_app(build_app, argv))
