"""Images and audio in a context, through llama.cpp's multimodal library (mtmd) and the model's
projector (an `mmproj` GGUF).

A medium in the context is a run of positions holding the embeddings its projector made of it.
The token history keeps that run as placeholder ids, `MEDIA_BASE + k * MEDIA_SPAN + i` (k: the
medium's place in this context's list of media, i: the position in its run), which no vocabulary
has. The run's last placeholder spells the medium's marker (`media_mark(k)`) and the others
nothing, so a rendering that holds the same medium in the same place keeps the run, and one that
holds another reads on from there. The projector's own wrapping (Gemma 3's `<start_of_image>`
... `<end_of_image>`) is text around the run, as mtmd tokenizes it. On an M-RoPE model
(Qwen2-VL's kind) a medium takes fewer positions than cells, and the context's positions are
kept apart from the history's indices (`position`)."""

from __future__ import annotations

import ctypes
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from quipu.engine.base import MEDIA_BASE, MEDIA_SPAN, media_mark
from quipu.engine.logs import LOG
from quipu.engine.native import lc
from quipu.errors import EngineError, ModelLoadError, UsageError

if TYPE_CHECKING:
    from quipu.engine.llama_context import NativeContext


def _mtmd() -> Any:
    from quipu.engine.native import load_mtmd

    return load_mtmd()


@dataclass
class _Medium:
    digest: str
    chunks: Any  # the mtmd chunks its marker was tokenized into (freed with the context)
    chunk: Any  # the media chunk among them
    before: list[int]  # the text tokens the projector wraps it in
    after: list[int]
    n: int  # the cells it takes (its placeholders)
    n_pos: int  # the positions it moves the context on by: n, or fewer on an M-RoPE model


class Projector:
    """A projector loaded for a text model: what it takes (images, audio), and its mtmd context."""

    def __init__(self, path: Path, model_ptr: Any, n_threads: int, device: int | None = None):
        m = _mtmd()
        LOG.install_media()
        params = m.mtmd_context_params_default()
        # On the model's first device where its layers are offloaded, else on the CPU.
        params.use_gpu = device is not None
        params.device = device
        params.n_threads = n_threads
        params.print_timings = False
        params.warmup = False
        LOG.clear_errors()
        ptr = m.mtmd_init_from_file(str(path).encode(), model_ptr, params)
        if not ptr:
            raise ModelLoadError(f"llama.cpp could not load the projector {path}{LOG.reason()}")
        self.ptr = ptr
        self.path = path
        self.sees = bool(m.mtmd_support_vision(ptr))
        self.hears = bool(m.mtmd_support_audio(ptr))

    def close(self) -> None:
        if self.ptr:
            _mtmd().mtmd_free(self.ptr)
            self.ptr = None


class Positions:
    """Where the tokens of a context's history sit in it. On an M-RoPE model (Qwen2-VL's kind) an
    image's cells all sit at the position it starts at, and the text after it goes on `n_pos`
    positions later, fewer than its cells: a token's position is its index in the history less
    what the media before it saved. `_runs` holds, for each such medium in the context, (its
    first index, its end, its position, what the media up to its end have saved); elsewhere it
    stays empty and a position is an index."""

    def __init__(self) -> None:
        self._runs: list[tuple[int, int, int, int]] = []

    def moved(self, at: int, medium: _Medium) -> None:
        """Medium `medium` was read from the history's index `at` on."""
        if medium.n_pos == medium.n:
            return
        saved = (self._runs[-1][3] if self._runs else 0) + medium.n - medium.n_pos
        self._runs.append((at, at + medium.n, self.position(at), saved))

    def position(self, index: int) -> int:
        """The position in the context of the token at `index` of the history."""
        saved = 0
        for start, end, pos, total in self._runs:
            if index < start:
                break
            if index < end:
                return pos
            saved = total
        return index - saved

    def index_after(self, last_position: int) -> int:
        """How many tokens of the history the context holds, from its last position."""
        saved = 0
        for _start, end, pos, total in self._runs:
            if last_position == pos:
                return end  # (it ends with this medium: its cells are all at its position)
            if last_position < pos:
                break
            saved = total
        return last_position + 1 + saved

    @property
    def moved_any(self) -> bool:
        """Whether a medium the context holds takes fewer positions than cells."""
        return bool(self._runs)

    def forget(self, n_keep: int) -> None:
        """The media past the first `n_keep` tokens of the history are gone from the context."""
        self._runs[:] = [r for r in self._runs if r[1] <= n_keep]

    def clear(self) -> None:
        self._runs.clear()


