"""The one place errors become messages and exit codes."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, TextIO

from quipu.cli.terminal import say_error, say_plainly
from quipu.errors import ExitCode, Interrupted, QuipuError, came_of_interrupt


def error_line(message: str) -> None:
    say_error(message)  # (escaped: it may name what came from outside)


def run_app(build_app: Callable[..., Any], argv: list[str]) -> int:
    """The whole command line through Typer."""

    def call() -> Any:
        return build_app()(args=argv, prog_name="quipu", standalone_mode=False)

    return guarded(call)


# The libraries whose loggers would otherwise speak over quipu (and Python's warnings).
LIBRARIES = ("mcp", "httpx", "httpcore", "huggingface_hub", "asyncio", "anyio", "urllib3", "filelock", "py.warnings")


def quiet_libraries() -> None:
    """The libraries quipu uses speak only through quipu: what they log prints nothing on its
    own (what matters reaches the user as quipu's own error or warning); `--verbose` shows it."""
    import logging

    logging.captureWarnings(True)
    for name in LIBRARIES:
        log = logging.getLogger(name)
        log.handlers = [logging.NullHandler()]
        log.propagate = False


def library_logs(stream: TextIO) -> None:
    """`--verbose`: what the libraries log, one line a record, on `stream`."""
    import logging

    class OneLine(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            said = record.getMessage().strip().splitlines()
            return f"quipu: {record.name}: {said[0][:300] if said else record.levelname.lower()}"

    handler = logging.StreamHandler(stream)
    handler.setFormatter(OneLine())
    for name in LIBRARIES:
        logging.getLogger(name).addHandler(handler)


def leave(code: object) -> None:
    """Ends the process now that its command is done, with `code` (an exit code; anything else
    is left to `SystemExit`): standard output and error flushed, the exit handlers run, and then
    no interpreter teardown, which frees every module's objects one by one (30-40 ms of a short
    run) for a process about to end. Files are closed, and threads joined, by the code that opened
    them; with a thread of quipu's still running the process ends the usual way."""
    import atexit
    import threading

    if not (code is None or isinstance(code, int)) or any(
            t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        return
    atexit._run_exitfuncs()  # (what they write is flushed next)
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # (the reader left: what it did not read is not ours to keep)
        pass
    except (OSError, ValueError):
        return
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os._exit(code or 0)


def _ended(signum: int, frame: object) -> None:
    from quipu.errors import Ended

    raise Ended  # (SIGTERM, SIGHUP: quipu stops as at Ctrl-C; a reply in progress has its own handler)


def end_as_interrupted() -> None:
    """SIGTERM and SIGHUP end quipu as Ctrl-C does (what was done is kept, exit 130), never by the
    signal's default death."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        for name in ("SIGTERM", "SIGHUP"):
            signal.signal(getattr(signal, name), _ended)


def guarded(call: Callable[[], object]) -> int:
    """Runs a command; its result, or what it raised, becomes the exit code (and a message)."""
    debug = os.environ.get("QUIPU_DEBUG") == "1"
    quiet_libraries()
    end_as_interrupted()
    try:
        result = call()
        return int(result) if isinstance(result, int) else ExitCode.OK
    except Interrupted:
        say_plainly("\nquipu: interrupted\n")
        return ExitCode.INTERRUPTED
    except QuipuError as exc:
        if debug:
            raise
        error_line(str(exc))
        return int(exc.exit_code)
    except KeyboardInterrupt:
        if debug:
            raise
        say_plainly("\nquipu: interrupted\n")
        return ExitCode.INTERRUPTED
    except BrokenPipeError:
        # The reader of our output went away (`quipu run ... | head`): not an error of ours.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return ExitCode.OK
    except OSError as exc:
        if debug:
            raise
        error_line(f"{exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}")
        return ExitCode.FAILURE
    except Exception as exc:
        if came_of_interrupt(exc) and not debug:
            say_plainly("\nquipu: interrupted\n")
            return ExitCode.INTERRUPTED
        code = typer_exit(exc, debug)
        if code is None:
            raise
        return code



def typer_exit(exc: Exception, debug: bool) -> int | None:
    """The exit code of Typer's own exceptions (usage errors, --help's exit, an abort); None for
    anything else. Typer is only looked at when it was imported: a plain `run` never imports it."""
    typer = sys.modules.get("typer")
    if typer is None:
        return None
    if isinstance(exc, typer.Exit):
        return int(exc.exit_code)
    if isinstance(exc, typer.Abort):
        if debug:
            raise exc
        say_plainly("\nquipu: interrupted\n")
        return ExitCode.INTERRUPTED
    if isinstance(exc, typer.TyperException) and type(exc).__name__ == "NoArgsIsHelpError":
        # A bare command (`quipu`, `quipu sessions`): its help, as --help prints it, and no error.
        say_plainly(exc.format_message().rstrip("\n") + "\n", sys.stdout)
        return ExitCode.OK
    if isinstance(exc, typer.TyperException):
        # Typer's usage errors in quipu's voice: one line, and where to look.
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        ctx = getattr(exc, "ctx", None)
        hint = f" (`{ctx.command_path} --help` lists what it takes)" if ctx is not None else ""
        said = other_tools_spelling(exc, ctx)
        if said:
            message, hint = said, ""
        if message.strip():  # (a command given no arguments has shown its help, and says no more)
            error_line(plain(message).rstrip(".") + hint)
        return int(exc.exit_code)
    return None


# Other tools' spellings (llama.cpp's programs, Ollama's, llm's) of what quipu calls otherwise: for
# each, the hints in turn, each with the option of quipu's it names (a hint is said only where the
# command takes that option; None: said wherever the spelling is met).
CTX, FOLLOW = "the context size is --ctx", "llm's -c (go on with the last answer) is -F"
OTHER_SPELLINGS: dict[str, list[tuple[str | None, str]]] = {
    "-c": [("--ctx", f"{CTX}, and {FOLLOW}"), (None, "llm's -c (go on with the last answer) is `quipu run -F` "
                                                     "(or --cid ID, an answer `quipu logs` lists)")],
    "--ctx-size": [("--ctx", CTX)],
    "-p": [("--temperature", 'the prompt is the argument itself: quipu run "..."')],
    "--prompt": [("--temperature", 'the prompt is the argument itself: quipu run "..."')],
    "-f": [("--attach", "a file's text is piped in (quipu run \"...\" < FILE) or attached (-a FILE)")],
    "--file": [("--attach", "a file's text is piped in (quipu run \"...\" < FILE) or attached (-a FILE)")],
    "--n-gpu-layers": [("--gpu-layers", "the layers on the GPU are --gpu-layers (-ngl)")],
    "--temp": [("--temperature", "the temperature is --temperature (-t)")],
    "--n-predict": [("--max-tokens", "the most tokens to generate is --max-tokens (-n)")],
    "--predict": [("--max-tokens", "the most tokens to generate is --max-tokens (-n)")],
    "-ctk": [("--kv-type", "the KV cache type is --kv-type")],
    "--cache-type-k": [("--kv-type", "the KV cache type is --kv-type")],
    "-fa": [("--flash-attn", "flash attention is --flash-attn")],
    "--continue": [("--resume", "llm's chat --continue is --resume (-r): the most recently used session goes on")],
    "--system-prompt": [("--system", "the system prompt is --system (-s)")],
    "--format": [("--schema", "JSON for scripts is --json; a reply kept to a JSON Schema is --schema")],
    "-o": [("--temperature", "llm's -o NAME VALUE is an option of its own here: -t 0 for the temperature, -n for "
                             "the length, --top-p, --seed ... (--help lists them)")],
    "--option": [("--temperature", "llm's -o NAME VALUE is an option of its own here: -t 0 for the temperature, -n "
                                   "for the length, --top-p, --seed ... (--help lists them)")],
}


def other_tools_spelling(exc: Exception, ctx: Any) -> str | None:  # (click's context, where Typer gave one)
    """What quipu calls a thing another tool spells otherwise, where the error shows such a habit:
    an option of llama.cpp's, Ollama's or llm's (named only where the command takes what the hint
    names), or Ollama's `run MODEL PROMPT`."""
    option = getattr(exc, "option_name", None)
    if isinstance(option, str) and option in OTHER_SPELLINGS:
        command = getattr(ctx, "command", None)
        takes = {o for p in getattr(command, "params", ()) for o in getattr(p, "opts", ())}
        for needs, hint in OTHER_SPELLINGS[option]:
            if needs is None or needs in takes:
                return f"no option {option} here: {hint}"
        return None
    params = getattr(ctx, "params", None) or {}
    first = params.get("prompt")
    if isinstance(first, str) and "unexpected extra argument" in str(exc) and looks_like_a_model(first):
        return (f"'{first}' is a model, and a prompt follows: the model goes with -m "
                f"(quipu {ctx.info_name} -m {first} \"...\")")
    return None


def looks_like_a_model(text: str) -> bool:
    """A model file, a name as models are given by name (gemma3:1b, hf:OWNER/REPO), or the name
    of one this machine has (`quipu models list`)."""
    from quipu.app.environment import Environment
    from quipu.app.known_models import is_short_name
    from quipu.errors import QuipuError

    if text.endswith(".gguf") or text.startswith("hf:") or is_short_name(text):
        return True
    try:
        Environment.load().resolve_model(text, fall_back=False)
    except (QuipuError, OSError):
        return False
    return True


# Typer's value errors come in the words of the library that checks them; these say it plainly.
PLAIN = (("Input should be a valid number, unable to parse string as a number", "not a number"),
         ("Input should be a valid integer, unable to parse string as an integer", "not a whole number"),
         ("Input should be a valid integer", "not a whole number"),
         ("Input should be a valid number", "not a number"))


def plain(message: str) -> str:
    for said, meant in PLAIN:
        message = message.replace(said, meant)
    return " ".join(message.split())
