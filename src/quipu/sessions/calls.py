"""A reply that may make tool calls, as it streams: where a call begins (`TriggerWatch`), the
text shown up to there and none after (`CallSink`), and, for a server that samples its own
tokens, the grammar it is to hold the call to (`server_constraint`). The formats themselves,
and the grammars of their calls, are the table's of `quipu.sessions.tools`."""

from __future__ import annotations

import re
from typing import Callable, Sequence

from quipu.engine.base import CallConstraint
from quipu.sessions.base import PassedOn, ReplySink
from quipu.sessions.stops import pending_prefix
from quipu.sessions.call_grammars import CallGrammar
from quipu.sessions.reasoning import Thinking

class TriggerWatch:
    """Watches a reply's text (control tokens spelled out) for the text that begins a call,
    outside reasoning (in the reply's format); says where it began, once."""

    def __init__(self, triggers: Sequence[str], thinking: Thinking):
        self.triggers = tuple(triggers)
        self.text = ""
        self.fired_at: int | None = None  # where in `text` the trigger began
        self._split = thinking.splitter()
        self._controls: list[tuple[int, int]] = []  # where control tokens are spelled in `text`

    def push(self, piece: str, control: bool = False) -> bool:
        """Adds a token's text (a control token's spelling); True when this completes a trigger."""
        if control:
            self._controls.append((len(self.text), len(self.text) + len(piece)))
        self.text += piece
        if self.fired_at is not None:
            return False
        self._split.feed(piece)
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

    def plain(self, end: int) -> str:
        """`text[:end]` without the control tokens' spellings: as a reply's text shows it."""
        out, at = [], 0
        for start, stop in self._controls:
            if start >= end:
                break
            out.append(self.text[at:start])
            at = stop
        out.append(self.text[at:end] if at < end else "")
        return "".join(out)

    def after_reasoning(self) -> str | None:
        """The text after the reasoning's end (None while the reasoning goes on)."""
        visible = self._outside_reasoning()
        return None if visible is None else visible[1]

    def _outside_reasoning(self) -> tuple[int, str] | None:
        start = self._split.outside_from
        if start is None or self._split.in_reasoning:
            return None
        return start, self.text[start:]


class CallSink(PassedOn):
    """A reply's sink while tools are offered: text goes on to `sink` until a call begins (a
    text that might be the start of a trigger is held back until it is known not to be); from
    there on nothing more is shown. `shown` counts what went on to `sink`."""

    def __init__(self, sink: ReplySink, grammar: CallGrammar, thinking: Thinking):
        super().__init__(sink)
        self.watch = TriggerWatch(grammar.triggers, thinking)
        self.held = ""
        self._controls: list[tuple[int, str]] = []  # control tokens held back, and where in `held`
        self.calling = False
        self.shown = 0

    def begin(self) -> None:
        """A call begins: what is held back is the call's."""
        self.calling = True
        self.held = ""
        self._controls = []

    def text(self, text: str) -> None:
        if self.calling:
            return
        self.held += text
        keep = pending_prefix(self.held, self.watch.triggers)
        if len(self.held) > keep:
            self._release(len(self.held) - keep)

    def control(self, spelling: str) -> None:
        if self.calling:
            return
        if self.held:  # (in order with the text held back before it)
            self._controls.append((len(self.held), spelling))
        else:
            self.sink.control(spelling)

    def _release(self, n: int) -> None:
        """Passes on the first `n` characters held back, and the control tokens among them."""
        at = 0
        while self._controls and self._controls[0][0] <= n:
            where, spelling = self._controls.pop(0)
            if where > at:
                self.sink.text(self.held[at:where])
            self.sink.control(spelling)
            at = where
        if n > at:
            self.sink.text(self.held[at:n])
        self.shown += n
        self.held = self.held[n:]
        self._controls = [(where - n, spelling) for where, spelling in self._controls]

    def end(self) -> int | None:
        """The reply is done: where its call began in what was shown (None: it made none)."""
        if self.held and not self.calling:
            self._release(len(self.held))  # (the control tokens held back among it too)
        self.held, self._controls = "", []
        return self.shown if self.calling else None


class TextCallSink(CallSink):
    """A `CallSink` that finds the call's trigger in the text itself (a server's reply, whose
    tokens come with it)."""

    def __init__(self, sink: ReplySink, grammar: CallGrammar, thinking: Thinking, forced: bool):
        super().__init__(sink, grammar, thinking)
        if forced and not grammar.forced:
            self.begin()  # (the call starts with the reply: its trigger ends the prompt)

    def text(self, text: str) -> None:
        if self.calling:
            return
        if self.watch.push(text):
            self.held += text
            self._fired()
            return
        super().text(text)

    def control(self, spelling: str) -> None:
        if self.calling:
            return
        if self.watch.push(spelling, control=True):
            self._fired()
            return
        super().control(spelling)

    def _fired(self) -> None:
        """Shown: what came before the trigger."""
        before = self.watch.plain(self.watch.fired_at or 0)
        if len(before) > self.shown:
            self._release(min(len(before) - self.shown, len(self.held)))
        self.begin()


def _ecma(text: str) -> str:
    """`text` as a literal in an ECMAScript regular expression (llama.cpp's std::regex)."""
    return re.sub(r"([\\^$.*+?()\[\]{}|/])", r"\\\1", text)


def server_constraint(grammar: CallGrammar, forced: bool, thinking: Thinking,
                      specials_in: Callable[[str], dict[str, int]]) -> CallConstraint:
    """What a server that samples its own tokens (llama-server) is to hold a reply to: the call
    grammar from its trigger on, awaited outside reasoning (a lazy grammar); or, for a required
    call, the call from the start, after what the template writes before one (the close of the
    reasoning the prompt opened, where it did). `specials_in(text)`: the model's special tokens a text
    spells ({spelling: id}), written as those tokens."""
    from quipu.engine.gbnf import lark_to_gbnf, spelled as gbnf_spelled

    def spelled(text: str) -> str:
        return gbnf_spelled(text, specials_in(text))

    trigger = grammar.triggers[0]
    if forced:  # (from the start: a server cannot be kept from ending its reply inside reasoning)
        return CallConstraint(lark_to_gbnf(grammar.forced_lark or grammar.lark, spelled(grammar.forced)))
    fmt = thinking.fmt
    if fmt is None:
        before = ""
    elif thinking.inside:
        before = f"[\\s\\S]*?{_ecma(fmt.close)}"
    else:  # (a reasoning block the model opens is passed whole: no call begins inside it)
        open_, close = fmt.opens[0], fmt.close
        before = f"(?:\\s*{_ecma(open_)}[\\s\\S]*?{_ecma(close)}|(?!\\s*{_ecma(open_)}))"
    return CallConstraint(lark_to_gbnf(grammar.lark, spelled(trigger)), lazy=True,
                          trigger=f"{before}[\\s\\S]*?({_ecma(trigger)})[\\s\\S]*")
