"""A loaded model file and its vocabulary, shared by the contexts on it (llama.py)."""

from __future__ import annotations

import ctypes
from array import array
from pathlib import Path
from typing import Any, Callable, Iterable

from quipu.engine.native import lc

from quipu.engine.logs import LOG
from quipu.engine.placement import cached_blocks, model_params
from quipu.engine.settings import CPU, Placement
from quipu.engine.text import Spellings
from quipu.errors import EngineError, Interrupted, ModelLoadError

GGUF_MAGIC = b"GGUF"
_CONTROL_ATTRS = lc.LLAMA_TOKEN_ATTR_CONTROL | lc.LLAMA_TOKEN_ATTR_UNKNOWN
# Texts longer than this in all are searched for every control spelling rather than tokenized.
SHORT_TEXTS = 16384

_backend_ready = False


def init_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        LOG.install()
        lc.llama_backend_init()
        _backend_ready = True


def check_gguf(path: Path) -> None:
    """Refuses, with a message a user understands, anything that is not a readable GGUF file."""
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if path.is_dir():
        raise ModelLoadError(f"{path} is a directory, not a GGUF model file")
    if not path.is_file():
        raise ModelLoadError(f"{path} is not a regular file")
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror}") from exc
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF model file")


def load_interruptibly(path: Path, placement: Placement = CPU) -> Any:
    """llama.cpp's model load, given up on Ctrl-C: loading a large model takes seconds inside
    llama.cpp, where Python runs no signal handler, but its progress callback asks between
    tensors whether to go on. While it loads, Ctrl-C only says so; then `Interrupted`."""
    import signal

    asked: list[bool] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: asked.append(True))
    except ValueError:  # not the main thread: loads as it comes
        previous = None
    # The layers on the devices the placement names, the rest on the CPU.
    mparams, arrays = model_params(placement.gpu_layers, placement.handles, placement.split)
    keep = mparams.progress_callback = lc.llama_progress_callback(lambda progress, data: not asked)
    try:
        model = lc.llama_model_load_from_file(str(path).encode(), mparams)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        del keep, arrays
    if asked:
        if model:
            lc.llama_model_free(model)
        raise Interrupted("interrupted while loading the model")
    return model


