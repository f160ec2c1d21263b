"""From a conversation's rendered text to context tokens.

The reference is the template's whole text tokenized once, special tokens parsed (as llama.cpp's
server does), so that message text meets the template's text exactly as in training. Two
departures, each kept as small as it can be:

- Text a user typed that spells a control token (`<|im_end|>`, `<|eot_id|>`, ...) stays text:
  the messages are rendered with such spellings swapped for private markers, and only there is
  the text cut, the spelling tokenized as plain text.
- Tokens already in the context are kept as far as they spell the new text and end where the
  reference would end a piece (after a control token, or where one comes next): replies keep
  the tokens the model generated, and a turn reads only what is new, or what the template
  changed (a template that drops earlier reasoning is re-read from where it first differs).
"""

from __future__ import annotations

import codecs
import re
import secrets
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, Sequence

from quipu.engine.base import MEDIA_MARK, Backend
from quipu.engine.text import Spellings


class Vocabulary(Protocol):
    """What turns a rendering (or --logit-bias's tokens) into token ids: a local context's
    (`Backend.vocab`) or llama-server's (`LlamaServerModel`)."""

    @property
    def n_vocab(self) -> int: ...

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]: ...
    def bos_token(self) -> int | None: ...
    def chat_template(self) -> str | None: ...
    def special_token_text(self, which: str) -> str: ...
    def media_tokens(self, k: int) -> list[int]: ...


class Sized(Protocol):
    """A context, by its size."""

    n_ctx: int


@dataclass
class Rendered:
    """Rendered text as parts: (text, True) for a user's spelling of a control token, which is
    tokenized as plain text; (text, False) for everything else, tokenized with specials parsed."""

    parts: list[tuple[str, bool]]

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.parts)

    def tokenize_from(self, vocab: "Vocabulary", start: int) -> list[int]:
        """The tokens of this text from character `start` on."""
        tokens: list[int] = []
        at = 0
        for text, plain in self.parts:
            if at + len(text) > start:
                piece = text[max(0, start - at):]
                if plain:
                    tokens += vocab.tokenize(piece, add_special=False, parse_special=False)
                else:
                    tokens += _with_media(vocab, piece)
            at += len(text)
        return tokens

    def plain_at(self, offset: int) -> bool:
        """Whether character `offset` falls inside a user's spelling of a control token."""
        at = 0
        for text, plain in self.parts:
            if at <= offset < at + len(text):
                return plain
            at += len(text)
        return False


def _with_media(vocab: "Vocabulary", text: str) -> list[int]:
    """Rendered text as tokens (specials parsed), each medium's marker as the medium's tokens
    (`media_tokens` raises LookupError for a marker of none)."""
    tokens: list[int] = []
    at = 0
    for found in MEDIA_MARK.finditer(text):
        try:
            media = vocab.media_tokens(int(found.group(1)))
        except LookupError:  # (not a medium this context holds: text that looks like a marker)
            continue
        if found.start() > at:
            tokens += vocab.tokenize(text[at:found.start()], add_special=False, parse_special=True)
        tokens += media
        at = found.end()
    if at < len(text):
        tokens += vocab.tokenize(text[at:], add_special=False, parse_special=True)
    return tokens


class Protector:
    """Swaps a user's spellings of control tokens for markers before rendering, and back after."""

    def __init__(self, control_texts: Sequence[str]):
        self._controls = Spellings(control_texts)
        self._nonce = secrets.token_hex(6)
        self._spelled: list[str] = []

    def hide(self, text: str) -> str:
        parts, at = [], 0
        for start, end in self._controls.spans(text):
            self._spelled.append(text[start:end])
            parts += [text[at:start], f"\ue000{self._nonce}:{len(self._spelled) - 1}\ue001"]
            at = end
        return "".join(parts) + text[at:] if parts else text

    def reveal(self, rendered: str) -> Rendered:
        if not self._spelled:
            return Rendered([(rendered, False)])
        parts: list[tuple[str, bool]] = []
        for i, piece in enumerate(re.split(f"\ue000{self._nonce}:(\\d+)\ue001", rendered)):
            if i % 2:
                parts.append((self._spelled[int(piece)], True))
            elif piece:
                parts.append((piece, False))
        return Rendered(parts)


def reference_tokens(vocab: "Vocabulary", rendered: Rendered) -> list[int]:
    """The whole text tokenized as the reference does, with the model's BOS where it wants one
    and the template did not write it."""
    tokens = rendered.tokenize_from(vocab, 0)
    bos = vocab.bos_token()
    if bos is not None and (not tokens or tokens[0] != bos):
        tokens.insert(0, bos)
    return tokens


