"""A tool as the model is told of it (`ToolSpec`), a call it made (`ToolCall`), and a reply
read into its answer, reasoning and calls (`ParsedReply`): the values the tool-call formats
(`tools.py`), their parsers (`call_parsers.py`) and their grammars (`call_grammars.py`) share."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str | None = None

    @property
    def spelled(self) -> str:
        return spell_call(self.name, self.arguments)

    def to_message(self) -> dict[str, Any]:
        """The call as an assistant message's `tool_calls` entry (OpenAI's shape, arguments a dict)."""
        call = {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return {"id": self.id, **call} if self.id else call


def spell_call(name: str, arguments: dict[str, Any]) -> str:
    """A call as people are shown it: `name({"arg": ...})`."""
    return f"{name}({json.dumps(arguments, ensure_ascii=False)})"


@dataclass
class ParsedReply:
    content: str  # the text besides the calls
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    answer: str = ""  # all after the reasoning, as written (the calls' markup included)


@dataclass(frozen=True)
class ToolSpec:
    """A tool as the model is told of it: OpenAI's `{"type": "function", "function": {...}}`."""

    name: str
    description: str
    parameters: dict[str, Any]
    # Where the engine cannot hold a call to all of `parameters` (a keyword it cannot enforce, given
    # by a server's client that checks its calls itself): what a call is held to of them.
    held: dict[str, Any] | None = None

    @property
    def call_schema(self) -> dict[str, Any]:
        """The schema a call's arguments are held to."""
        return self.held if self.held is not None else self.parameters

    def to_openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}
