"""The llama.cpp backend, on llama-cpp-python's low-level (ctypes) API: a facade over a context
on a loaded model (`llama_context.py`, `model.py`) and the parts built on it, each owning its
state: sampling (`sampler.py`), state bytes (`llama_state.py`), the rows of a batch
(`llama_rows.py`), embeddings (`embeddings.py`) and media (`media.py`); the decoding of a
history, its rewinds and the checkpoints of a ring or a recurrent state (`checkpoints.py`) are its own."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from quipu.engine.native import binding_version, lc
from quipu.engine.sampler import SamplerChain, Sampling
from quipu.engine.text import Spellings

from quipu.engine.base import ProgressFn, RowChain, RowMatcher, SamplerSettings
from quipu.engine.settings import (
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
from quipu.engine.checkpoints import Checkpoint, Checkpoints, pack, unpack
from quipu.engine.embeddings import Embeddings
from quipu.engine.llama_context import NativeContext, context_params
from quipu.engine.media import Media, Positions, is_media, runs
from quipu.engine.llama_rows import BatchRows
from quipu.engine.kvstate import Piece, check_piece
from quipu.engine.llama_state import StateBytes
from quipu.engine.logs import LOG
from quipu.engine.model import LlamaModel, check_gguf
from quipu.engine.devices import no_gpu_reason, supports_offload
from quipu.engine.placement import plan
from quipu.errors import EngineError, InvalidParameter, SnapshotError, UsageError

CHECKPOINTS = 4  # the ring's checkpoints a context keeps (a few prompts back; llama-server keeps 8 by default)
# A recurrent state's: three or four a turn (where its prompt began, where a piped text ends, where
# its reply's generation prompt begins, where the reply begins), so the last two or three turns
# (llama-server keeps up to 32 a slot).
RECURRENT_CHECKPOINTS = 8
_PARTIAL = lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
# And at most so many bytes of them (but two): Qwen 3.5 27B's recurrent state is 157 MB.
CHECKPOINT_BYTES = 1 << 30


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
            self.native = NativeContext(self.model, context)
            self._stack.callback(self.native.close)
        except BaseException:
            self._stack.close()
            raise
        native = self.native
        self.model_path = model.path
        self.placement = model.placement
        self.n_vocab = model.n_vocab
        self.n_ctx_train = model.n_ctx_train
        self.context = native.settings
        self.n_ctx = native.n_ctx
        self.n_ctx_seq = native.n_ctx_seq
        self.ring = native.ring
        self._positions = Positions()
        self.sampling = Sampling(native)
        self._stack.callback(self.sampling.close)
        self.state = StateBytes(native, self._positions)
        self.rows = BatchRows(native)
        self.embeddings = Embeddings(model, native.settings.n_threads, self.name)
        self.media = Media(native, self._positions)
        self._stack.callback(self.media.close)
        # A memory that cannot go back a token (a hybrid or recurrent model's state): its
        # checkpoints are taken where a caller marks a prompt (`prefill`), and go with its snapshots.
        self.recurrent = bool(lc.llama_model_is_recurrent(model.ptr) or lc.llama_model_is_hybrid(model.ptr))
        # The ring's cells, or the recurrent state, where a prompt began to be read (and, for a
        # recurrent state, where the caller marked it).
        self._checkpoints = Checkpoints(RECURRENT_CHECKPOINTS if self.recurrent else CHECKPOINTS, CHECKPOINT_BYTES)
        self.last_rewind: str | None = None  # how the last rewind went back, where it could not go back exactly

    # ---- vocabulary: the model's ----------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return self.model.tokenize(text, add_special=add_special, parse_special=parse_special)

    def token_bytes(self, token: int) -> bytes:
        return self.media.media_text(token) if is_media(token) else self.model.token_bytes(token)

    def max_token_bytes(self) -> int:
        return self.model.max_token_bytes()

    def token_text(self, token: int) -> bytes:
        return self.media.media_text(token) if is_media(token) else self.model.token_text(token)

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

    # ---- media: the media part's --------------------------------------------------------

    def open_projector(self, path: Path) -> None:
        self.media.open_projector(path)

    @property
    def senses(self) -> frozenset[str]:
        return self.media.senses

    @property
    def projector_path(self) -> Path | None:
        return self.media.projector_path

    def media_mark(self, data: bytes) -> str:
        return self.media.media_mark(data)

    def media_tokens(self, k: int) -> list[int]:
        return self.media.media_tokens(k)

    def media_digests(self) -> list[str]:
        return self.media.media_digests()

    def drop_media_after(self, n: int) -> list[str]:
        return self.media.drop_media_after(n)

    def place_media(self, tokens: Sequence[int]) -> None:
        self.media.place_media(tokens)

    # ---- the rows of a batch: the rows part's ---------------------------------------------

    def decode_batch(self, items: Sequence[tuple[int, int, int, bool]]) -> None:
        self.rows.decode_batch(items)

    def seq_keep(self, seq: int, n_keep: int) -> None:
        self.rows.seq_keep(seq, n_keep)

    def seq_copy(self, src: int, dst: int) -> None:
        self.rows.seq_copy(src, dst)

    def row_sampler(self, settings: SamplerSettings) -> SamplerChain:
        return self.rows.row_sampler(settings)

    def row_matcher(self, settings: SamplerSettings) -> RowMatcher | None:
        return self.rows.row_matcher(settings)

    def sample_rows(self, rows: Sequence[tuple[RowChain, RowMatcher | None, int, int]]) -> list[int]:
        return self.rows.sample_rows(rows)

    # ---- state bytes: the state part's ----------------------------------------------------

    def snapshot_bytes(self) -> bytes | memoryview:
        """The context's state; a recurrent state's with its checkpoints (`checkpoints.pack`)."""
        state = self.state.snapshot_bytes()
        return pack([c for c in self._checkpoints if c.kept], state) if self.recurrent else state

    def restore_bytes(self, data: bytes | memoryview) -> None:
        try:
            held, state = unpack(data)
        except SnapshotError as exc:
            raise EngineError(f"the saved context state is damaged: {exc}") from None
        self._checkpoints.clear()
        self._positions.clear()
        self.state.restore_bytes(state)
        if self.recurrent:
            last = lc.llama_memory_seq_pos_max(self.native.mem, 0)
            self._checkpoints.replace([c for c in held if c.at <= last + 1])

    def rewinds_to(self, n_keep: int) -> int:
        """How many of the history's tokens `truncate(n_keep)` would keep: a recurrent state goes
        back to its nearest checkpoint (or to nothing)."""
        if not self.recurrent or n_keep >= self.positions():
            return min(n_keep, self.positions())
        return max([c.n for c in self._checkpoints.latest(n_keep)] + [0])

    def restore_points(self) -> list[int] | None:
        """The counts of the history's tokens a restore of `snapshot_bytes` can be cut back to:
        a recurrent state's checkpoints and its end; None: any."""
        return [c.n for c in self._checkpoints if c.kept] + [self.positions()] if self.recurrent else None

    @property
    def checkpoints(self) -> list[Checkpoint]:
        """The checkpoints the context keeps (a ring's or a recurrent state's), oldest first."""
        return list(self._checkpoints)

    def partial_state(self, since: int | None = None) -> str | None:
        if since is not None and self.recurrent and self.rewinds_to(since) != since:
            return "a piece from where the recurrent state has no checkpoint"
        return self.state.partial_state(since)

    def state_since(self, start: int, end: int | None = None) -> bytes | memoryview:
        """The cells from position `start` on; a hybrid's with its recurrent state at the end (or
        at `end`, a checkpoint's, the cells before it alone) and the checkpoints from `start` on
        (`checkpoints.pack`), which a restore of the piece needs."""
        if not self.recurrent:
            return self.state.state_since(start)
        cut = self._checkpoints.at(end) if end is not None and end < self.positions() else None
        if end is not None and end < self.positions() and cut is None:
            raise EngineError(f"the recurrent state has no checkpoint at token {end}")
        piece = self.state.state_since(start, cut.state if cut is not None else None, end)
        # (and the one it starts from, where no snapshot carried it: a restore goes back there first)
        # (not the one it ends at: the piece's own recurrent state is that one)
        last = self.positions() if cut is None else cut.n
        return pack([c for c in self._checkpoints
                     if (c.kept and start < c.n < last) or (c.n == start and not c.kept)], piece)

    def check_piece(self, piece: bytes | memoryview, start: int, cells: int) -> Piece:
        """What a piece of `state_since(start)` holds, checked to be `cells` cells from `start` on
        in the layout quipu reads (kvstate.py); SnapshotError where it is not."""
        _, state = unpack(piece)
        return check_piece(state, seq_id=1, cells=cells, first=start, n_layer=self.model.n_layer_kv,
                           window=self.model.n_swa if self.ring else None, recurrent=self.recurrent)

    def restore_pieces(self, base: bytes | memoryview, pieces: Sequence[tuple[int, bytes | memoryview]]) -> None:
        """A state saved whole, then pieces of it, in order. A hybrid's piece goes back to its
        start first (the checkpoint there: a piece is only made from one), and brings its
        recurrent state and checkpoints."""
        if not self.recurrent:
            self.state.restore_pieces(base, pieces)
            return
        self.restore_bytes(base)
        mem = self.native.mem
        for start, piece in pieces:
            try:
                held, state = unpack(piece)
            except SnapshotError as exc:
                raise EngineError(f"a piece of the saved context state is damaged: {exc}") from None
            if self.positions() != start:
                for c in held:
                    if c.n == start:
                        self._checkpoints.add(c)
                self.truncate(start)
            if self.positions() != start:
                lc.llama_memory_clear(mem, True)
                raise EngineError("a piece of the saved context state begins where its state cannot go back to")
            self.native.set_seq_state(state, 1, "a piece of the saved context state")
            lc.llama_memory_seq_cp(mem, 1, 0, -1, -1)
            lc.llama_memory_seq_rm(mem, 1, -1, -1)
            for c in held:
                self._checkpoints.add(c)

    def positions(self) -> int:
        """How many tokens of the history the context holds (its positions, where media take as
        many as their cells)."""
        return self.state.positions()

    def embed(self, texts: Sequence[str], pooling: str = "mean") -> list[list[float]]:
        return self.embeddings.embed(texts, pooling)

    # ---- decoding -----------------------------------------------------------------------

    def prefill(self, tokens: Sequence[int], start: int, on_progress: ProgressFn | None = None,
                marks: Sequence[int] = ()) -> None:
        """Decodes `tokens` at positions `start`, ... in steps that end where a multiple of
        n_batch does (see `step_start`); a medium's placeholders as its projector's embeddings.
        A recurrent state is kept where the prompt begins and at each of `marks` (counts of the
        history's tokens: where a later prompt may part from this one), a step ending there."""
        if (self.ring or self.recurrent) and start > 0 and tokens:
            self._checkpoint(start)  # (a prompt begins: where a rewind comes back to)
        cuts = sorted({m for m in marks if start < m <= start + len(tokens)}) if self.recurrent else []
        if any(is_media(t) for t in tokens):
            total = len(tokens)
            for begin, end, media in runs(tokens):
                if media:
                    self.media.decode_media(tokens[begin:end], start + begin, end == total)
                    if start + end in cuts:
                        self._checkpoint(start + end, kept=end < total)
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
                self._checkpoint(start + offset, kept=start + offset < end)
            if on_progress is not None:
                on_progress(offset, total)

    def step_start(self, n: int) -> int:
        """The last position at or before `n` where a prefill step starts. llama.cpp's attention
        computes a token by another road in a step of a few tokens than in a step of many (flash
        attention's tiled kernel), so the last bits of what it keeps differ; a context restored
        to such a position and read on computes what one read from the start computes. A
        recurrent state goes back to its checkpoints, where a step ends (`prefill`'s marks): `n`."""
        return n if self.recurrent else n - n % self.context.n_batch

    def decode_one(self, token: int, pos: int) -> None:
        if is_media(token):
            self.media.decode_media([token], pos, True)
            return
        self.native.fill(0, token, self._positions.position(pos), 0, True)
        self.native.decode(1)

    def _checkpoint(self, n: int, *, kept: bool = False) -> None:
        """Keeps the ring's cells, or the recurrent state, as they are before the `n`th token is
        read, for a rewind to there or later that the ring no longer holds the window of, or that
        a recurrent state cannot make; the last few of them (`Checkpoints`)."""
        held = self._checkpoints.at(n)
        if held is not None and (held.kept or not kept):
            return
        # (the window's cells alone, which are all a ring laid out for `at` needs of them; the
        # recurrent state alone)
        self._checkpoints.add(Checkpoint(n, self._positions.position(n), self.native.seq_state(0, _PARTIAL), kept))

    def truncate(self, n_keep: int) -> None:
        """Keeps the first `n_keep` positions. A sliding-window cache that no longer holds the
        window those positions end with (llama_memory_seq_pos_min past it) goes back to the last
        checkpoint before them (a ring's: `positions()` then says fewer, and the rest is read
        again), or is emptied: `positions()` then says 0, and the tokens are read again."""
        self.last_rewind = None
        if n_keep <= 0:
            self._empty()
            return
        mem = self.native.mem
        keep = self._positions.position(n_keep)
        self._positions.forget(n_keep)
        if self.recurrent:
            self._rewind_recurrent(n_keep, keep)
            return
        if not lc.llama_memory_seq_rm(mem, 0, keep, -1):
            raise EngineError("llama.cpp could not trim the context")
        if self.ring:
            self._checkpoints.keep_to(keep)
            if self.state.settle_ring(keep):
                return
            for c in self._checkpoints.latest(n_keep):
                lc.llama_memory_seq_rm(mem, 0, c.at, -1)
                if self.state.settle_ring(c.at, c.state):
                    self._positions.forget(c.n)
                    self._checkpoints.keep_to(c.at)
                    self.last_rewind = f"went back to its checkpoint at token {c.n} (the prompt shares {n_keep}) and reads on from there"
                    return
            self._empty()
            self.last_rewind = f"had no checkpoint at or before token {n_keep}: it is read again from the start"
            return
        n_swa = self.model.n_swa
        if n_swa > 0 and lc.llama_memory_seq_pos_min(mem, 0) > max(0, keep - n_swa):
            self._empty()

    def _rewind_recurrent(self, n_keep: int, keep: int) -> None:
        """Goes back to the first `n_keep` tokens (`keep` positions) on a memory whose recurrent
        state cannot drop a token: where the state ends before them, only attention cells go;
        else the nearest checkpoint at or before them is set back first, and the context holds
        what it held there (`positions()` says how much: the rest is read again); with none,
        nothing."""
        mem = self.native.mem
        if lc.llama_memory_seq_rm(mem, 0, keep, -1):  # (the state ends before `keep`: nothing of it to undo)
            self._checkpoints.keep_to(keep)
            return
        for c in self._checkpoints.latest(n_keep):
            try:
                self.native.set_seq_state(c.state, 0, "a checkpoint of the recurrent state", _PARTIAL)
            except EngineError:
                break  # (the context was emptied)
            # (the state set back must end where the checkpoint says, the attention cells going on
            # past it: one read from a file that says otherwise is not trusted, and is read again)
            if lc.llama_memory_seq_pos_max(mem, 0) == c.at - 1 and lc.llama_memory_seq_rm(mem, 0, c.at, -1):
                self._positions.forget(c.n)
                self._checkpoints.keep_to(c.at)
                if c.n < n_keep:
                    self.last_rewind = f"went back to its checkpoint at token {c.n} (the prompt shares {n_keep}) and reads on from there"
                return
        self._empty()
        self.last_rewind = f"had no checkpoint at or before token {n_keep}: it is read again from the start"

    def _empty(self) -> None:
        """Nothing held: the cells, the media's places, the checkpoints, a batch's shared beginning."""
        lc.llama_memory_clear(self.native.mem, True)
        self._positions.clear()
        self._checkpoints.clear()
        self.rows.forget()

    def shift_refused(self) -> str | None:
        """Why cells cannot be dropped from the middle of the context with those after them
        moved down (None: they can). llama.cpp moves a cache's positions (re-rotating RoPE keys)
        where `llama_memory_can_shift` says so: a plain attention cache of a model with one
        position per token (not M-RoPE); not a sliding-window cache, whose evicted cells a shift
        cannot bring back, nor a recurrent model's state, which is not kept a token a cell."""
        why = ("a recurrent or hybrid model's memory" if self.recurrent else self.partial_state()) or \
            ("a sliding-window cache" if self.model.n_swa > 0 else None)
        if why:
            return why
        if not lc.llama_memory_can_shift(self.native.mem):
            return "this model's cache cannot move its positions"
        return None

    def shift_out(self, start: int, end: int) -> None:
        """Drops positions [start, end) and moves those after them down by end - start."""
        mem = self.native.mem
        if not lc.llama_memory_seq_rm(mem, 0, start, end):
            raise EngineError("llama.cpp could not drop part of the context")
        lc.llama_memory_seq_add(mem, 0, end, -1, start - end)

    def reopen(self) -> "LlamaBackend":
        """A new context with the same settings on the same loaded model: no second load."""
        return LlamaBackend(self.model, self.context, verbose=LOG.verbose)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "LlamaBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
