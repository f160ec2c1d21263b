"""The process the user's functions files run in (`--functions FILE.py`), started by
`functions.py`: `python -m quipu.app.function_worker PARENT_PID FILE...`.

The files are imported here, never in quipu's own process, so that nothing they do (print,
loop, exit, crash) reaches quipu's stdout or takes it down. The protocol is JSON lines on the
stdin and stdout this process was started with; the user's code gets /dev/null as its stdin,
a file that keeps what a call prints as its stdout, and the stderr quipu shows, dimmed.

- first line out: `{"tools": [{"file", "name", "description", "parameters", "untyped"}]}`, or
  `{"error": "the functions file ... does not import (line N): ..."}`;
- each line in: `{"file", "name", "arguments"}`; each line out: `{"result", "size", "stdout"}`
  (the result's text cut at `RESULT_MAX` characters, its whole size, what the call printed) or
  `{"error", "stdout"}`.

The process ends when quipu's stdin to it closes, or when quipu itself is gone."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

RESULT_MAX = 1 << 20  # characters of a call's result sent back (the model is given far fewer)
STDOUT_MAX = 64 * 1024  # characters of what a call printed that are kept
REQUEST_MAX = 64 << 20  # bytes of one request


class ImportFailed(Exception):
    """A functions file that does not import, said in one line."""


def load(files: list[str]) -> tuple[list[dict[str, Any]], dict[tuple[int, str], Callable[..., Any]]]:
    """Each public function of each file: what quipu is told of it, and the function."""
    from quipu.app.tool_files import parameters_schema

    told: list[dict[str, Any]] = []
    functions: dict[tuple[int, str], Callable[..., Any]] = {}
    for index, given in enumerate(files):
        module = _import(Path(given), index)
        for fname, fn in vars(module).items():
            if fname.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != module.__name__:
                continue
            schema, untyped = parameters_schema(fn)
            told.append({"file": index, "name": fname, "description": inspect.getdoc(fn) or "",
                         "parameters": schema, "untyped": untyped})
            functions[(index, fname)] = fn
        if not any(t["file"] == index for t in told):
            raise ImportFailed(f"the functions file {given} defines no public function")
    return told, functions


def _import(given: Path, index: int) -> ModuleType:
    """The file imported as a module registered under its own name (so that dataclasses and
    `from __future__ import annotations` find it), its folder first on the path."""
    file = given.expanduser().resolve()
    name = f"quipu_functions_{index}_{file.stem}" if file.stem.isidentifier() else f"quipu_functions_{index}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportFailed(f"{given} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(file.parent))
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:  # the user's code: whatever it raises is said in one line
        where = f" (line {exc.lineno})" if isinstance(exc, SyntaxError) and exc.lineno else ""
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == str(file):
                where = f" (line {tb.tb_lineno})"
            tb = tb.tb_next
        said = exc.msg if isinstance(exc, SyntaxError) else str(exc)
        raise ImportFailed(f"the functions file {given} does not import{where}: {type(exc).__name__}: "
                           f"{said}"[:2000]) from None
    return module


def call(fn: Callable[..., Any], arguments: dict[str, Any]) -> tuple[Any, bool]:
    """The function called with the model's JSON arguments as its hints ask (a dataclass from
    its object): (its value, whether it returned one)."""
    from quipu.app.tool_files import hints_of, to_python

    hints = hints_of(fn)
    value = fn(**{k: to_python(v, hints.get(k)) for k, v in arguments.items()})
    return value, value is not None


def _watch(parent: int) -> None:
    """Ends this process once quipu is gone (a call that never returns would outlive it)."""
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(0.2)


def _bound_memory() -> None:
    """The user's code may take at most three quarters of the machine's memory: a call that wants
    more fails with MemoryError (an error for the model) before the machine does."""
    import resource

    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = total * 3 // 4
        if soft == resource.RLIM_INFINITY or soft > limit:
            resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    except (ValueError, OSError):
        pass


def main(argv: list[str]) -> int:
    parent, files = int(argv[0]), argv[1:]
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    printed = tempfile.TemporaryFile()
    os.dup2(printed.fileno(), 1)
    threading.Thread(target=_watch, args=(parent,), daemon=True).start()
    _bound_memory()

    def send(message: dict[str, Any]) -> None:
        replies.write(json.dumps(message, ensure_ascii=False, default=str).encode("utf-8", "replace") + b"\n")
        replies.flush()

    def taken() -> str:
        """What the user's code printed since last asked, and the file emptied."""
        try:
            sys.stdout.flush()
        except (ValueError, OSError, AttributeError):  # (the user's code closed or replaced it)
            pass
        printed.seek(0)
        data = printed.read(STDOUT_MAX * 4)
        printed.seek(0)
        printed.truncate()
        return data.decode("utf-8", "replace")[:STDOUT_MAX]

    try:
        told, functions = load(files)
    except ImportFailed as exc:
        send({"error": str(exc)})
        return 0
    taken()  # (what the import printed is dropped)
    send({"tools": told})
    while True:
        line = requests.readline(REQUEST_MAX)
        if not line:
            return 0
        try:
            request = json.loads(line)
            fn = functions[(request["file"], request["name"])]
            arguments = request["arguments"]
        except (ValueError, KeyError, TypeError):
            send({"error": "quipu sent a request this process cannot read", "stdout": ""})
            continue
        try:
            value, returned = call(fn, arguments)
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
            out = taken()
            if not returned and out:
                text = out  # a function that prints its answer: what it printed is the result
            send({"result": text[:RESULT_MAX], "size": len(text), "stdout": out})
        except BaseException as exc:  # the tool's own failure (SystemExit too) goes back to the model
            send({"error": f"{type(exc).__name__}: {exc}"[:RESULT_MAX], "stdout": taken()})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
