"""Stop strings: text is held back while it could still be the start of a stop string; and a
reply's text as its tokens come (`ReplyText`), with its stop strings held back."""

from __future__ import annotations

import re
from typing import Callable, Iterable, Sequence

from quipu.engine.text import Detokenizer

# The escapes llama.cpp's options read (`string_process_escapes`), and \uXXXX: any other
# backslash stays as it is written.
ESCAPE = re.compile(r"\\(?:([nrt'\"\\])|x([0-9A-Fa-f]{2})|u([0-9A-Fa-f]{4}))")
SIMPLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "'": "'", '"': '"', "\\": "\\"}


def read_escapes(text: str) -> str:
    """`text` as typed, its escapes read: \\n, \\r, \\t, \\\\, \\', \\", \\xHH and \\uXXXX (so
    `--stop "\\n\\n"` is a blank line, and `\\\\n` a backslash and an n)."""
    def one(match: re.Match[str]) -> str:
        simple, byte, unit = match.groups()
        if simple:
            return SIMPLE_ESCAPES[simple]
        code = int(byte or unit, 16)
        return match.group(0) if 0xD800 <= code <= 0xDFFF else chr(code)  # (half a surrogate pair is no text)

    return ESCAPE.sub(one, text)


def pending_prefix(text: str, marks: Iterable[str]) -> int:
    """How many characters at the end of `text` could be the start of one of `marks` (and so
    must be held back until the next text says whether it is)."""
    return max((n for mark in marks for n in range(min(len(mark) - 1, len(text)), 0, -1)
                if text.endswith(mark[:n])), default=0)


class StopMatcher:
    """Feeds generated text through; releases only text that cannot be part of a stop string."""

    def __init__(self, stops: list[str] | tuple[str, ...]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Returns the text that is safe to emit; sets `matched` when a stop string is complete."""
        if not self.stops:
            return text
        self._held += text
        first = None
        for stop in self.stops:
            at = self._held.find(stop)
            if at != -1 and (first is None or at < first[0]):
                first = (at, stop)
        if first is not None:
            at, self.matched = first
            out, self._held = self._held[:at], ""
            return out
        cut = len(self._held) - pending_prefix(self._held, self.stops)
        out, self._held = self._held[:cut], self._held[cut:]
        return out

    def flush(self) -> str:
        """The held-back text, once generation ended without completing a stop string."""
        out, self._held = self._held, ""
        return out


class ReplyText:
    """A reply's text as its tokens come: pieces decoded as UTF-8 (a character split across
    tokens waits for its end), stop strings held back until they cannot match."""

    def __init__(self, token_bytes: Callable[[int], bytes], carry: bytes = b"", stop: Sequence[str] = ()):
        self._detok = Detokenizer(token_bytes, carry)
        self._matcher = StopMatcher(list(stop))
        self._shown: list[str] = []
        self.tokens: list[int] = []

    @property
    def stopped(self) -> bool:
        return self._matcher.matched is not None

    @property
    def matched(self) -> str | None:
        """The stop string that ended the reply, if one did."""
        return self._matcher.matched

    @property
    def text(self) -> str:
        return "".join(self._shown)

    def push(self, token: int) -> str:
        """Takes a generated token (not end-of-generation); returns the text that may be shown now."""
        self.tokens.append(token)
        text = self._matcher.feed(self._detok.push(token))
        self._shown.append(text)
        return text

    def end(self, finish: str) -> tuple[str, str]:
        """The reply is over: (the text still to show, the finish reason). A character it was
        cut inside (by its length, or Ctrl-C) is left for a continuation to finish, not shown."""
        carry = self._detok.pending if finish in ("length", "interrupted") else b""
        if self.stopped:
            return "", finish
        tail = self._matcher.feed("" if carry else self._detok.flush())
        if self.stopped:
            finish = "stop_sequence"
        else:
            tail += self._matcher.flush()
        self._shown.append(tail)
        return tail, finish
