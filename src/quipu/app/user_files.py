"""Files the user names (a schema, a grammar, a template, a tools or messages file, a batch
file, an attachment): read with a bound on their size (and, for JSON, their depth, found before
they become Python objects), each failure a one-line usage error, and in a thread of their own,
so that a stop (Ctrl-C, SIGTERM) is acted on while one is waited for (a FIFO without a writer, a
slow disk)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from quipu.errors import UsageError, told_to_stop
from quipu.store.files import lone_surrogate as lone_surrogate  # (the store reads files with it too)

MAX_FILE_BYTES = 64 << 20  # the largest file the user names that is read (as standard input)
# A JSON string, or one bracket: what a depth scan needs to see of a JSON text.
_JSON_MARKS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


def json_depth(text: str, stop_past: int) -> int:
    """How deep brackets nest in a JSON text, found without parsing it (strings skipped), the
    scan ended once past `stop_past`."""
    depth = deepest = 0
    for mark in _JSON_MARKS.finditer(text):
        c = mark.group()
        if c in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > stop_past:
                    break
        elif c in "]}":
            depth -= 1
    return deepest


def read_json_file(name: str, what: str) -> Any:
    """A JSON file the user named, parsed; a clear usage error when it cannot be read or parsed,
    or is larger or deeper than quipu takes (checked before it becomes Python objects)."""
    import json

    from quipu.engine.grammar import MAX_DEPTH

    path = Path(name).expanduser()
    text = read_text_file(name, what, allow_empty=True)
    if json_depth(text, MAX_DEPTH) > MAX_DEPTH:
        raise UsageError(f"the {what} {path} nests deeper than {MAX_DEPTH} levels")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise UsageError(f"the {what} {path} is not valid JSON: {exc}") from None
    if lone_surrogate(data):
        raise UsageError(f"the {what} {path} holds a lone surrogate (\\ud800-\\udfff), which is no text")
    return data


def read_user_file(path: Path, limit: int, stopped: Callable[[], bool] = told_to_stop) -> bytes:
    """At most `limit` + 1 bytes of a file the user named, read in a thread of its own while
    `stopped` (Ctrl-C, SIGTERM) is asked: `Interrupted`. OSError as the open or read raise it."""
    from quipu.engine.base import waited

    def read() -> bytes:
        with open(path, "rb") as f:
            return f.read(limit + 1)

    return waited(read, stopped, f"stopped while {path} was read")


def read_text_file(name: str, what: str, allow_empty: bool = False) -> str:
    """A file the user named, as text (at most `MAX_FILE_BYTES`); a clear usage error when it
    cannot be."""
    path = Path(name).expanduser()
    try:
        data = read_user_file(path, MAX_FILE_BYTES)
    except OSError as exc:
        raise UsageError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise UsageError(f"the {what} {path} is larger than {MAX_FILE_BYTES >> 20} MB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"the {what} {path} is not UTF-8 text") from None
    if not text.strip() and not allow_empty:
        raise UsageError(f"the {what} {path} is empty")
    return text
