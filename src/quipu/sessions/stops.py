"""Stop strings: text is held back while it could still be the start of a stop string."""

from __future__ import annotations

from typing import Iterable


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