def reusable(backend: Backend, held: Sequence[int], rendered: Rendered) -> tuple[int, int]:
    """(k, n): the first k tokens held in the context spell the first n characters of the text
    and end where the reference ends a piece, so `held[:k]` + the tokens of the text from
    character n on is a context for it. (0, 0) when nothing can be kept.

    The held tokens are spelled as a reply's text was made from them (bytes decoded as they
    come, a broken character as U+FFFD), so a reply cut inside a character still matches."""
    text = rendered.text
    # Where a control token's text starts (and is not a user's spelling): the reference starts a
    # piece there. Found when first asked (a context that holds nothing asks nothing).
    starts: list[set[int]] = []

    def piece_ends_at(pos: int) -> bool:
        if pos == len(text):
            return True
        if not starts:
            found = {start for start, _ in backend.vocab.controls().spans(text)}
            for medium in MEDIA_MARK.finditer(text):  # (a medium is a piece of its own)
                found |= {medium.start(), medium.end()}
            starts.append(found)
        return pos in starts[0] and not rendered.plain_at(pos)

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    best, pos, start = (0, 0), 0, 0
    bos = backend.vocab.bos_token()
    bos_text = backend.vocab.token_text(bos).decode("utf-8", "replace") if bos is not None else ""
    if held and bos is not None and held[0] == bos and not text.startswith(bos_text):
        best, start = (1, 0), 1  # the BOS the model adds and the template does not write
    after_control = True
    k = start
    while k < len(held):
        # A medium's marker in the text stands for its tokens: its projector's wrapping and its
        # run of placeholders, held as one piece.
        marker = MEDIA_MARK.match(text, pos) if not decoder.getstate()[0] else None
        if marker is not None and not rendered.plain_at(pos):
            try:
                run = backend.vocab.media_tokens(int(marker.group(1)))
            except LookupError:
                run = []
            if run and list(held[k:k + len(run)]) == run:
                k, pos, after_control = k + len(run), marker.end(), True
                best = (k, pos)
                continue
        token = held[k]
        control = backend.vocab.is_control(token)
        if control:
            piece = decoder.decode(b"", final=True) + backend.vocab.token_text(token).decode("utf-8", "replace")
        else:
            piece = decoder.decode(backend.vocab.token_bytes(token))
        if not text.startswith(piece, pos):
            # SentencePiece writes a space before text that follows a control token; the text has none.
            if not (after_control and piece.startswith(" ") and text.startswith(piece[1:], pos)):
                break
            piece = piece[1:]
            if not piece:
                after_control = control
                k += 1
                continue  # (that space alone: the text's own tokens, read again from here, write it anew)
        after_control = control
        pos += len(piece)
        k += 1
        if decoder.getstate()[0]:
            continue  # inside a character: no boundary here
        if (control and piece and not rendered.plain_at(pos - 1)) or piece_ends_at(pos):
            best = (k, pos)
    else:
        # The held tokens end inside a character: a reply cut there shows none of it (and a
        # continuation finishes it), or shows it as U+FFFD.
        if decoder.getstate()[0] and piece_ends_at(pos):
            best = (len(held), pos)
        tail = decoder.decode(b"", final=True)
        if tail and text.startswith(tail, pos) and piece_ends_at(pos + len(tail)):
            best = (len(held), pos + len(tail))
    return best


def context_tokens(backend: Backend, held: Sequence[int], rendered: Rendered) -> list[int]:
    """The context for `rendered`, keeping what `held` has of it."""
    k, n = reusable(backend, held, rendered)
    if k == 0:
        return reference_tokens(backend.vocab, rendered)
    return list(held[:k]) + rendered.tokenize_from(backend.vocab, n)


class HeldTokens:
    """The base of a session whose context is exact tokens on a backend with a vocabulary (a
    local context, llama-server's): its backend and its tokens, its own from its constructor, and
    what such a session answers alike of them: its size, the model's template and special
    tokens, a rendering or a plain prompt as tokens."""

    def __init__(self, backend: Sized, vocab: Vocabulary) -> None:
        self.backend = backend
        self.vocab = vocab
        self.tokens: list[int] = []

    @property
    def n_ctx(self) -> int:
        return self.backend.n_ctx

    @property
    def used(self) -> int:
        return len(self.tokens)

    def chat_template(self) -> str | None:
        return self.vocab.chat_template()

    def special_token_text(self, which: str) -> str:
        return self.vocab.special_token_text(which)

    def reference_tokens(self, rendered: Rendered) -> list[int]:
        return reference_tokens(self.vocab, rendered)

    def undecode(self, n: int) -> None:
        """Keeps the tokens from `n` on but not their cells (a server's context: its own to read)."""

    def raw_tokens(self, text: str) -> list[int]:
        return self.vocab.tokenize(text, add_special=True, parse_special=False)


def strings_of(value: Any) -> Iterator[str]:
    """Every string JSON holds, keys included (walked without recursion)."""
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            todo += item.keys()
            todo += item.values()
        elif isinstance(item, (list, tuple)):
            todo += item


def hidden(value: Any, hide: Callable[[str], str]) -> Any:
    """JSON with `hide` applied to each string in it, keys included."""
    if isinstance(value, str):
        return hide(value)
    if isinstance(value, dict):
        return {hide(k) if isinstance(k, str) else k: hidden(v, hide) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [hidden(v, hide) for v in value]
    return value
