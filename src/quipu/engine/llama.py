"""The llama.cpp backend, on llama-cpp-python's low-level (ctypes) API: a context on a loaded
model (model.py) and its decoding; its sampling, state bytes, batch rows and embeddings are
parts of their own (`sampler.py`, `llama_state.py`, `llama_rows.py`, `embeddings.py`)."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from quipu.engine.native import binding_version, lc
from quipu.engine.sampler import Sampling
from quipu.engine.text import Spellings

from quipu.engine.base import (
    AUTO,
    CPU,
    CTX_AUTO,
    DEFAULT_CTX_CAP,
    FLASH_ATTN,
    KV_TYPES,
    ContextSettings,
    Offload,
    Placement,
    ProgressFn,
    off_device,
    check_context_bounds,
    available_cpus,
)
from quipu.engine.embeddings import Embeddings
from quipu.engine.media import Media, is_media, runs
from quipu.engine.llama_rows import BatchRows
from quipu.engine.llama_state import StateBytes
from quipu.engine.logs import LOG
from quipu.engine.model import LlamaModel, check_gguf
from quipu.engine.devices import no_gpu_reason, supports_offload
from quipu.engine.placement import check_host_room, plan, ring_of
from quipu.errors import EngineError, InvalidParameter, ModelLoadError, UsageError

if TYPE_CHECKING:
    from quipu.engine.constraint import MaskBatch

_KV_GGML_TYPES = {"f16": lc.GGML_TYPE_F16, "q8_0": lc.GGML_TYPE_Q8_0}
CHECKPOINTS = 4  # the ring's checkpoints a context keeps (a few prompts back; llama-server keeps 8 by default)
_FLASH_ATTN_TYPES = {"auto": lc.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": lc.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                     "off": lc.LLAMA_FLASH_ATTN_TYPE_DISABLED}

def context_params(context: ContextSettings, n_ctx: int):
    """llama.cpp's parameters for a context of `n_ctx` cells with `context`'s settings."""
    n_threads = context.n_threads or available_cpus()
    check_context_bounds(n_ctx, n_threads, "the context")  # (a session's or a config's, checked where they are read too)
    n_batch = max(1, min(context.n_batch, n_ctx))
    n_seq = max(1, context.n_seq)
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = n_ctx
    cparams.n_batch = n_batch
    cparams.n_ubatch = n_batch
    if n_seq > 1:
        cparams.n_seq_max = n_seq  # each sequence has its own n_ctx / n_seq cells (not unified)
    else:  # one sequence, and a second sharing its cells, to save a turn's cells alone (kvstate.py)
        cparams.n_seq_max, cparams.kv_unified = 2, True
    cparams.n_threads = n_threads
    cparams.n_threads_batch = n_threads
    cparams.swa_full = context.swa_full  # (else a sliding-window model's window cache is a ring: ring.py)
    cparams.no_perf = True
    kv = _KV_GGML_TYPES[context.kv_type]
    cparams.type_k = kv
    cparams.type_v = kv
    # Flash attention as llama.cpp chooses it (on where the device runs it; always for a
    # quantized V cache), unless asked. The cache's layout follows from the choice it was made
    # with, which the new context states in its log: V is stored transposed only without it.
    cparams.flash_attn_type = _FLASH_ATTN_TYPES[context.flash_attn]
    return cparams


def place(path: Path, offload: Offload, context: ContextSettings, *, detail: bool = False) -> Placement:
    """Where a model is to run (`placement.plan`), for a context with `context`'s settings; on a
    build for the CPU alone, the CPU at once (and layers or devices asked for, refused). With
    `detail`, what it takes is measured wherever it runs (`quipu doctor`)."""
    detail = detail or context.n_ctx == CTX_AUTO  # (the context's size is worked out from what fits)
    if not supports_offload():
        asked = (f"--gpu-layers {offload.layers}" if offload.layers not in (AUTO, 0)
                 else f"--device {','.join(offload.devices)}" if offload.devices and not off_device(offload.devices)
                 else None)
        if asked:
            raise UsageError(f"{asked}: {no_gpu_reason()}")
        if not detail:
            return CPU  # (the model's load checks the file)
    check_gguf(path)  # (a file that is none is said as a load says it, before the plan reads it)
    return plan(path, offload, offload.fit_ctx or context.n_ctx, context.kv_type,
                lambda n_ctx: context_params(context, n_ctx), detail=detail)


class LlamaBackend(Sampling, BatchRows, StateBytes, Embeddings, Media):
    """One context on a model (loaded from `model_path`, or a shared `LlamaModel`). Close it (or
    use it as a context manager) to free its native memory; the model goes with its last context.
    Its parts: its sampling (`sampler.py`), the rows of a batch (`llama_rows.py`), its state
    bytes (`llama_state.py`), embeddings (`embeddings.py`), and media (`media.py`: a projector's
    images and audio)."""

    name = "llama.cpp"
    build = f"llama-cpp-python {binding_version()}"

    def __init__(self, model_path: Path | LlamaModel, context: ContextSettings = ContextSettings(), *,
                 verbose: bool = False, offload: Offload = Offload()):
        if context.kv_type not in KV_TYPES:
            raise InvalidParameter(f"--kv-type must be one of {', '.join(KV_TYPES)}, not '{context.kv_type}'")
        if context.flash_attn not in FLASH_ATTN:
            raise InvalidParameter(f"--flash-attn must be one of {', '.join(FLASH_ATTN)}, not '{context.flash_attn}'")
        if context.flash_attn == "off" and context.kv_type != "f16":
            raise InvalidParameter(f"--kv-type {context.kv_type} needs flash attention (llama.cpp quantizes V only "
                                   "there): drop --flash-attn off, or keep f16")
        LOG.verbose = verbose
        self._stack = ExitStack()
        try:
            if isinstance(model_path, LlamaModel):
                model = model_path
            else:
                model = LlamaModel(model_path, place(Path(model_path), offload, context))
            if context.n_ctx == CTX_AUTO:  # (as long as the placement found room for)
                context = replace(context, n_ctx=model.placement.n_ctx or DEFAULT_CTX_CAP)
            self.model = model.acquire()
            self._stack.callback(model.release)
            self._open_context(context)
        except BaseException:
            self._stack.close()
            raise
        self.model_path = self.model.path
        self.placement = self.model.placement
        self.n_vocab = self.model.n_vocab
        self.n_ctx_train = self.model.n_ctx_train

    def _open_context(self, context: ContextSettings) -> None:
        n_ctx = context.n_ctx or min(self.model.n_ctx_train or DEFAULT_CTX_CAP, DEFAULT_CTX_CAP)
        cparams = context_params(context, n_ctx)
        n_threads, n_batch, n_seq = cparams.n_threads, cparams.n_batch, max(1, context.n_seq)
        if n_ctx > DEFAULT_CTX_CAP:  # (a usual context is far smaller than any machine's memory)
            check_host_room(self.model.path, n_ctx, context.kv_type, self.model.placement.gpu_layers, cparams)
        LOG.clear_errors()
        ctx = lc.llama_init_from_model(self.model.ptr, cparams)
        if not ctx:
            raise ModelLoadError(f"llama.cpp could not create a context of {n_ctx} tokens{LOG.reason()}")
        made = LOG.flash_attn
        windowed = n_seq == 1 and self.model.n_swa > 0
        self.context = ContextSettings(n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads, kv_type=context.kv_type,
                                       n_seq=n_seq, flash_attn=context.flash_attn,
                                       v_trans=None if made is None else made == "disabled",
                                       swa_full=context.swa_full,
                                       window_cells=None if not windowed else
                                       "every cell" if context.swa_full else "ring")
        self._ctx = ctx
        self._stack.callback(lc.llama_free, ctx)
        # llama.cpp rounds small contexts up; the user's number is the one we keep to.
        self.n_ctx = min(n_ctx, lc.llama_n_ctx(ctx))
        # The window cache's cells, where it is a ring this context lays out (0: none; ring.py).
        ring = ring_of(cparams)
        self.ring = ring(self.model.n_swa) if windowed and ring is not None else 0
        # The ring's cells where a prompt began to be read: (the tokens before, their positions, its state).
        self._checkpoints: list[tuple[int, int, memoryview]] = []
        self._mem = lc.llama_get_memory(ctx)

        self.n_ctx_seq = lc.llama_n_ctx_seq(ctx) if n_seq > 1 else self.n_ctx
        self._batch = lc.llama_batch_init(n_batch, 0, 1)
        self._stack.callback(lc.llama_batch_free, self._batch)
        self._chain = self._sampler = self._grammar = None
        self._masks: "MaskBatch | None" = None  # for the rows of a batch under grammars
        self._stack.callback(self._free_sampler)

    # ---- vocabulary: the model's ----------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return self.model.tokenize(text, add_special=add_special, parse_special=parse_special)

    def token_bytes(self, token: int) -> bytes:
        return self.media_text(token) if is_media(token) else self.model.token_bytes(token)

    def max_token_bytes(self) -> int:
        return self.model.max_token_bytes()

    def token_text(self, token: int) -> bytes:
        return self.media_text(token) if is_media(token) else self.model.token_text(token)

    def is_control(self, token: int) -> bool:
        return not is_media(token) and self.model.is_control(token)

    def control_spellings(self, texts: Sequence[str]) -> list[str]:
        return self.model.control_spellings(texts)

    def controls(self) -> Spellings:
        return self.model.controls()

    def special_tokens(self) -> dict[str, int]:
        return self.model.special_tokens()

    def is_eog(self, token: int) -> bool:
        return self.model.is_eog(token)

    def bos_token(self) -> int | None:
        return self.model.bos_token()

    def special_token_text(self, which: str) -> str:
        return self.model.special_token_text(which)

    def chat_template(self) -> str | None:
        return self.model.chat_template()

    # ---- decoding -----------------------------------------------------------------------

    def prefill(self, tokens: Sequence[int], start: int, on_progress: ProgressFn | None = None) -> None:
        """Decodes `tokens` at positions `start`, ... in steps that end where a multiple of
        n_batch does (see `step_start`); a medium's placeholders as its projector's embeddings."""
        if self.ring and start > 0 and tokens:
            self._checkpoint(start)  # (a prompt begins: where a rewind past the ring comes back to)
        if any(is_media(t) for t in tokens):
            total = len(tokens)
            for begin, end, media in runs(tokens):
                if media:
                    self.decode_media(tokens[begin:end], start + begin, end == total)
                else:
                    self._prefill_text(tokens[begin:end], start + begin)
                if on_progress is not None:
                    on_progress(end, total)
            return
        self._prefill_text(tokens, start, on_progress)

    def _prefill_text(self, tokens: Sequence[int], start: int, on_progress: ProgressFn | None = None) -> None:
        total = len(tokens)
        n_batch = self.context.n_batch
        batch = self._batch
        offset = 0
        while offset < total:
            n = min(total - offset, n_batch - (start + offset) % n_batch)
            chunk = tokens[offset : offset + n]
            last_chunk = offset + n == total
            first = self.position(start + offset)  # (a text's positions run on from its first)
            for i, tok in enumerate(chunk):
                batch.token[i] = tok
                batch.pos[i] = first + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = last_chunk and i == n - 1
            batch.n_tokens = n
            self._decode(batch)
            offset += n
            if on_progress is not None:
                on_progress(offset, total)

    def step_start(self, n: int) -> int:
        """The last position at or before `n` where a prefill step starts. llama.cpp's attention
        computes a token by another road in a step of a few tokens than in a step of many (flash
        attention's tiled kernel), so the last bits of what it keeps differ; a context restored
        to such a position and read on computes what one read from the start computes."""
        return n - n % self.context.n_batch

    def decode_one(self, token: int, pos: int) -> None:
        if is_media(token):
            self.decode_media([token], pos, True)
            return
        batch = self._batch
        batch.token[0] = token
        batch.pos[0] = self.position(pos)
        batch.n_seq_id[0] = 1
        batch.seq_id[0][0] = 0
        batch.logits[0] = True
        batch.n_tokens = 1
        self._decode(batch)

    def _decode(self, batch) -> None:
        rc = lc.llama_decode(self._ctx, batch)
        if rc != 0:
            if rc == 1:
                raise EngineError("llama.cpp found no room in the context for the batch")
            raise EngineError(f"llama.cpp failed to decode (code {rc}){LOG.reason()}")

    def _checkpoint(self, n: int) -> None:
        """Keeps the ring's cells as they are before the `n`th token is read (a prompt's start),
        for a rewind to there or later that the ring no longer holds the window of; the last
        CHECKPOINTS of them."""
        at = self.position(n)
        kept = [c for c in self._checkpoints if c[1] < at]
        # (the window's cells alone, which are all a ring laid out for `at` needs of them)
        window = self._seq_state(0, lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
        self._checkpoints = (kept + [(n, at, window)])[-CHECKPOINTS:]

    def truncate(self, n_keep: int) -> None:
        """Keeps the first `n_keep` positions. A sliding-window cache that no longer holds the
        window those positions end with (llama_memory_seq_pos_min past it) goes back to the last
        checkpoint before them (a ring's: `positions()` then says fewer, and the rest is read
        again), or is emptied: `positions()` then says 0, and the tokens are read again."""
        if n_keep <= 0:
            self._empty()
            return
        keep = self.position(n_keep)
        self.forget_positions(n_keep)
        if not lc.llama_memory_seq_rm(self._mem, 0, keep, -1):
            raise EngineError("llama.cpp could not trim the context")
        if self.ring:
            self._checkpoints = [c for c in self._checkpoints if c[1] <= keep]
            if self.settle_ring(keep):
                return
            for n, at, cells in reversed(self._checkpoints):
                lc.llama_memory_seq_rm(self._mem, 0, at, -1)
                if self.settle_ring(at, cells):
                    self.forget_positions(n)
                    return
            self._empty()
            return
        n_swa = self.model.n_swa
        if n_swa > 0 and lc.llama_memory_seq_pos_min(self._mem, 0) > max(0, keep - n_swa):
            self._empty()

    def _empty(self) -> None:
        """Nothing held: the cells, the media's places, the ring's checkpoints."""
        lc.llama_memory_clear(self._mem, True)
        self.forget_positions(0)
        self._checkpoints.clear()

    def shift_refused(self) -> str | None:
        """Why cells cannot be dropped from the middle of the context with those after them
        moved down (None: they can). llama.cpp moves a cache's positions (re-rotating RoPE keys)
        where `llama_memory_can_shift` says so: a plain attention cache of a model with one
        position per token (not M-RoPE); not a sliding-window cache, whose evicted cells a shift
        cannot bring back, nor a recurrent model's state, which is not kept a token a cell."""
        why = self.partial_state() or ("a sliding-window cache" if self.model.n_swa > 0 else None)
        if why:
            return why
        if not lc.llama_memory_can_shift(self._mem):
            return "this model's cache cannot move its positions"
        return None

    def shift_out(self, start: int, end: int) -> None:
        """Drops positions [start, end) and moves those after them down by end - start."""
        if not lc.llama_memory_seq_rm(self._mem, 0, start, end):
            raise EngineError("llama.cpp could not drop part of the context")
        lc.llama_memory_seq_add(self._mem, 0, end, -1, start - end)

    def positions(self) -> int:
        """How many tokens of the history the context holds (its positions, where media take as
        many as their cells)."""
        last = lc.llama_memory_seq_pos_max(self._mem, 0)
        return self.index_after(last) if last >= 0 else 0

    def reopen(self) -> "LlamaBackend":
        """A new context with the same settings on the same loaded model: no second load."""
        return LlamaBackend(self.model, self.context, verbose=LOG.verbose)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "LlamaBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
