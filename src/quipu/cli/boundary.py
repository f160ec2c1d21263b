"""The one place errors become messages and exit codes."""

from __future__ import annotations

import os
import sys
from typing import Callable

from quipu.errors import ExitCode, Interrupted, QuipuError


def error_line(message: str) -> None:
    sys.stderr.write(f"quipu: error: {message}\n")
    sys.stderr.flush()


def run_app(build_app: Callable, argv: list[str]) -> int:
    import typer

    debug = os.environ.get("QUIPU_DEBUG") == "1"
    try:
        app = build_app()
        result = app(args=argv, prog_name="quipu", standalone_mode=False)
        return int(result) if isinstance(result, int) else ExitCode.OK
    except Interrupted:
        sys.stderr.write("\nquipu: interrupted\n")
        return ExitCode.INTERRUPTED
    except QuipuError as exc:
        if debug:
            raise
        error_line(str(exc))
        return int(exc.exit_code)
    except typer.Exit as exc:
        return exc.exit_code
    except typer.TyperException as exc:
        if hasattr(exc, "show"):
            exc.show()
        else:
            error_line(str(exc))
        return exc.exit_code
    except (KeyboardInterrupt, typer.Abort):
        if debug:
            raise
        sys.stderr.write("\nquipu: interrupted\n")
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
