"""Reasoning and answer: a thinking model's reply opens with `<think>...</think>` (Qwen3, QwQ,
the DeepSeek-R1 distills, SmolLM3, GLM, Granite, ...), or its template opens the block in the
generation prompt and the reply starts inside it. The reply is kept whole in the conversation
(the template decides what to do with earlier reasoning); this splits it for showing."""

from __future__ import annotations

from quipu.sessions.base import ReplySink
from quipu.sessions.stops import pending_prefix

OPEN, CLOSE = "<think>", "</think>"


def starts_thinking(prompt_text: str) -> bool:
    """Whether a reply to this prompt starts inside a reasoning block the prompt opened."""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


class ThinkingSplitter:
    """Feeds a reply's text through as it streams; returns (is_reasoning, text) pieces. A block
    opens only at the start of a reply (after whitespace at most), so an answer that mentions
    the tag stays an answer; a tag split across pieces is held back until it is whole."""

    def __init__(self, thinking: bool = False):
        self.thinking = thinking
        self._held = ""
        self._may_open = not thinking  # a block may still open: nothing but whitespace so far
        self._after_close = False  # the whitespace after </think> is not part of the answer

    def feed(self, text: str) -> list[tuple[bool, str]]:
        self._held += text
        out: list[tuple[bool, str]] = []
        while self._held:
            tag = CLOSE if self.thinking else OPEN
            if not self.thinking and not self._may_open:
                out.append((False, self._held))
                self._held = ""
                break
            if not self.thinking and self._held.lstrip() and not tag.startswith(self._held.lstrip()[:len(tag)]):
                self._may_open = False  # the answer began without a block
                continue
            at = self._held.find(tag)
            if at >= 0:
                if self.thinking:
                    out.append((True, self._held[:at]))
                self._held = self._held[at + len(tag):]
                self.thinking = not self.thinking
                self._may_open = False
                self._after_close = not self.thinking
                continue
            keep = pending_prefix(self._held, (tag,))
            if self.thinking:
                out.append((True, self._held[:len(self._held) - keep]))
                self._held = self._held[len(self._held) - keep:]
            break
        return self._clean(out)

    def flush(self) -> list[tuple[bool, str]]:
        out, self._held = [(self.thinking, self._held)], ""
        return self._clean(out)

    def _clean(self, pieces: list[tuple[bool, str]]) -> list[tuple[bool, str]]:
        out = []
        for reasoning, text in pieces:
            if not reasoning and self._after_close:
                text = text.lstrip()
                self._after_close = not text
            if text:
                out.append((reasoning, text))
        return out


class ThinkingSink(ReplySink):
    """A reply sink that passes a thinking model's reasoning on as reasoning and the rest as the
    answer, and keeps both. `starts_thinking` is asked at the first piece, once the prompt is
    rendered (it may have opened a block)."""

    def __init__(self, sink, starts_thinking=lambda: False):
        self.sink = sink
        self._starts_thinking = starts_thinking
        self._splitter: ThinkingSplitter | None = None
        self.answer: list[str] = []
        self.reasoning_parts: list[str] = []

    def text(self, piece: str) -> None:
        if self._splitter is None:
            self._splitter = ThinkingSplitter(self._starts_thinking())
        if piece:
            self._emit(self._splitter.feed(piece))

    def reasoning(self, piece: str) -> None:
        self.reasoning_parts.append(piece)
        self.sink.reasoning(piece)

    def progress(self, done: int, total: int) -> None:
        self.sink.progress(done, total)

    def stopped(self) -> bool:
        return self.sink.stopped()

    def finish(self, gen):
        """The reply is over: `gen` with its answer and reasoning apart."""
        if self._splitter is not None:
            self._emit(self._splitter.flush())
            self._splitter = None
        gen.answer = "".join(self.answer)
        gen.reasoning = "".join(self.reasoning_parts).strip()
        return gen

    def _emit(self, pieces: list[tuple[bool, str]]) -> None:
        for is_reasoning, text in pieces:
            if is_reasoning:
                self.reasoning_parts.append(text)
                self.sink.reasoning(text)
            else:
                self.answer.append(text)
                self.sink.text(text)
