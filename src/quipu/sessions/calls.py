"""A reply that may make tool calls, as it streams: where a call begins (`TriggerWatch`), the
text shown up to there and none after (`CallSink`), and, for a server that samples its own
tokens, the grammar it is to hold the call to (`server_constraint`). The formats themselves,
and the grammars of their calls, are `quipu.sessions.tools`'s."""

from __future__ import annotations

import re
from typing import Callable, Sequence

from quipu.engine.base import CallConstraint
from quipu.sessions.base import ReplySink
from quipu.sessions.stops import pending_prefix
from quipu.sessions.call_grammars import CallGrammar
from quipu.sessions.tools import REASONING

class TriggerWatch:
    """Watches a reply's text (control tokens spelled out) for the text that begins a call,
    outside reasoning; says where it began, once."""

    def __init__(self, triggers: Sequence[str], starts_thinking: bool = False):
        self.triggers = tuple(triggers)
        self.text = ""
        self.fired_at: int | None = None  # where in `text` the trigger began
        self._thinking = starts_thinking

    def push(self, piece: str) -> bool:
        """Adds a token's text; True when this completes a trigger."""
        if self.fired_at is not None:
            self.text += piece
            return False
        self.text += piece
        visible = self._outside_reasoning()
        if visible is None:
            return False
        offset, tail = visible
        for trigger in self.triggers:
            at = tail.find(trigger)
            if at >= 0:
                self.fired_at = offset + at
                return True
        return False

    def after_reasoning(self) -> str | None:
        """The text after the reasoning's end (None while the reasoning goes on)."""
        visible = self._outside_reasoning()
        return None if visible is None else visible[1]

    def _outside_reasoning(self) -> tuple[int, str] | None:
        text = self.text
        for open_, close in REASONING:
            stripped = text.lstrip()
            if self._thinking or stripped.startswith(open_) or (open_.startswith(stripped) and stripped):
                end = text.find(close)
                if end < 0:
                    return None
                return end + len(close), text[end + len(close):]
        return 0, text


class CallSink(ReplySink):
    """A reply's sink while tools are offered: text goes on to `sink` until a call begins (a
    text that might be the start of a trigger is held back until it is known not to be); from
    there on nothing more is shown. `shown` counts what went on to `sink`."""

    def __init__(self, sink: ReplySink, grammar: CallGrammar, starts_thinking: bool):
        self.sink = sink
        self.watch = TriggerWatch(grammar.triggers, starts_thinking)
        self.held = ""
        self.calling = False
        self.shown = 0

    def begin(self) -> None:
        """A call begins: what is held back is the call's."""
        self.calling = True
        self.held = ""

    def text(self, text: str) -> None:
        if self.calling:
            return
        self.held += text
        keep = pending_prefix(self.held, self.watch.triggers)
        if len(self.held) > keep:
            self.sink.text(self.held[:len(self.held) - keep])
            self.shown += len(self.held) - keep
            self.held = self.held[len(self.held) - keep:]

    def reasoning(self, text: str) -> None:
        self.sink.reasoning(text)

    def progress(self, done: int, total: int) -> None:
        self.sink.progress(done, total)

    def stopped(self) -> bool:
        return self.sink.stopped()

    def end(self) -> int | None:
        """The reply is done: where its call began in what was shown (None: it made none)."""
        if self.held and not self.calling:
            self.sink.text(self.held)
            self.shown += len(self.held)
        self.held = ""
        return self.shown if self.calling else None


class TextCallSink(CallSink):
    """A `CallSink` that finds the call's trigger in the text itself (a server's reply, whose
    tokens come with it)."""

    def __init__(self, sink: ReplySink, grammar: CallGrammar, starts_thinking: bool, forced: bool):
        super().__init__(sink, grammar, starts_thinking)
        if forced and not grammar.forced:
            self.begin()  # (the call starts with the reply: its trigger ends the prompt)

    def text(self, text: str) -> None:
        if self.calling:
            return
        if self.watch.push(text):  # shown: what came before the trigger
            before = self.watch.text[:self.watch.fired_at]
            if len(before) > self.shown:
                self.sink.text(before[self.shown:])
                self.shown = len(before)
            self.begin()
            return
        super().text(text)


def _ecma(text: str) -> str:
    """`text` as a literal in an ECMAScript regular expression (llama.cpp's std::regex)."""
    return re.sub(r"([\\^$.*+?()\[\]{}|/])", r"\\\1", text)


def server_constraint(grammar: CallGrammar, forced: bool, starts_thinking: bool,
                      specials_in: Callable[[str], dict[str, int]]) -> CallConstraint:
    """What a server that samples its own tokens (llama-server) is to hold a reply to: the call
    grammar from its trigger on, awaited outside reasoning (a lazy grammar); or, for a required
    call, the call from the start, after what the template writes before one (the close of the
    reasoning the prompt opened, where it did). `specials_in(text)`: the model's special tokens a text
    spells ({spelling: id}), written as those tokens."""
    from quipu.engine.gbnf import lark_to_gbnf, spelled as gbnf_spelled

    def spelled(text: str) -> str:
        return gbnf_spelled(text, specials_in(text))

    open_, close = REASONING[0]
    trigger = grammar.triggers[0]
    if forced:  # (from the start: a server cannot be kept from ending its reply inside reasoning)
        return CallConstraint(lark_to_gbnf(grammar.forced_lark or grammar.lark, spelled(grammar.forced)))
    if starts_thinking:
        before = f"[\\s\\S]*?{_ecma(close)}"
    else:  # (a reasoning block the model opens is passed whole: no call begins inside it)
        before = f"(?:\\s*{_ecma(open_)}[\\s\\S]*?{_ecma(close)}|(?!\\s*{_ecma(open_)}))"
    return CallConstraint(lark_to_gbnf(grammar.lark, spelled(trigger)), lazy=True,
                          trigger=f"{before}[\\s\\S]*?({_ecma(trigger)})[\\s\\S]*")
