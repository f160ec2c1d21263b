"""Token bytes to text, one piece at a time, without splitting multi-byte characters."""

from __future__ import annotations

import codecs
from typing import Callable


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
