"""Token bytes to text, one piece at a time, without splitting multi-byte characters; and a
vocabulary's control spellings found in a text."""

from __future__ import annotations

import codecs
import re
from typing import Callable, Iterable, Iterator


class Detokenizer:
    """Turns token ids into text incrementally; a character split across tokens comes out whole."""

    def __init__(self, piece: Callable[[int], bytes], carry: bytes = b""):
        """`carry`: the bytes of a character that earlier text began and did not finish."""
        self._piece = piece
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._decoder.setstate((carry, 0))

    def push(self, token: int) -> str:
        return self._decoder.decode(self._piece(token))

    @property
    def pending(self) -> bytes:
        """The bytes of an unfinished character, held back until the rest of it comes."""
        return self._decoder.getstate()[0]

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


def unfinished_character(pieces: list[bytes]) -> bytes:
    """The bytes at the end of `pieces` that begin a character without finishing it."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(b"".join(pieces))
    return decoder.getstate()[0]


class Spellings:
    """Literal spellings (control tokens' texts) found in a text leftmost-longest, as a regular
    expression of them all, longest first, finds them, without compiling one: by the few lengths
    that begin at each candidate character (an expression of Gemma 3's 6,250 control spellings
    took a tenth of a second to compile and matched a hundred times slower)."""

    def __init__(self, texts: Iterable[str]):
        self._set = frozenset(t for t in texts if t)
        lengths: dict[str, set[int]] = {}
        for text in self._set:
            lengths.setdefault(text[0], set()).add(len(text))
        self._lengths = {first: sorted(ns, reverse=True) for first, ns in lengths.items()}
        self._starts = re.compile("[" + "".join(re.escape(c) for c in sorted(lengths)) + "]") if lengths else None

    def spans(self, text: str) -> Iterator[tuple[int, int]]:
        """(start, end) of each spelling in `text`, left to right, the longest where several begin."""
        if self._starts is None:
            return
        at = 0
        while (found := self._starts.search(text, at)) is not None:
            start = at = found.start()
            for n in self._lengths[text[start]]:
                if start + n <= len(text) and text[start:start + n] in self._set:
                    yield start, start + n
                    at = start + n
                    break
            else:
                at = start + 1
