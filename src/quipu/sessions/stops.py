"""Stop strings: text is held back while it could still be the start of a stop string."""

from __future__ import annotations


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
        keep = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self._held)), 0, -1):
                if self._held.endswith(stop[:n]):
                    keep = max(keep, n)
                    break
        cut = len(self._held) - keep
        out, self._held = self._held[:cut], self._held[cut:]
        return out

    def flush(self) -> str:
        """The held-back text, once generation ended without completing a stop string."""
        out, self._held = self._held, ""
        return out
