"""A conversation's turns with tools: what a reply is offered (the call grammar a local model or
llama-server is held to once a call begins, with what the template writes before a required
call; a chat API's tools), and the calls a reply made read into its message. Functions of the
conversation they are given (`Conversation`, `conversation.py`) and of its turn's settings."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence

from quipu.errors import TemplateError, UsageError
from quipu.sessions.base import Generation, Message, ModelSession, ToolOffer, token_session
from quipu.sessions.call_grammars import CHOICES, CallGrammar
from quipu.sessions.tools import Format, format_of, parse_reply
from quipu.sessions.toolspec import ToolCall, ToolSpec

if TYPE_CHECKING:
    from quipu.sessions.prompt import Rendered
    from quipu.sessions.reasoning import ReasoningFormat
    from quipu.sessions.template import ChatTemplate


@dataclass(frozen=True)
class TurnSettings:
    """What a conversation's replies are given besides its messages: the tools the model is told
    of (rendered by its template) and whether it may call them ("auto", "required", "none", or a
    tool's name: that one, required); at most how many tokens a reply's reasoning may take (None:
    no limit; 0: none); and what the template is given besides the messages (`enable_thinking`,
    `reasoning_effort`, `documents`, ...). A turn is given one; a conversation keeps its own."""

    tools: tuple[ToolSpec, ...] = ()
    tool_choice: str = "auto"
    reasoning_budget: int | None = None
    variables: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def but(self, **changes: Any) -> TurnSettings:
        """These settings with `changes` (the tools as a tuple, the variables a copy none can change)."""
        if "tools" in changes:
            changes["tools"] = tuple(changes["tools"])
        if "variables" in changes:
            changes["variables"] = MappingProxyType(dict(changes["variables"]))
        return replace(self, **changes)


class Turns(Protocol):
    """What the tools' part reads of a conversation."""

    session: ModelSession
    template: ChatTemplate | None
    messages: list[Message]

    @property
    def reasoning(self) -> ReasoningFormat | None: ...

    def render(self, messages: Sequence[Message], add_generation_prompt: bool, tail: str = "",
               turn: TurnSettings | None = None) -> Rendered: ...


def tool_format(template: ChatTemplate | None) -> Format:
    """The tool-call format a conversation's template speaks (the generic one without a template)."""
    return format_of(template.source if template is not None else None)


def offer_tools(conv: Turns, turn: TurnSettings, thinking: Callable[[], bool]) -> ToolOffer | None:
    """What the reply is offered: the call grammar the model (local, or on llama-server) is
    held to once a call begins, quipu reading the calls; or, for a chat API, the tools, the
    server reading them. None when no call is to be read. `thinking()`: whether the prompt
    opens the reply's reasoning."""
    tools, choice = turn.tools, turn.tool_choice
    if not tools or choice == "none":
        return None
    offered = tools if choice in CHOICES else tuple(t for t in tools if t.name == choice)
    if not offered:
        raise UsageError(f"the tool choice {choice!r} is not one of the tools offered")
    if conv.template is None:  # a chat API: the server renders the tools and reads the calls
        return ToolOffer(tools=tools, choice=choice)
    grammar = tool_format(conv.template).call_grammar(offered, token_session(conv.session, "tools").special_tokens(),
                                                       conv.template.source or "", calls_made(conv.messages))
    forced = grammar is not None and choice != "auto"
    if grammar is not None and forced:
        grammar = _lead_to_call(conv, turn, grammar, offered[0], thinking())
    return ToolOffer(grammar, forced)


def _lead_to_call(conv: Turns, turn: TurnSettings, grammar: CallGrammar, tool: ToolSpec,
                  thinking: bool) -> CallGrammar:
    """A required call begins with what the template writes between the generation prompt
    and a call (Qwen 3.5's closing of the reasoning its prompt opened, GLM's empty
    reasoning): found by rendering the conversation with a call and reading the difference,
    so that the call renders back to the tokens it was written as. Where the prompt opened
    reasoning, the model reasons first and the call is forced once the reasoning ends."""
    before = conv.render(conv.messages, True, turn=turn).text
    call = {"id": "000000001", "type": "function", "function": {"name": tool.name, "arguments": {}}}

    def lead(content: str, reasoning: str | None = None) -> str | None:
        try:
            # (with its result after it: as the next turn renders it, not as a last message)
            made = Message("assistant", content, tool_calls=[call], reasoning=reasoning)
            after = conv.render([*conv.messages, made, Message("tool", "r", tool_call_id="000000001", name=tool.name)],
                                False, turn=turn).text
        except TemplateError:
            return None
        if not after.startswith(before):
            return None
        tail = after[len(before):]
        found = [(tail.find(t), t) for t in grammar.triggers if tail.find(t) >= 0]
        if not found:
            return None
        at, trigger = min(found)
        return tail[:at + len(trigger)]

    plain = lead("")
    fmt = conv.reasoning
    if thinking and fmt is not None:
        # (the reasoning as the model leaves it: a placeholder, then the template's close)
        reasoned = lead("", "R") if fmt.field else lead("R" + fmt.close)
        close = fmt.close
        if reasoned is not None and reasoned.lstrip().startswith("R") and close in reasoned:
            after = reasoned.split(close, 1)[1]
            # (where the call cannot wait for the model's reasoning, a server's, the
            # reasoning is closed at once)
            return replace(grammar, after_reasoning=after, force=plain if plain is not None else close + after)
    return grammar if plain is None else replace(grammar, force=plain)


def read_calls(conv: Turns, turn: TurnSettings, reply: Message, gen: Generation,
               opened: bool) -> tuple[Generation, Message]:
    """The reply just generated with its calls read (each with an id, its arguments as its tool's
    schema types them), and its message (`reply`, not yet in the conversation) holding them: the
    text before them and the calls, as the template renders them. `opened`: the reply began
    inside reasoning its prompt opened."""
    if conv.template is None:  # the server read them
        if not gen.tool_calls:
            return gen, reply
        calls = _numbered(conv.messages, gen.tool_calls)
        return replace(gen, tool_calls=calls), replace(reply, tool_calls=[c.to_message() for c in calls])
    parsed = parse_reply(conv.template.source, reply.written, conv.reasoning, inside=opened)
    if not parsed.tool_calls:
        return gen, reply
    calls = [replace(call, arguments=_as_schema(call.arguments, next((t for t in turn.tools if t.name == call.name),
                                                                      None)))
             for call in _numbered(conv.messages, parsed.tool_calls)]
    # The text before the calls, where the template writes the calls itself; a template that
    # writes no calls (the generic format, LFM2's first, Granite 3.3) is given the answer as
    # written, a forced beginning included.
    writes_calls = not tool_format(conv.template).generic and "tool_calls" in conv.template.source
    return (replace(gen, tool_calls=calls, answer=parsed.content),
            replace(reply, content=parsed.content if writes_calls else parsed.answer,
                    tool_calls=[c.to_message() for c in calls]))


def calls_made(messages: Sequence[Message]) -> int:
    return sum(len(m.tool_calls or ()) for m in messages)


def _numbered(messages: Sequence[Message], calls: Sequence[ToolCall]) -> list[ToolCall]:
    """The calls, each that came without an id given one: the count of calls in the
    conversation, in nine digits (what the strictest templates, Mistral's, accept)."""
    made = calls_made(messages)
    return [replace(call, id=call.id or f"{made + i + 1:09d}") for i, call in enumerate(calls)]


def _as_schema(arguments: dict[str, Any], tool: ToolSpec | None) -> dict[str, Any]:
    """A call's arguments with what the tool's schema types as a string kept a string: formats
    that write strings bare (`<parameter=code>\n123\n`) read `123` as a number."""
    props = (tool.parameters or {}).get("properties") if tool is not None else None
    if not isinstance(props, dict):
        return arguments
    out = dict(arguments)
    for key, value in arguments.items():
        schema = props.get(key)
        if isinstance(schema, dict) and schema.get("type") == "string" and not isinstance(value, str):
            out[key] = json.dumps(value, ensure_ascii=False)
    return out
