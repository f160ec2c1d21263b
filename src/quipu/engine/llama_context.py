"""A llama.cpp context on a loaded model, the native handle the backend's parts share: the
context, its memory, its batch, their decoding, and a sequence's state as bytes. It owns them
and frees them on `close`; the parts of `LlamaBackend` (`llama.py`) are given it."""

from __future__ import annotations

import ctypes
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, TypeVar

from quipu.engine.settings import (
    DEFAULT_CTX_CAP,
    ContextSettings,
    available_cpus,
    check_context_bounds,
    default_threads,
)
from quipu.engine.logs import LOG
from quipu.engine.model import LlamaModel
from quipu.engine.native import lc
from quipu.engine.placement import check_host_room, ring_of, sequences_bound
from quipu.engine.threads import ThreadTuner, free_cores
from quipu.errors import EngineError, ModelLoadError

T = TypeVar("T")
_KV_GGML_TYPES = {"f16": lc.GGML_TYPE_F16, "q8_0": lc.GGML_TYPE_Q8_0}
_FLASH_ATTN_TYPES = {"auto": lc.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": lc.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                     "off": lc.LLAMA_FLASH_ATTN_TYPE_DISABLED}


def context_params(context: ContextSettings, n_ctx: int, *, cpu_alone: bool = False) -> Any:
    """llama.cpp's parameters for a context of `n_ctx` cells with `context`'s settings, on a
    model whose layers all run on the CPU where `cpu_alone`."""
    n_threads = context.n_threads or default_threads()
    check_context_bounds(n_ctx, n_threads, "the context")  # (a session's or a config's, checked where they are read too)
    n_batch = max(1, min(context.n_batch, n_ctx))
    n_seq = max(1, context.n_seq)
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = n_ctx * n_seq
    cparams.n_batch = n_batch
    cparams.n_ubatch = n_batch
    if n_seq > 1:  # the sequences, each in a stream of its own (scheduler.py)
        cparams.n_seq_max, cparams.kv_unified = n_seq, False
    else:  # one sequence, and a second sharing its cells, to save a turn's cells alone (kvstate.py)
        cparams.n_seq_max, cparams.kv_unified = 2, True
    cparams.n_threads = n_threads
    cparams.n_threads_batch = n_threads
    cparams.swa_full = context.swa_full  # (else a sliding-window model's window cache is a ring: ring.py)
    cparams.no_perf = True
    kv = _KV_GGML_TYPES[context.kv_type]
    cparams.type_k = kv
    cparams.type_v = kv
    # Flash attention off on the CPU alone, unless asked (or a quantized V cache needs it): there
    # ggml sums a long context's attention in one part per thread, so that another thread count
    # gives other logits; without it every sum is made in one order, whatever the threads
    # (docs/sessions.md). Elsewhere as llama.cpp chooses it. The cache's layout follows from the
    # choice it was made with, which the new context states in its log: V is stored transposed
    # only without it.
    flash = context.flash_attn
    if flash == "auto" and cpu_alone and context.kv_type == "f16":
        flash = "off"
    cparams.flash_attn_type = _FLASH_ATTN_TYPES[flash]
    return cparams


STATE_HEAD = 8  # a sequence's state begins with llama.cpp's magic and the sequence's id


def _state_of(ptr: Any, seq: int, flags: int) -> memoryview:
    """Sequence `seq`'s state in context `ptr`, as a view of the one buffer llama.cpp wrote it into."""
    size = lc.llama_state_seq_get_size_ext(ptr, seq, flags)
    buf = (ctypes.c_uint8 * size)()
    written = lc.llama_state_seq_get_data_ext(ptr, buf, size, seq, flags)
    if written != size:
        raise EngineError("llama.cpp could not write the context state")
    return memoryview(buf).cast("B")


@dataclass(frozen=True)
class Opened:
    """What opening a llama.cpp context made, which the context and the views of its sequences
    (`llama_shared.SequenceContext`) read alike."""

    model: LlamaModel
    ptr: Any  # the context
    mem: Any  # its memory
    settings: ContextSettings  # what was made: the sizes llama.cpp took, the cache's layout
    n_ctx: int  # each sequence's cells
    ring: int  # the window cache's cells, where it is a ring this context lays out (0: none; ring.py)
    recurrent: bool  # whether the memory holds a state that cannot go back a token (a hybrid or recurrent model's)
    # A recurrent state of no cell, as llama.cpp writes an empty sequence's (after the state's
    # head): what a hybrid model's cells saved apart from their recurrent state end with.
    no_recurrent: bytes = b""


class NativeContext:
    """One llama.cpp context on `model` with `context`'s settings (its size 0: the model's
    training context, at most DEFAULT_CTX_CAP), and the batch its steps are decoded in.
    What opening it made is `opened` (`settings`: the sizes llama.cpp took, the cache's layout).

    The backend's parts speak of sequence 0 (the history) and 1 (a second that shares some of
    its cells for a moment: a piece's), through the `seq_*` methods; a sequence of a context
    several requests share (`llama_shared.SequenceContext`) answers them for its own sequence."""

    own = 0  # the sequence that holds the history
    logits_index = -1  # where the logits of the last decode that wanted them are (-1: its last output)

    def __init__(self, model: LlamaModel, context: ContextSettings):
        n_ctx = context.n_ctx or min(model.n_ctx_train or DEFAULT_CTX_CAP, DEFAULT_CTX_CAP)
        cparams = context_params(context, n_ctx, cpu_alone=not model.placement.on_device)
        n_seq = max(1, context.n_seq)
        bound = sequences_bound(model.arch)
        if bound is not None and n_seq > bound:  # (callers cap it first: a safety net)
            raise ModelLoadError(f"llama.cpp decodes {bound} sequence at a time on {model.arch} models")
        if n_ctx * n_seq > DEFAULT_CTX_CAP:  # (a usual context is far smaller than any machine's memory)
            check_host_room(model.path, n_ctx * n_seq, context.kv_type, model.placement.gpu_layers, cparams)
        LOG.install()  # (again: another library in this process may have taken llama.cpp's log since)
        LOG.clear_errors()
        n_threads: int = cparams.n_threads
        n_batch: int = cparams.n_batch
        ptr = lc.llama_init_from_model(model.ptr, cparams)
        if not ptr:
            raise ModelLoadError(f"llama.cpp could not create a context of {n_ctx} tokens{LOG.reason()}")
        self._stack = ExitStack()
        self._stack.callback(lc.llama_free, ptr)
        try:
            made = LOG.flash_attn
            windowed = n_seq == 1 and model.n_swa > 0
            ring = ring_of(cparams)
            recurrent = bool(lc.llama_model_is_recurrent(model.ptr) or lc.llama_model_is_hybrid(model.ptr))
            settings = ContextSettings(n_ctx=n_ctx, n_batch=n_batch, n_threads=context.n_threads,
                                       kv_type=context.kv_type, n_seq=n_seq, flash_attn=context.flash_attn,
                                       v_trans=None if made is None else made == "disabled", swa_full=context.swa_full,
                                       window_cells=None if not windowed else "every cell" if context.swa_full else "ring")
            self.opened = Opened(
                model, ptr, lc.llama_get_memory(ptr), settings,
                # llama.cpp rounds small contexts up; the user's number is the one we keep to.
                min(n_ctx, lc.llama_n_ctx_seq(ptr)),
                ring(model.n_swa) if windowed and ring is not None else 0,
                recurrent, bytes(_state_of(ptr, 0, lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)[STATE_HEAD:]) if recurrent else b"")
            self.batch = lc.llama_batch_init(n_batch, 0, 1)
            self._stack.callback(lc.llama_batch_free, self.batch)
            self._threads = n_threads  # (those computing now)
            # Threads quipu chooses follow the machine's load, where no change of them changes a
            # sum: flash attention off, on the CPU alone (threads.py).
            def free() -> int:
                return free_cores(n_threads, available_cpus())

            self.tuner = None if context.n_threads or made != "disabled" or model.placement.on_device else \
                ThreadTuner(free(), n_threads, self._set_threads, free=free)
            if self.tuner is not None and self.tuner.current != n_threads:
                self._set_threads(self.tuner.current)
        except BaseException:
            self._stack.close()  # (the context made is freed: the caller never holds it)
            raise

    @property
    def model(self) -> LlamaModel:
        return self.opened.model

    @property
    def ptr(self) -> Any:
        return self.opened.ptr

    @property
    def mem(self) -> Any:
        return self.opened.mem

    @property
    def settings(self) -> ContextSettings:
        return self.opened.settings

    @property
    def n_ctx(self) -> int:
        return self.opened.n_ctx

    @property
    def ring(self) -> int:
        return self.opened.ring

    @property
    def recurrent(self) -> bool:
        return self.opened.recurrent

    @property
    def threads(self) -> int:
        """The threads computing now."""
        return self._threads

    def decode(self, n: int) -> None:
        """Decodes the first `n` items of the context's batch, as filled (`fill`)."""
        self.batch.n_tokens = n
        started = time.perf_counter()
        rc = lc.llama_decode(self.ptr, self.batch)
        if self.tuner is not None and rc == 0:
            self.tuner.took(n, time.perf_counter() - started)
        if rc != 0:
            if rc == 1:
                raise EngineError("llama.cpp found no room in the context for the batch")
            raise EngineError(f"llama.cpp failed to decode (code {rc}){LOG.reason()}")

    def _set_threads(self, count: int) -> None:
        lc.llama_set_n_threads(self.ptr, count, count)
        self._threads = count

    def fill(self, i: int, token: int, pos: int, seq: int, logits: bool) -> None:
        """Item `i` of the context's batch."""
        batch = self.batch
        batch.token[i] = token
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = logits

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        """Drops sequence `seq`'s positions [p0, p1) (-1: to the end); False where its memory
        cannot (a recurrent state that would have to go back)."""
        return bool(lc.llama_memory_seq_rm(self.mem, seq, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Sequence `dst` shares `src`'s cells at positions [p0, p1)."""
        lc.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        """Moves sequence `seq`'s positions [p0, p1) by `delta`."""
        lc.llama_memory_seq_add(self.mem, seq, p0, p1, delta)

    def seq_pos_max(self, seq: int) -> int:
        return int(lc.llama_memory_seq_pos_max(self.mem, seq))

    def seq_pos_min(self, seq: int) -> int:
        return int(lc.llama_memory_seq_pos_min(self.mem, seq))

    def clear(self) -> None:
        """Nothing held."""
        lc.llama_memory_clear(self.mem, True)

    def held(self) -> ContextManager[Any]:
        """Held around a use of sequence 1, which no other may make meanwhile (a shared
        context's is one for all its sequences)."""
        return nullcontext()

    def alone(self, work: Callable[[], T]) -> T:
        """Runs `work`, which decodes on the context by other means than `decode` (a medium's
        embeddings, through the projector's helper), when nothing else decodes."""
        return work()

    def logits_read(self) -> None:
        """The logits of the last decode are read: another may overwrite them."""

    def seq_state(self, seq: int, flags: int = 0) -> memoryview:
        """Sequence `seq`'s state (-1: the whole memory's), as a view of the one buffer llama.cpp
        wrote it into (no copy)."""
        return _state_of(self.ptr, seq, flags)

    def set_seq_state(self, data: bytes | memoryview, seq: int, what: str, flags: int = 0) -> None:
        """Gives llama.cpp a sequence's state; refused, the context is emptied."""
        view = memoryview(data).cast("B")
        if view.readonly:
            buf = (ctypes.c_uint8 * len(view)).from_buffer_copy(view)
        else:  # read where it lies: a state is tens of megabytes
            buf = (ctypes.c_uint8 * len(view)).from_buffer(view)
        if lc.llama_state_seq_set_data_ext(self.ptr, buf, len(view), seq, flags) != len(view):
            self.clear()
            raise EngineError(f"llama.cpp refused {what}{LOG.reason()}")

    def close(self) -> None:
        self._stack.close()
