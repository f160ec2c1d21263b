"""What a tool is to quipu, wherever it comes from (a functions file, a tools JSON, an MCP
server): its definition as the model is told it, and what runs it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from quipu.errors import UsageError
from quipu.sessions.toolspec import ToolSpec

DEFAULT_TIMEOUT = 60.0  # seconds a tool may run
# What a tool may be named (as OpenAI's API allows, with dots): a name is written into the prompt
# as the template spells it, so it can hold no markup.
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class ToolFailure(Exception):
    """A call that failed in a way its message says whole (the model is given the message);
    `stdout`, what the call printed before it failed."""

    def __init__(self, message: str, stdout: str = ""):
        super().__init__(message)
        self.stdout = stdout


@dataclass
class ToolOutput:
    """What a call gave: its result's text (perhaps cut where it was made), the whole result's
    size in characters, and what the call printed."""

    text: str
    size: int
    stdout: str = ""
    # The images and recordings of the result: each the note its text holds for it
    # (`[image: PNG, 93 B]`) and its bytes, for a model that can be given them instead.
    media: tuple[tuple[str, bytes], ...] = ()


def never() -> bool:
    """A `stopped()` for work that nothing stops but its own bounds."""
    return False


# A tool's runner: (the call's arguments, the seconds it may take, whether the user stopped the
# work: asked as it waits) -> its output; it raises ToolFailure when the call failed, and
# Interrupted when the user stopped it.
Runner = Callable[[dict[str, Any], float, Callable[[], bool]], ToolOutput]


@dataclass(frozen=True)
class Tool:
    spec: ToolSpec
    run: Runner | None  # None: the caller runs it (--tools FILE.json)
    source: str  # where it came from, for messages: "functions.py", "tools.json", "mcp server x"
    timeout: float = DEFAULT_TIMEOUT


def check_tool_name(name: str, source: str) -> None:
    """A usage error unless `name` is one a tool may have."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        shown = repr(name) if len(str(name)) <= 80 else repr(str(name)[:80]) + "..."
        raise UsageError(f"the tool name {shown} ({source}) is not 1 to 64 letters, digits, '_', '.' or '-'")
