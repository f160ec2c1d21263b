"""A conversation's turns with tools: what a reply is offered (the call grammar a local model or
llama-server is held to once a call begins, with what the template writes before a required
call; a chat API's tools), the calls a reply made read into its message, and the results given
back. A part of `Conversation` (`conversation.py`)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

from quipu.errors import TemplateError, UsageError
from quipu.sessions.base import SILENT, Generation, Message, ModelSession, ReplySink, ToolOffer
from quipu.sessions.call_grammars import CHOICES, CallGrammar
from quipu.sessions.tools import Format, format_of, parse_reply
from quipu.sessions.toolspec import ToolCall, ToolSpec

if TYPE_CHECKING:
    from quipu.sessions.prompt import Rendered
    from quipu.sessions.reasoning import ReasoningFormat
    from quipu.sessions.template import ChatTemplate


class ToolTurns:
    """`Conversation`'s turns with tools."""

    if TYPE_CHECKING:  # (what they use of the conversation)
        session: ModelSession
        template: ChatTemplate | None
        messages: list[Message]
        tools: list[Any]
        tool_choice: str

        @property
        def reasoning(self) -> ReasoningFormat | None: ...

        def render(self, messages: Sequence[Message], add_generation_prompt: bool, tail: str = "") -> Rendered: ...

        def answer(self, *, max_tokens: int, stop: Sequence[str] = (), sink: ReplySink = SILENT) -> Generation: ...

    @property
    def tool_format(self) -> Format:
        return format_of(self.template.source if self.template is not None else None)

    def _offer_tools(self, thinking: Callable[[], bool]) -> ToolOffer | None:
        """What the reply is offered: the call grammar the model (local, or on llama-server) is
        held to once a call begins, quipu reading the calls; or, for a chat API, the tools, the
        server reading them. None when no call is to be read."""
        if not self.tools or self.tool_choice == "none":
            return None
        offered = self.tools if self.tool_choice in CHOICES else [t for t in self.tools if t.name == self.tool_choice]
        if not offered:
            raise UsageError(f"--tool-choice names {self.tool_choice!r}, which is not one of the tools offered")
        if self.template is None:  # a chat API: the server renders the tools and reads the calls
            return ToolOffer(tools=tuple(self.tools), choice=self.tool_choice)
        grammar = self.tool_format.call_grammar(offered, self.session.special_tokens(), self.template.source or "",
                                                self._calls_made())
        forced = grammar is not None and self.tool_choice != "auto"
        if grammar is not None and forced:
            grammar = self._lead_to_call(grammar, offered[0], thinking())
        return ToolOffer(grammar, forced)

    def _lead_to_call(self, grammar: CallGrammar, tool: ToolSpec, thinking: bool) -> CallGrammar:
        """A required call begins with what the template writes between the generation prompt
        and a call (Qwen 3.5's closing of the reasoning its prompt opened, GLM's empty
        reasoning): found by rendering the conversation with a call and reading the difference,
        so that the call renders back to the tokens it was written as. Where the prompt opened
        reasoning, the model reasons first and the call is forced once the reasoning ends."""
        before = self.render(self.messages, True).text
        call = {"id": "000000001", "type": "function", "function": {"name": tool.name, "arguments": {}}}

        def lead(content: str, reasoning: str | None = None) -> str | None:
            try:
                # (with its result after it: as the next turn renders it, not as a last message)
                made = Message("assistant", content, tool_calls=[call], reasoning=reasoning)
                after = self.render([*self.messages, made,
                                     Message("tool", "r", tool_call_id="000000001", name=tool.name)], False).text
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
        fmt = self.reasoning
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

    def _read_calls(self, reply: Message, gen: Generation, opened: bool) -> None:
        """Reads the calls of the reply just generated into its message (and `gen.tool_calls`):
        the message then holds the text before them and the calls, as the template renders them.
        `opened`: the reply began inside reasoning its prompt opened."""
        if self.template is None:  # the server read them
            if gen.tool_calls:
                self._number(gen.tool_calls)
                reply.tool_calls = [c.to_message() for c in gen.tool_calls]
            return
        raw = reply.written
        parsed = parse_reply(self.template.source, raw, self.reasoning, inside=opened)
        if not parsed.tool_calls:
            return
        self._number(parsed.tool_calls)
        for call in parsed.tool_calls:
            call.arguments = _as_schema(call.arguments, next((t for t in self.tools if t.name == call.name), None))
        gen.tool_calls = parsed.tool_calls
        gen.answer = parsed.content
        reply.tool_calls = [c.to_message() for c in parsed.tool_calls]
        # The text before the calls, where the template writes the calls itself; a template that
        # writes no calls (the generic format, LFM2's first, Granite 3.3) is given the answer as
        # written, a forced beginning included.
        if not self.tool_format.generic and "tool_calls" in self.template.source:
            reply.content = parsed.content
        else:
            reply.content = parsed.answer

    def _calls_made(self) -> int:
        return sum(len(m.tool_calls or ()) for m in self.messages)

    def _number(self, calls: Sequence[ToolCall]) -> None:
        """An id for each call that came without one: the count of calls in the conversation, in
        nine digits (what the strictest templates, Mistral's, accept)."""
        made = self._calls_made()
        for i, call in enumerate(calls):
            call.id = call.id or f"{made + i + 1:09d}"

    def add_tool_results(self, results: Sequence[tuple[Any, str]]) -> None:
        """Each (call, its result's text) as a tool message, after the reply that made the calls."""
        for call, text in results:
            self.messages.append(Message("tool", text, tool_call_id=call.id, name=call.name))

    def reply_to_tools(self, *, max_tokens: int, stop: Sequence[str] = (), sink: ReplySink = SILENT) -> Generation:
        """Generates the model's next reply after the tools' results (no new user message)."""
        if not self.messages or self.messages[-1].role != "tool":
            raise UsageError("there is no tool result to reply to")
        return self.answer(max_tokens=max_tokens, stop=stop, sink=sink)


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
