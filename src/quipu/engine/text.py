"""Token bytes to text, one piece at a time, without splitting multi-byte characters."""

from __future__ import annotations

import codecs
from typing import Callable


class Detokenizer:
    """Turns token ids into text incrementally; a character split across tokens comes out whole."""

    def __init__(self, piece: Callable[[int], bytes]):
        self._piece = piece
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._decoder.decode(self._piece(token))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
