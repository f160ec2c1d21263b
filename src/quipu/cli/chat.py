"""`quipu chat`: the interactive chat; every finished turn is saved."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable

from quipu.cli import spec
from quipu.cli.terminal import Dim, PrefillProgress, Terminal
from quipu.errors import UsageError

if TYPE_CHECKING:
    import typer

    from quipu.app.environment import Environment

HELP = "Chat in the terminal. Every turn is saved; --resume picks up where you left off."

# The parameters of `quipu chat`, in order, as `run`'s are declared (`spec.py`).
PARAMS = spec.params("session", "branch", "resume", "markdown", "role", *spec.LOGGING, *spec.GENERATION, "mmproj",
                     *spec.SHAPING, *(name for name in spec.TOOLS if name != "tool_results"), "hide_thinking",
                     "verbose", "url")
# The parameters that are the command's own, not options of the conversation.
OWN = ("resume", "markdown", "hide_thinking")


def register(app: typer.Typer) -> None:
    from quipu.cli.options import command

    app.command("chat", help=HELP)(command(PARAMS, chat))


def function_output(term: Terminal) -> Callable[[str], None]:
    """Where a chat shows what the user's functions write on stderr: a line at a time, dimmed."""
    def say(line: str) -> None:
        term.err(Dim(line), "\n")

    return say


def chat(env: Environment, **given: Any) -> int:
    from quipu.app.chat import ChatSession
    from quipu.cli.repl import Repl

    from quipu.app.modes import CHAT

    resume, markdown, hide_thinking = (given[k] for k in OWN)
    if markdown is None:  # (neither --markdown nor --no-markdown: the config's [chat] markdown)
        markdown = bool(env.config.chat.get("markdown", False))
    opts, role = spec.turn_options_of_role(given, env, CHAT)
    for warning in env.config.warnings + spec.habits(given):  # (a config others can read holds a token; -t 8)
        Terminal.detect().warn(warning)
    if opts.verbose:
        from quipu.cli.boundary import library_logs

        library_logs(sys.stderr)
    if opts.session is not None and resume:
        raise UsageError("give either --session NAME or --resume, not both")
    term = Terminal.detect()
    if opts.server is None:
        from quipu.cli.pull import pull_if_needed

        pull_if_needed(env, opts.model, term)
    progress = PrefillProgress(term, "restoring the conversation")
    try:
        # A chat read from a pipe is a script's: it keeps a session only when one is named.
        chat_ = ChatSession.open(env, opts, name=opts.session, resume_latest=resume, keep_unnamed=term.stdin_tty,
                                 on_progress=progress, shape=role.fill if role is not None and role.prompt else None,
                                 on_output=function_output(term))
    finally:
        progress.close()
    try:
        return Repl(chat_, term, env, markdown=markdown, show_thinking=not hide_thinking).run()
    finally:
        chat_.close()
