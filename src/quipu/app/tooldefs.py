"""What a tool is to quipu, wherever it comes from (a functions file, a tools JSON, an MCP
server): its definition as the model is told it, and what runs it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from quipu.sessions.tools import ToolSpec

DEFAULT_TIMEOUT = 60.0  # seconds a tool may run


class ToolFailure(Exception):
    """A call that failed in a way its message says whole (the model is given the message)."""


@dataclass
class Tool:
    spec: ToolSpec
    run: Callable[[dict[str, Any]], Any] | None  # None: the caller runs it (--tools FILE.json)
    source: str  # where it came from, for messages: "functions.py", "tools.json", "mcp server x"
    timeout: float = DEFAULT_TIMEOUT
