"""Where a reply streams while its reasoning is split from its answer: `ReasoningSink` passes
each on as it comes (markup taken out, control tokens included) and keeps both."""

from __future__ import annotations

from typing import Callable

from quipu.sessions.base import PassedOn, ReplySink
from quipu.sessions.reasoning import Splitter, Thinking

__all__ = ["ReasoningSink"]


class ReasoningSink(PassedOn):
    """A reply's sink that passes a thinking model's reasoning on as reasoning and the rest as the
    answer, its markup taken out (control tokens included), and keeps both as they streamed.
    `thinking` is asked at the first piece, once the prompt is rendered (it may open reasoning)."""

    def __init__(self, sink: ReplySink, thinking: Callable[[], Thinking]):
        super().__init__(sink)
        self._thinking = thinking
        self._splitter: Splitter | None = None
        self.answer: list[str] = []
        self.reasoning_parts: list[str] = []
        # The reasoning is passed on as the whole reply gives it, its ends' white space taken off:
        # what is held of it (white space after its last word so far), whether a word has come.
        self._held, self._begun = "", False

    def _split(self) -> Splitter:
        if self._splitter is None:
            self._splitter = self._thinking().splitter()
        return self._splitter

    def text(self, piece: str) -> None:
        self._emit(self._split().feed(piece))

    def control(self, spelling: str) -> None:
        self._emit(self._split().feed(spelling, control=True))

    def reasoning(self, piece: str) -> None:  # (a server that splits the reply itself)
        self.reasoning_parts.append(piece)
        if not self._begun:
            piece = piece.lstrip()
            self._begun = bool(piece)
        piece = self._held + piece
        shown = piece.rstrip()
        self._held = piece[len(shown):]
        if shown:
            self.sink.reasoning(shown)

    def finish(self) -> tuple[str, str]:
        """The reply is over: (its reasoning, its answer), as they streamed."""
        if self._splitter is not None:
            self._emit(self._splitter.flush())
        return "".join(self.reasoning_parts), "".join(self.answer)

    def _emit(self, pieces: list[tuple[bool, str]]) -> None:
        for is_reasoning, text in pieces:
            if is_reasoning:
                self.reasoning(text)
            else:
                self.answer.append(text)
                self.sink.text(text)