class LlamaModel:
    """One loaded model file and its vocabulary. Contexts share it: each `LlamaBackend` on it
    holds a reference, and the model is freed when the last one is released."""

    def __init__(self, path: Path, placement: Placement = CPU):
        init_backend()
        self.path = Path(path)
        check_gguf(self.path)
        LOG.clear_errors()
        model = load_interruptibly(self.path, placement)
        if not model:
            raise ModelLoadError(f"llama.cpp could not load {self.path}{LOG.reason()}")
        self.ptr = model
        self.placement = placement
        self._refs = 0
        self.vocab = lc.llama_model_get_vocab(model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        # (a file's length that does not fit llama.cpp's 32-bit signed field reads negative: unknown)
        self.n_ctx_train = max(0, lc.llama_model_n_ctx_train(model))
        self.n_swa = lc.llama_model_n_swa(model)  # (0: no layer attends through a sliding window)
        # The layers that keep a cache of their own (not those that reuse an earlier layer's).
        self.arch = arch = self._meta("general.architecture")
        shared = self._meta(f"{arch}.attention.shared_kv_layers")
        self.n_layer_kv = cached_blocks(arch, int(lc.llama_model_n_layer(model)), int(shared) if shared.isascii() and shared.isdigit() else 0)
        self._pieces: dict[int, bytes] = {}
        self._max_token_bytes: int | None = None
        self._spellings_in: dict[str, set[str]] = {}  # (the short texts asked of already)
        self._controls: Spellings | None = None
        self._attrs: array[int] | None = None
        self._special_tokens: dict[str, int] | None = None
        self._guidance: Any = None  # llguidance's view of the vocabulary, once built (constraint.py)

    def _meta(self, key: str) -> str:
        """A metadata value of the model as text ("" where it has none)."""
        buf = ctypes.create_string_buffer(256)
        n = lc.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else ""

    def acquire(self) -> "LlamaModel":
        if self.ptr is None:
            raise EngineError("the model was already freed")
        self._refs += 1
        return self

    def release(self) -> None:
        self._refs -= 1
        if self._refs <= 0 and self.ptr is not None:
            lc.llama_model_free(self.ptr)
            self.ptr = None

    # ---- vocabulary ---------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (lc.llama_token * cap)()
        n = lc.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (lc.llama_token * cap)()
            n = lc.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            raise EngineError("llama.cpp could not tokenize the text")
        return list(buf[:n])

    def token_bytes(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            # A buffer of the call's own: requests on one model read their pieces from threads of
            # their own, and llama.cpp writes into the buffer with the interpreter let go.
            buf = ctypes.create_string_buffer(256)
            n = lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
            piece = buf.raw[:n]
            self._pieces[token] = piece
        return piece

    def token_text(self, token: int) -> bytes:
        """The token's text as a chat template writes it: control tokens spelled out."""
        if not self.is_control(token):
            return self.token_bytes(token)
        return lc.llama_vocab_get_text(self.vocab, token) or b""

    def is_control(self, token: int) -> bool:
        """A token that only parsing special text yields (`<|im_end|>`, `<s>`, ...), never plain text."""
        return 0 <= token < self.n_vocab and bool(lc.llama_vocab_get_attr(self.vocab, token) & _CONTROL_ATTRS)

    def control_spellings(self, texts: Iterable[str]) -> list[str]:
        """The spellings of control tokens that `texts` hold, longest first: in short texts (a
        chat's messages, asked of again each turn, remembered), what llama.cpp's tokenizer reads
        as control tokens there, which needs no list of them all (the pass over the vocabulary
        that makes one takes a fifth of a second on Gemma 3's 262k); in long ones, that list's."""
        texts = list(texts)
        if sum(map(len, texts)) > SHORT_TEXTS:
            spellings = self.controls()
            found = {text[start:end] for text in texts for start, end in spellings.spans(text)}
        else:
            found = set()
            for text in texts:
                spelled = self._spellings_in.get(text)
                if spelled is None:
                    tokens = self.tokenize(text, add_special=False, parse_special=True)
                    spelled = {self.token_text(t).decode("utf-8", "replace") for t in tokens
                               if self.is_control(t)} - {""}
                    if len(self._spellings_in) >= 1024:
                        self._spellings_in.clear()
                    self._spellings_in[text] = spelled
                found |= spelled
        return sorted(found, key=lambda s: (-len(s), s))

    def controls(self) -> Spellings:
        """Every control token's text, to find in a text (made on first use)."""
        if self._controls is None:
            self._controls = Spellings(self.token_text(t).decode("utf-8", "replace")
                                       for t, attr in enumerate(self.token_attrs()) if attr & _CONTROL_ATTRS)
        return self._controls

    def guidance(self, make: Callable[[LlamaModel], Any]) -> Any:
        """llguidance's view of the vocabulary, made by `make` the first time it is asked for
        (it reads every token once), then kept with the model."""
        if self._guidance is None:
            self._guidance = make(self)
        return self._guidance

    def token_attrs(self) -> array[int]:
        """Every token's attributes (`LLAMA_TOKEN_ATTR_*`), in order: read once, on first use, for
        all that look at the whole vocabulary (a call a token: a seventh of a second for 262k)."""
        if self._attrs is None:
            get_attr, vocab = lc.llama_vocab_get_attr, self.vocab
            self._attrs = array("I", (get_attr(vocab, t) for t in range(self.n_vocab)))
        return self._attrs

    def special_tokens(self) -> dict[str, int]:
        """{text: id} of the tokens llguidance treats as special: control tokens, and added tokens
        spelled `<...>` (as `constraint.tokenizer` marks them)."""
        if self._special_tokens is None:
            found: dict[str, int] = {}
            for t, attr in enumerate(self.token_attrs()):
                if attr & lc.LLAMA_TOKEN_ATTR_CONTROL or attr & lc.LLAMA_TOKEN_ATTR_USER_DEFINED:
                    text = (lc.llama_vocab_get_text(self.vocab, t) or b"").decode("utf-8", "replace")
                    if attr & lc.LLAMA_TOKEN_ATTR_CONTROL or (text.startswith("<") and text.endswith(">")):
                        found.setdefault(text, t)
            self._special_tokens = found
        return self._special_tokens

    def max_token_bytes(self) -> int:
        """The longest text any one token stands for."""
        if self._max_token_bytes is None:
            self._max_token_bytes = max(len(self.token_bytes(t)) for t in range(self.n_vocab))
        return self._max_token_bytes

    def is_eog(self, token: int) -> bool:
        return bool(lc.llama_vocab_is_eog(self.vocab, token))

    def bos_token(self) -> int | None:
        if not lc.llama_vocab_get_add_bos(self.vocab):
            return None
        bos = lc.llama_vocab_bos(self.vocab)
        return None if bos < 0 else bos

    def special_token_text(self, which: str) -> str:
        token = {"bos": lc.llama_vocab_bos, "eos": lc.llama_vocab_eos}[which](self.vocab)
        if token < 0:
            return ""
        text = lc.llama_vocab_get_text(self.vocab, token)
        return text.decode("utf-8", "replace") if text else ""

    def chat_template(self) -> str | None:
        raw = lc.llama_model_chat_template(self.ptr, None)
        return raw.decode("utf-8", "replace") if raw else None
