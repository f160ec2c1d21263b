"""The llama.cpp backend, on llama-cpp-python's low-level (ctypes) API: a facade over a context
on a loaded model (`llama_context.py`, `model.py`) and the parts built on it, each owning its
state: sampling (`sampler.py`), state bytes (`llama_state.py`), the rows of a batch
(`llama_rows.py`), embeddings (`embeddings.py`) and media (`media.py`); the decoding of a
history is its own, and what the context holds of it, its checkpoints and rewinds, the memory's
(`llama_memory.py`)."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from quipu.engine.native import binding_version
from quipu.engine.sampler import Sampling

from quipu.engine.base import ProgressFn
from quipu.engine.settings import (
    ALL,
    AUTO,
    CPU,
    CTX_AUTO,
    DEFAULT_CTX_CAP,
    FLASH_ATTN,
    KV_TYPES,
    ContextSettings,
    Offload,
    Placement,
    off_device,
)
from quipu.engine.embeddings import Embeddings
from quipu.engine.llama_context import NativeContext, context_params
from quipu.engine.media import Media, Positions, is_media, runs
from quipu.engine.vocabulary import Vocabulary
from quipu.engine.llama_rows import BatchRows
from quipu.engine.scheduler import Scheduler
from quipu.engine.llama_memory import memory_for
from quipu.engine.llama_state import StateBytes
from quipu.engine.logs import LOG
from quipu.engine.model import LlamaModel, check_gguf
from quipu.engine.devices import no_gpu_reason, supports_offload
from quipu.engine.placement import plan
from quipu.errors import InvalidParameter, UsageError

if TYPE_CHECKING:
    from quipu.engine.llama_shared import SharedContext


def place(path: Path, offload: Offload, context: ContextSettings, *, detail: bool = False) -> Placement:
    """Where a model is to run (`placement.plan`), for a context with `context`'s settings; on a
    build for the CPU alone, the CPU at once: a number of layers asked for is said once and the
    model runs on the CPU (as llama.cpp does with `-ngl 99`: scripts carry it), where `all` (every
    layer, or a refusal) and devices asked for by name are refused. With `detail`, what it takes is
    measured wherever it runs (`quipu doctor`)."""
    detail = detail or context.n_ctx == CTX_AUTO  # (the context's size is worked out from what fits)
    note = None
    if not supports_offload():
        asked = (f"--gpu-layers {offload.layers}" if offload.layers == ALL
                 else f"--device {','.join(offload.devices)}" if offload.devices and not off_device(offload.devices)
                 else None)
        if asked:
            raise UsageError(f"{asked}: {no_gpu_reason()}")
        if offload.layers not in (AUTO, 0):
            note = f"--gpu-layers {offload.layers}: {no_gpu_reason()}; running on the CPU"
            offload = replace(offload, layers=0)
        if not detail:
            return replace(CPU, note=note) if note else CPU  # (the model's load checks the file)
    check_gguf(path)  # (a file that is none is said as a load says it, before the plan reads it)
    placed = plan(path, offload, offload.fit_ctx or context.n_ctx, context.kv_type,
                  lambda n_ctx: context_params(context, n_ctx), detail=detail)
    return replace(placed, note=note) if note else placed


class LlamaBackend:
    """One context on a model (loaded from `model_path`, or a shared `LlamaModel`). Close it (or
    use it as a context manager) to free its native memory; the model goes with its last context.
    A facade: the native context (`native`) and its parts, each built here from the handles it
    uses and owning what it keeps."""

    name = "llama.cpp"
    build = f"llama-cpp-python {binding_version()}"
    supports_embeddings = True

    def __init__(self, model_path: Path | LlamaModel, context: ContextSettings = ContextSettings(), *,
                 verbose: bool = False, offload: Offload = Offload()):
        if context.kv_type not in KV_TYPES:
            raise InvalidParameter(f"--kv-type must be one of {', '.join(KV_TYPES)}, not '{context.kv_type}'")
        if context.flash_attn not in FLASH_ATTN:
            raise InvalidParameter(f"--flash-attn must be one of {', '.join(FLASH_ATTN)}, not '{context.flash_attn}'")
        if context.flash_attn == "off" and context.kv_type != "f16":
            raise InvalidParameter(f"--kv-type {context.kv_type} needs flash attention (llama.cpp quantizes V only "
                                   "there): drop --flash-attn off, or keep f16")
        LOG.echo(verbose)
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
            native: NativeContext
            if context.n_seq > 1:  # (the first of the shared context's sequences: `sequences` for the others)
                from quipu.engine.llama_shared import SequenceContext, SharedContext

                self._shared: SharedContext | None = SharedContext(self.model, context)
                self._stack.callback(self._shared.close)
                native = SequenceContext(self._shared, 0)
            else:
                self._shared = None
                native = NativeContext(self.model, context)
            self._stack.callback(native.close)
            self._parts(model, native)
            # Every sequence at once, from one thread: a batch's rows.
            self.rows: BatchRows | None = BatchRows(native, Scheduler(native)) if self._shared is None else \
                BatchRows(self._shared.native, self._shared.scheduler)
        except BaseException:
            self._stack.close()
            raise

    def sequences(self) -> list["LlamaBackend"]:
        """Where this backend is the first request's sequence of a shared context (its settings'
        `n_seq`: `llama_shared.py`), a backend for each of the others, on the same context (close
        them before this one; they have no rows: `rows` are the first's); else none."""
        from quipu.engine.llama_shared import SequenceContext

        shared = self._shared
        if shared is None:
            return []
        backends = []
        for seq in shared.sequences[1:]:
            backend = LlamaBackend.__new__(LlamaBackend)
            backend._stack, backend._shared, backend.model, backend.rows = ExitStack(), None, self.model, None
            native = SequenceContext(shared, seq)
            backend._stack.callback(native.close)
            backend._parts(self.model, native)
            backends.append(backend)
        return backends

    def done_reading(self) -> None:
        """The request on this backend is done (a shared context's sequence: the next step need
        not wait for it to read its logits)."""
        self.native.logits_read()

    def _parts(self, model: LlamaModel, native: NativeContext) -> None:
        self.native = native
        self.model_path = model.path
        self.placement = model.placement
        self.n_vocab = model.n_vocab
        self.n_ctx_train = model.n_ctx_train
        self.context = native.settings
        self.n_ctx = native.n_ctx
        self.ring = native.ring
        self._positions = Positions()
        self.sampling = Sampling(native)
        self._stack.callback(self.sampling.close)
        self.state = StateBytes(native, self._positions)
        self.embeddings = Embeddings(model, native.threads, self.name)
        self.media = Media(native, self._positions)
        self._stack.callback(self.media.close)
        self.vocab = Vocabulary(model, self.media)
        # What the context holds of the history, its checkpoints, its going back.
        self.memory = memory_for(native, self._positions, self.state)

    def embed(self, texts: Sequence[str | Sequence[int]], pooling: str = "mean") -> list[list[float]]:
        return self.embeddings.embed(texts, pooling)

    # ---- decoding -----------------------------------------------------------------------

    def prefill(self, tokens: Sequence[int], start: int, on_progress: ProgressFn | None = None,
                marks: Sequence[int] = ()) -> None:
        """Decodes `tokens` at positions `start`, ... in steps that end where a multiple of
        n_batch does (see `Memory.step_start`); a medium's placeholders as its projector's embeddings.
        A recurrent state is kept where the prompt begins and at each of `marks` (counts of the
        history's tokens: where a later prompt may part from this one), a step ending there."""
        if start > 0 and tokens:
            self.memory.prompt_begins(start)
        cuts = sorted({m for m in marks if start < m <= start + len(tokens)})
        if any(is_media(t) for t in tokens):
            total = len(tokens)
            for begin, end, media in runs(tokens):
                if media:
                    self.media.decode_media(tokens[begin:end], start + begin, end == total)
                    if start + end in cuts:
                        self.memory.cut(start + end, kept=end < total)
                else:
                    self._prefill_text(tokens[begin:end], start + begin, cuts=cuts, end=start + total)
                if on_progress is not None:
                    on_progress(end, total)
            return
        self._prefill_text(tokens, start, on_progress, cuts, start + len(tokens))

    def _prefill_text(self, tokens: Sequence[int], start: int, on_progress: ProgressFn | None = None,
                      cuts: Sequence[int] = (), end: int = 0) -> None:
        """Decodes a text's `tokens` from `start`, a step ending at each of `cuts`, where the
        recurrent state is kept (and carried by snapshots, where the prompt goes on to `end`)."""
        total = len(tokens)
        n_batch = self.context.n_batch
        native = self.native
        offset = 0
        while offset < total:
            n = min(total - offset, n_batch - (start + offset) % n_batch)
            n = min([n] + [c - start - offset for c in cuts if start + offset < c < start + offset + n])
            chunk = tokens[offset : offset + n]
            last_chunk = offset + n == total
            first = self._positions.position(start + offset)  # (a text's positions run on from its first)
            for i, tok in enumerate(chunk):
                native.fill(i, tok, first + i, 0, last_chunk and i == n - 1)
            native.decode(n)
            offset += n
            if start + offset in cuts:
                self.memory.cut(start + offset, kept=start + offset < end)
            if on_progress is not None:
                on_progress(offset, total)

    def decode_one(self, token: int, pos: int) -> None:
        if is_media(token):
            self.media.decode_media([token], pos, True)
            return
        self.native.fill(0, token, self._positions.position(pos), 0, True)
        self.native.decode(1)

    def reopen(self, context: ContextSettings | None = None) -> "LlamaBackend":
        """A new context on the same loaded model, with the same settings or `context`'s: no
        second load."""
        return LlamaBackend(self.model, context or replace(self.context, n_seq=1), verbose=LOG.verbose)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "LlamaBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