class Media:
    """A context's media: its projector, the media it holds, their placeholders in the token
    history, and their decoding (where they sit: `positions`)."""

    def __init__(self, native: NativeContext, positions: Positions):
        self._native = native
        self._positions = positions
        self._projector: Projector | None = None
        self._media: list[_Medium] = []

    def open_projector(self, path: Path) -> None:
        self.close()
        placement = self._native.model.placement
        self._projector = Projector(path, self._native.model.ptr, self._native.threads,
                                    placement.handles[0] if placement.on_device else None)

    def close(self) -> None:
        """Frees the media's chunks and the projector."""
        self.drop_media_after(0)
        if self._projector is not None:
            self._projector.close()
            self._projector = None

    @property
    def senses(self) -> frozenset[str]:
        """What this context can be given besides text: "image", "audio"."""
        p = self._projector
        if p is None:
            return frozenset()
        return frozenset(k for k, on in (("image", p.sees), ("audio", p.hears)) if on)

    def media_mark(self, data: bytes) -> str:
        """The marker of a medium (an image's or a recording's file bytes) in a rendering: the
        same bytes, the same marker, in this context."""
        if self._projector is None:
            raise UsageError("this model has no projector")
        digest = hashlib.sha256(data).hexdigest()
        for k, medium in enumerate(self._media):
            if medium.digest == digest:
                return media_mark(k)
        self._media.append(self._tokenized(data, digest))
        return media_mark(len(self._media) - 1)

    def _tokenized(self, data: bytes, digest: str) -> _Medium:
        m = _mtmd()
        assert self._projector is not None
        ptr = self._projector.ptr
        buf = (ctypes.c_ubyte * len(data)).from_buffer_copy(data)
        bitmap = m.mtmd_helper_bitmap_init_from_buf(ptr, buf, len(data), False)
        if not bitmap:  # (what llama.cpp logs then is about the video reader it tries last)
            raise UsageError("llama.cpp could not decode it: the file is damaged, or of a kind its readers do not know")
        chunks = m.mtmd_input_chunks_init()
        try:
            marker = m.mtmd_default_marker()
            text = m.mtmd_input_text(marker, len(marker), False, True)
            rc = m.mtmd_tokenize(ptr, chunks, ctypes.byref(text), (m.mtmd_bitmap_p_ctypes * 1)(bitmap), 1)
            if rc != 0:
                raise UsageError(f"the projector cannot take this medium (mtmd code {rc}){LOG.reason()}")
            before: list[int] = []
            after: list[int] = []
            chunk = None
            for i in range(m.mtmd_input_chunks_size(chunks)):
                part = m.mtmd_input_chunks_get(chunks, i)
                if m.mtmd_input_chunk_get_type(part) == m.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n = ctypes.c_size_t(0)
                    ids = m.mtmd_input_chunk_get_tokens_text(part, ctypes.byref(n))
                    (after if chunk is not None else before).extend(ids[j] for j in range(n.value))
                elif chunk is None:
                    chunk = part
            if chunk is None:
                raise UsageError("the projector made nothing of this medium")
            n_tokens = m.mtmd_input_chunk_get_n_tokens(chunk)
            n_pos = m.mtmd_input_chunk_get_n_pos(chunk)
            if n_tokens >= MEDIA_SPAN:
                raise UsageError(f"this medium takes {n_tokens} positions, more than quipu places")
        except BaseException:
            m.mtmd_input_chunks_free(chunks)
            raise
        finally:
            m.mtmd_bitmap_free(bitmap)
        return _Medium(digest, chunks, chunk, before, after, n_tokens, n_pos)

    def drop_media_after(self, n: int) -> list[str]:
        """Forgets the media this context took after its first `n` (none of their placeholders
        may be in its history); their SHA-256s."""
        media = self._media
        dropped, self._media = media[n:], media[:n]
        for medium in dropped:
            _mtmd().mtmd_input_chunks_free(medium.chunks)
        return [medium.digest for medium in dropped]

    def media_digests(self) -> list[str]:
        """The SHA-256 of each medium this context holds, in the order it took them (k)."""
        return [medium.digest for medium in self._media]

    @property
    def projector_path(self) -> Path | None:
        return self._projector.path if self._projector is not None else None

    def media_tokens(self, k: int) -> list[int]:
        """The tokens of medium k in the context: its wrapping text, and its run of placeholders
        (IndexError, a LookupError, for a medium it does not hold)."""
        medium = self._media[k]
        return medium.before + [MEDIA_BASE + k * MEDIA_SPAN + i for i in range(medium.n)] + medium.after

    def media_text(self, token: int) -> bytes:
        """What a placeholder spells: the marker at the end of its run, else nothing."""
        k, i = divmod(token - MEDIA_BASE, MEDIA_SPAN)
        media = self._media
        if k < len(media) and i == media[k].n - 1:
            return media_mark(k).encode()
        return b""

    def decode_media(self, tokens: Sequence[int], at: int, logits_last: bool) -> None:
        """Decodes the run of a medium that `tokens` (its placeholders, the whole run) stand for,
        from the token history's index `at` on."""
        k, i = divmod(tokens[0] - MEDIA_BASE, MEDIA_SPAN)
        media = self._media
        if k >= len(media) or i != 0 or len(tokens) != media[k].n:
            raise EngineError("a medium's positions in the context are not whole")
        assert self._projector is not None
        m = _mtmd()
        done = lc.llama_pos(0)
        start = self._positions.position(at)
        LOG.clear_errors()
        projector, native = self._projector, self._native
        rc = native.alone(lambda: m.mtmd_helper_eval_chunk_single(projector.ptr, native.ptr, media[k].chunk, start,
                                                                  native.own, native.settings.n_batch, logits_last,
                                                                  ctypes.byref(done)))
        if rc != 0:
            raise EngineError(f"llama.cpp could not read a medium into the context (code {rc}){LOG.reason()}")
        self._positions.moved(at, media[k])

    def place_media(self, tokens: Sequence[int]) -> None:
        """The history a restored context holds: where its media sit (see `position`)."""
        self._positions.clear()
        media = self._media
        for begin, end, is_run in runs(tokens):
            if is_run:
                k = (tokens[begin] - MEDIA_BASE) // MEDIA_SPAN
                if k < len(media) and end - begin == media[k].n:
                    self._positions.moved(begin, media[k])


def is_media(token: int) -> bool:
    return token >= MEDIA_BASE


def runs(tokens: Sequence[int]) -> list[tuple[int, int, bool]]:
    """(start, end, media) spans of `tokens`: text, and each medium's run of placeholders."""
    out: list[tuple[int, int, bool]] = []
    start = 0
    for j in range(1, len(tokens) + 1):
        if j == len(tokens) or is_media(tokens[j]) != is_media(tokens[start]) or (
                is_media(tokens[j]) and (tokens[j] - MEDIA_BASE) % MEDIA_SPAN == 0):
            out.append((start, j, is_media(tokens[start])))
            start = j
    return out
