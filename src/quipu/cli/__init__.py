"""The `quipu` command: assembles the sub-apps; `main` is the one error boundary.

One module per command or sub-app (`run.py` and its `--batch` in `batch.py`, `chat.py`, `sessions.py`, `models.py`,
`config.py`, `embed.py`, `cache.py`, `doctor.py`, `logs.py`, `roles.py`), with `root.py` (`--version`, the Environment built once),
`pull.py` (a pull from the Hugging Face Hub as a person sees it), `spec.py` (the options of `run` and `chat` as data, and a parser for a plain `run` that needs
no Typer), `options.py` (those options as Typer parameters), `repl.py` (the chat REPL), `slash.py` (its table of
slash commands), `render.py` (a reply on the chat's screen as it streams), `stream.py` (where a reply of `run` or of the chat goes as it streams), `terminal.py` (terminal facts, progress, Ctrl-C), `boundary.py` (errors to
messages and exit codes) and `completion.py` (shell completion). Each parses, calls
`quipu.app`, and renders; none touches llama.cpp or a file format.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import typer


# The commands, by name (`build_app` registers each; a test holds the two together).
COMMANDS = ("run", "chat", "sessions", "logs", "roles", "models", "config", "embed", "cache", "doctor", "serve", "launch")


# Other tools' verbs (Ollama's, llm's), which a bare first argument is not a question for: the
# command of quipu's that does it, or, where quipu has none, what to say instead.
VERBS = {"list": ["models", "list"], "ls": ["models", "list"], "pull": ["models", "pull"],
         "show": ["models", "info"], "prompt": ["run"]}
NOT_HERE = {
    "ps": "quipu loads a model for each command and holds none between them; a `quipu serve` holds one, which "
          "its /api/ps names",
    "stop": "quipu holds no model between commands; `quipu serve` stops with Ctrl-C",
    "rm": "`quipu models rm NAME` removes a pulled model, `quipu sessions rm NAME` a session",
    "create": "quipu runs GGUF files as they are: `quipu models add FILE` names one, `quipu roles add` keeps a "
              "system prompt and options",
    "cp": "`quipu sessions fork NAME NEW` copies a session; a model is named again with `quipu models add`",
    "push": "quipu keeps models on this machine; it pushes nowhere",
    "keys": "quipu asks local models; a remote server's key is read from $QUIPU_API_KEY",
}


def as_prompt(argv: list[str]) -> list[str]:
    """`quipu "question" [OPTIONS]`: a first argument that is no command is `run`'s prompt (llm's
    habit); but one word near a command's name is taken for a typo of it (Typer says which), one
    of another tool's verbs for quipu's command that does it (`VERBS`), and `quipu help` is
    `quipu --help`; `quipu sessions` and `quipu models` alone list them."""
    if argv in (["sessions"], ["models"]):  # (a group that lists, as `quipu logs` does, where it is asked alone)
        return [*argv, "list"]
    if not argv or argv[0].startswith("-") or argv[0] in COMMANDS:
        return argv
    first = argv[0]
    if first == "help":
        return ["--help", *argv[1:]]
    if first in VERBS:
        return [*VERBS[first], *argv[1:]]
    if len(first.split()) == 1:
        import difflib

        if difflib.get_close_matches(first.lower(), COMMANDS, n=1, cutoff=0.6):
            return argv
    return ["run", *argv]


def model_first(argv: list[str]) -> str | None:
    """What to say of Ollama's habit `quipu MODEL PROMPT` (`ollama run MODEL PROMPT`): a first
    argument that names a model (a short name, a model known without its size, a .gguf file) and
    a second, the prompt; None for anything else."""
    words = [arg for arg in argv if not arg.startswith("-")]
    if len(words) < 2 or argv[0] != words[0] or words[0] in COMMANDS or words[0] in VERBS:
        return None
    first = words[0]
    from quipu.app.known_models import is_short_name, sizes_of

    if not (is_short_name(first) or sizes_of(first) or first.lower().endswith(".gguf")):
        return None
    said = words[1].replace('"', '\\"')
    return f'a model is named with -m, and the prompt follows: quipu run -m {first} "{said}"'


def build_app() -> typer.Typer:
    import typer

    from quipu.cli import cache, chat, config, doctor, embed, launch, logs, models, roles, root, run, serve, sessions
    from quipu.cli.options import plain_help

    plain_help()

    app = typer.Typer(
        name="quipu",
        help="Chat with local GGUF models. Sessions resume exactly and instantly.",
        no_args_is_help=True,
        context_settings={"help_option_names": ["-h", "--help"]},
        pretty_exceptions_enable=False,
        rich_markup_mode=None,  # help says what it is given: `[mcp.NAME]` is text, not markup
    )

    app.callback()(root.root)
    run.register(app)
    chat.register(app)
    sessions.register(app)
    logs.register(app)
    roles.register(app)
    models.register(app)
    config.register(app)
    embed.register(app)
    cache.register(app)
    doctor.register(app)
    serve.register(app)
    launch.register(app)
    return app


def main(argv: list[str] | None = None) -> None:
    """Entry point of the console script and `python -m quipu` (`argv` None: the process is
    quipu's, and ends as soon as the command is done, see `boundary.leave`)."""
    if sys.stdout is None or sys.stderr is None:  # (started with a standard stream closed: `>&-`)
        closed_stream()
    try:
        from quipu.cli.boundary import end_as_interrupted, leave

        end_as_interrupted()  # (from the start: a SIGTERM while quipu is imported is an interruption too)
        if argv is not None:
            _main(argv)
            return
        try:
            _main(sys.argv[1:])
        except SystemExit as exc:
            leave(exc.code)
            raise
        leave(0)
    except (KeyboardInterrupt, RuntimeError) as exc:  # Ctrl-C while quipu itself is still being imported
        from quipu.errors import came_of_interrupt

        if os.environ.get("QUIPU_DEBUG") == "1" or not came_of_interrupt(exc):
            raise
        from quipu.cli.terminal import say_plainly

        say_plainly("\nquipu: interrupted\n")
        sys.exit(130)


def closed_stream() -> None:
    """Ends quipu at once, in one line where standard error is open, when it was started with
    standard output or error closed: what it writes would go nowhere, or raise."""
    if sys.stderr is not None:
        from quipu.cli.terminal import say_error

        say_error("standard output is closed; send it somewhere (> /dev/null drops it)")
    os._exit(2)  # (the usage's exit code: how quipu was started, not what it did)


def _main(argv: list[str]) -> None:
    if argv == ["--version"]:  # answered before anything heavy is imported
        from quipu import __version__
        from quipu.cli.terminal import say_plainly

        say_plainly(f"quipu {__version__}\n", sys.stdout)
        return
    from quipu.cli.boundary import guarded, run_app

    not_text = next((i for i, arg in enumerate(argv, 1) if any("\udc80" <= c <= "\udcff" for c in arg)), None)
    if not_text is not None:  # (bytes that are not UTF-8, which Python hands over as lone surrogates)
        from quipu.cli.terminal import say_error

        given = argv[not_text - 1].encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        say_error(f"argument {not_text} is not UTF-8 text: {given[:200]}")
        sys.exit(2)
    if argv and argv[0] in NOT_HERE:  # (another tool's verb, which a bare word is not asked as a question)
        from quipu.cli.terminal import say_error

        say_error(f"`{argv[0]}` is another tool's command: {NOT_HERE[argv[0]]}")
        sys.exit(2)
    hint = model_first(argv)
    if hint is not None:
        from quipu.cli.terminal import say_error

        say_error(hint)
        sys.exit(2)
    argv = as_prompt(argv)
    # (llama.cpp's -sys is the system prompt; read as -s it would be a system prompt of "ys")
    argv = ["--system" if arg == "-sys" else arg for arg in argv]
    if argv[:1] == ["run"] and "_QUIPU_COMPLETE" not in os.environ:
        # A plain `quipu run` skips Typer: a short run is a short process (see spec.py).
        from quipu.cli import run

        plain = run.plain(argv[1:])
        if plain is not None:
            sys.exit(guarded(plain))
    sys.exit(run_app(build_app, argv))
