"""A context's vocabulary: its model's, as the context's history spells it, a medium's
placeholder tokens (`media.py`) read as the medium's mark. A part of `LlamaBackend` (`llama.py`),
held by the caller as `backend.vocab`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from quipu.engine.media import is_media

if TYPE_CHECKING:
    from quipu.engine.media import Media
    from quipu.engine.model import LlamaModel
    from quipu.engine.text import Spellings


class Vocabulary:
    """`model`'s vocabulary, with `media`'s tokens."""

    def __init__(self, model: LlamaModel, media: Media):
        self._model = model
        self._media = media

    @property
    def n_vocab(self) -> int:
        return int(self._model.n_vocab)

    def media_tokens(self, k: int) -> list[int]:
        """The tokens of the k-th medium the context holds (LookupError for none)."""
        return self._media.media_tokens(k)

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return self._model.tokenize(text, add_special=add_special, parse_special=parse_special)

    def token_bytes(self, token: int) -> bytes:
        return self._media.media_text(token) if is_media(token) else self._model.token_bytes(token)

    def token_text(self, token: int) -> bytes:
        return self._media.media_text(token) if is_media(token) else self._model.token_text(token)

    def is_control(self, token: int) -> bool:
        return not is_media(token) and self._model.is_control(token)

    def max_token_bytes(self) -> int:
        return self._model.max_token_bytes()

    def control_spellings(self, texts: Sequence[str]) -> list[str]:
        return self._model.control_spellings(texts)

    def controls(self) -> Spellings:
        return self._model.controls()

    def special_tokens(self) -> dict[str, int]:
        return self._model.special_tokens()

    def is_eog(self, token: int) -> bool:
        return self._model.is_eog(token)

    def bos_token(self) -> int | None:
        return self._model.bos_token()

    def special_token_text(self, which: str) -> str:
        return self._model.special_token_text(which)

    def chat_template(self) -> str | None:
        return self._model.chat_template()
