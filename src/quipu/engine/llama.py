"""The llama.cpp backend, on llama-cpp-python's low-level (ctypes) API: a context on a loaded
model (model.py), its decoding, its samplers (native, with a grammar's mask, filters and
processors applied to the logits first), its state bytes and embeddings."""

from __future__ import annotations

import ctypes
import dataclasses
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from quipu.engine.native import binding_version, lc
from quipu.engine.sampler import SamplerChain

from quipu.engine.base import (
    KV_TYPES,
    ContextSettings,
    LogitsProcessor,
    ProgressFn,
    SamplerSettings,
    TokenFilter,
    available_cpus,
    refuse_embeddings,
)
from quipu.engine.logs import LOG
from quipu.engine.model import LlamaModel
from quipu.errors import EngineError, InvalidParameter, ModelLoadError

if TYPE_CHECKING:
    from quipu.engine.constraint import MaskBatch, Matcher

MAX_DEFAULT_CTX = 8192
_KV_GGML_TYPES = {"f16": lc.GGML_TYPE_F16, "q8_0": lc.GGML_TYPE_Q8_0}

class LlamaBackend:
    """One context on a model (loaded from `model_path`, or a shared `LlamaModel`). Close it (or
    use it as a context manager) to free its native memory; the model goes with its last context."""

    name = "llama.cpp"
    build = f"llama-cpp-python {binding_version()}"
    supports_embeddings = True
    EMBED_BATCH = 2048
    EMBED_SEQS = 64

    def __init__(self, model_path: Path | LlamaModel, context: ContextSettings = ContextSettings(), *,
                 verbose: bool = False):
        if context.kv_type not in KV_TYPES:
            raise InvalidParameter(f"--kv-type must be one of {', '.join(KV_TYPES)}, not '{context.kv_type}'")
        LOG.verbose = verbose
        self._stack = ExitStack()
        try:
            model = model_path if isinstance(model_path, LlamaModel) else LlamaModel(model_path)
            self.model = model.acquire()
            self._stack.callback(model.release)
            self._open_context(context)
        except BaseException:
            self._stack.close()
            raise
        self.model_path = self.model.path
        self.n_vocab = self.model.n_vocab
        self.n_ctx_train = self.model.n_ctx_train
        self.embed_calls = 0

    def _open_context(self, context: ContextSettings) -> None:
        n_ctx = context.n_ctx or min(self.model.n_ctx_train or MAX_DEFAULT_CTX, MAX_DEFAULT_CTX)
        n_threads = context.n_threads or available_cpus()
        n_batch = max(1, min(context.n_batch, n_ctx))
        n_seq = max(1, context.n_seq)
        self.context = ContextSettings(n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads, kv_type=context.kv_type,
                                       n_seq=n_seq)

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
        cparams.no_perf = True
        kv = _KV_GGML_TYPES[context.kv_type]
        cparams.type_k = kv
        cparams.type_v = kv
        # A quantized V cache needs flash attention; f16 keeps llama.cpp's automatic choice
        # off so that the state bytes mean the same thing on every run (and a batch's rows are
        # computed as lone runs are: with it on, most greedy rows would read differently).
        cparams.flash_attn_type = (
            lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if context.kv_type != "f16" else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        LOG.clear_errors()
        ctx = lc.llama_init_from_model(self.model.ptr, cparams)
        if not ctx:
            raise ModelLoadError(f"llama.cpp could not create a context of {n_ctx} tokens{LOG.reason()}")
        self._ctx = ctx
        self._stack.callback(lc.llama_free, ctx)
        # llama.cpp rounds small contexts up; the user's number is the one we keep to.
        self.n_ctx = min(n_ctx, lc.llama_n_ctx(ctx))
        self._mem = lc.llama_get_memory(ctx)

        self.n_ctx_seq = lc.llama_n_ctx_seq(ctx) if n_seq > 1 else self.n_ctx
        self._batch = lc.llama_batch_init(n_batch, 0, 1)
        self._stack.callback(lc.llama_batch_free, self._batch)
        self._chain: SamplerChain | None = None
        self._sampler = None
        self._grammar = None  # a constraint.Matcher while replies keep to a grammar
        self._masks: "MaskBatch | None" = None  # for the rows of a batch under grammars
        self._stack.callback(self._free_sampler)

    # ---- vocabulary: the model's ----------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return self.model.tokenize(text, add_special=add_special, parse_special=parse_special)

    def token_bytes(self, token: int) -> bytes:
        return self.model.token_bytes(token)

    def max_token_bytes(self) -> int:
        return self.model.max_token_bytes()

    def token_text(self, token: int) -> bytes:
        return self.model.token_text(token)

    def is_control(self, token: int) -> bool:
        return self.model.is_control(token)

    def control_texts(self) -> list[str]:
        return self.model.control_texts()

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
        total = len(tokens)
        n_batch = self.context.n_batch
        batch = self._batch
        for offset in range(0, total, n_batch):
            chunk = tokens[offset : offset + n_batch]
            n = len(chunk)
            last_chunk = offset + n == total
            for i, tok in enumerate(chunk):
                batch.token[i] = tok
                batch.pos[i] = start + offset + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = last_chunk and i == n - 1
            batch.n_tokens = n
            self._decode(batch)
            if on_progress is not None:
                on_progress(offset + n, total)

    def decode_one(self, token: int, pos: int) -> None:
        batch = self._batch
        batch.token[0] = token
        batch.pos[0] = pos
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

    def truncate(self, n_keep: int) -> None:
        """Keeps the first `n_keep` positions. A sliding-window cache that no longer holds the
        window those positions end with (llama_memory_seq_pos_min past it) is emptied instead:
        `positions()` then says 0, and the tokens are read again."""
        if n_keep <= 0:
            lc.llama_memory_clear(self._mem, True)
            return
        if not lc.llama_memory_seq_rm(self._mem, 0, n_keep, -1):
            raise EngineError("llama.cpp could not trim the context")
        n_swa = lc.llama_model_n_swa(self.model.ptr)
        if n_swa > 0 and lc.llama_memory_seq_pos_min(self._mem, 0) > max(0, n_keep - n_swa):
            lc.llama_memory_clear(self._mem, True)

    def shift_refused(self) -> str | None:
        """Why cells cannot be dropped from the middle of the context with those after them
        moved down (None: they can). llama.cpp moves a cache's positions (re-rotating RoPE keys)
        where `llama_memory_can_shift` says so: a plain attention cache of a model with one
        position per token (not M-RoPE); not a sliding-window cache smaller than the context,
        whose evicted cells a shift cannot bring back, nor a recurrent model's state, which is
        not kept a token a cell."""
        why = self.partial_state()
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
        return lc.llama_memory_seq_pos_max(self._mem, 0) + 1

    # ---- several sequences at once (a context opened with n_seq > 1) --------------------------

    def decode_batch(self, items: Sequence[tuple[int, int, int, bool]]) -> None:
        """Decodes (token, position, sequence, wants logits) items, at most n_batch, in one step;
        the logits of the i-th item that wanted them are then at batch index i."""
        batch = self._batch
        for i, (tok, pos, seq, logits) in enumerate(items):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        batch.n_tokens = len(items)
        self._decode(batch)

    def seq_keep(self, seq: int, n_keep: int) -> None:
        """Forgets sequence `seq`'s positions from `n_keep` on."""
        if not lc.llama_memory_seq_rm(self._mem, seq, n_keep, -1):
            raise EngineError("llama.cpp could not trim a sequence")

    def seq_copy(self, src: int, dst: int) -> None:
        """Sequence `dst` becomes a copy of `src` (which must be all it holds: a shared beginning)."""
        lc.llama_memory_seq_cp(self._mem, src, dst, -1, -1)

    def row_sampler(self, settings: SamplerSettings) -> SamplerChain:
        """A sampler chain of its own, for one sequence of a batch (free it when done)."""
        return SamplerChain(self.n_vocab, settings)

    def sample_at(self, chain: SamplerChain, draw_seed: int, index: int) -> int:
        """Samples (and accepts) with `chain` from the logits at batch index `index`."""
        chain.reseed(draw_seed)
        return lc.llama_sampler_sample(chain.ptr, self._ctx, index)

    def row_matcher(self, settings: SamplerSettings):
        """A grammar's matcher of its own, for one sequence of a batch (None without a grammar)."""
        return self._matcher_for(settings)

    def sample_rows(self, rows: Sequence[tuple[SamplerChain, "Matcher | None", int, int]]) -> list[int]:
        """One token (sampled and accepted) for each (chain, matcher or None, draw seed, batch
        index) of a step. The masks of every row under a grammar are computed together, on
        llguidance's threads, and applied to each row's logits before its chain draws."""
        constrained = [(matcher, k) for k, (_, matcher, _, _) in enumerate(rows) if matcher is not None]
        if constrained:
            import numpy as np

            from quipu.engine.constraint import MaskBatch

            masks = self._masks
            if masks is None or masks.masks.shape[0] < len(rows):
                masks = self._masks = MaskBatch(self.n_vocab, max(len(rows), self.context.n_seq))
            masks.fill(constrained)
            for _, k in constrained:
                logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(self._ctx, rows[k][3]), shape=(self.n_vocab,))
                masks.apply(logits, k)
        tokens = []
        for chain, matcher, draw_seed, index in rows:
            token = self.sample_at(chain, draw_seed, index)
            if matcher is not None:
                try:
                    matcher.accept(token)
                except EngineError:
                    raise EngineError("no token is allowed here (the grammar or the biases rule out every one)") from None
            tokens.append(token)
        return tokens

    def reopen(self) -> "LlamaBackend":
        """A new context with the same settings on the same loaded model: no second load."""
        return LlamaBackend(self.model, self.context, verbose=LOG.verbose)

    # ---- sampling -----------------------------------------------------------------------

    def set_sampler(self, settings: SamplerSettings) -> None:
        matcher = self._matcher_for(settings)  # a bad grammar is refused before anything changes
        self._free_sampler()
        self._settings = settings
        self._grammar = matcher
        self._chain = SamplerChain(self.n_vocab, settings)
        self._sampler = self._chain.ptr

    def _matcher_for(self, settings: SamplerSettings):
        if settings.grammar is None:
            return None
        from quipu.engine.constraint import Matcher  # llguidance: only for a constrained reply

        return Matcher(self.model, settings.grammar)

    def _free_sampler(self) -> None:
        if self._chain is not None:
            self._chain.free()
            self._chain = self._sampler = None
        self._grammar = None

    @property
    def chain(self) -> SamplerChain:
        """The sampler chain (made by `set_sampler`, which a session calls first)."""
        if self._chain is None:
            raise EngineError("no sampler is set on this context")
        return self._chain

    def sampler_reset(self, window: Sequence[int]) -> None:
        self.chain.reset(window)

    def sampler_accept(self, tokens: Sequence[int]) -> None:
        self.chain.accept(tokens)

    def set_constraint(self, grammar) -> None:
        """From the next token on, the reply keeps to `grammar` (an `engine.grammar.Grammar`, from
        its start), or, with None, to the sampler settings' own grammar again."""
        self._grammar = self._matcher_for(self._settings if grammar is None else
                                          dataclasses.replace(self._settings, grammar=grammar))

    def constraint_reset(self, reply: Sequence[int]) -> None:
        if self._grammar is not None:
            self._grammar.replay(reply)

    def _reseed(self, draw_seed: int) -> None:
        self.chain.reseed(draw_seed)

    def sample(self, draw_seed: int, history: Sequence[int] = (), processors: Sequence[LogitsProcessor] = (),
               token_filter: TokenFilter | None = None) -> int:
        """The chain's draw from the last logits. A grammar's mask, the processors and the filter
        change those logits in place first (ruled-out tokens become -inf), so that the native
        chain draws as it always does, seeded, among the tokens left."""
        self._reseed(draw_seed)
        if self._grammar is not None or processors or token_filter is not None:
            self._shape(history, processors, token_filter)
        token = lc.llama_sampler_sample(self._sampler, self._ctx, -1)
        if self._grammar is not None:
            try:
                self._grammar.accept(token)
            except EngineError:
                raise EngineError("no token is allowed here (the grammar, the filter or the biases rule out "
                                  "every one)") from None
        return token

    def _shape(self, history: Sequence[int], processors: Sequence[LogitsProcessor],
               token_filter: TokenFilter | None) -> None:
        import numpy as np

        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(self._ctx, -1), shape=(self.n_vocab,))
        for processor in processors:
            processor(history, logits)
        if token_filter is not None:
            allowed = token_filter(history)
            if allowed is not None:
                keep = np.fromiter(allowed, dtype=np.int64)
                kept = logits[keep].copy()
                logits.fill(-np.inf)
                logits[keep] = kept
        if self._grammar is not None:
            self._grammar.apply(logits)

    # ---- state --------------------------------------------------------------------------

    def snapshot_bytes(self) -> memoryview:
        """The context's state, as a view of the one buffer llama.cpp wrote it into (no copy)."""
        return self._seq_state(0)

    def _seq_state(self, seq: int) -> memoryview:
        size = lc.llama_state_seq_get_size(self._ctx, seq)
        buf = (ctypes.c_uint8 * size)()
        written = lc.llama_state_seq_get_data(self._ctx, buf, size, seq)
        if written != size:
            raise EngineError("llama.cpp could not write the context state")
        return memoryview(buf).cast("B")

    def _set_seq_state(self, data: bytes | memoryview, seq: int, what: str) -> None:
        """Gives llama.cpp a sequence's state; refused, the context is emptied."""
        view = memoryview(data).cast("B")
        if view.readonly:
            buf = (ctypes.c_uint8 * len(view)).from_buffer_copy(view)
        else:  # read where it lies: a state is tens of megabytes
            buf = (ctypes.c_uint8 * len(view)).from_buffer(view)
        if lc.llama_state_seq_set_data(self._ctx, buf, len(view), seq) != len(view):
            lc.llama_memory_clear(self._mem, True)
            raise EngineError(f"llama.cpp refused {what}{LOG.reason()}")

    def partial_state(self) -> str | None:
        """Why the state of some cells cannot be saved and restored apart from the rest (None:
        it can): a plain attention cache of one sequence, whose positions are the tokens'."""
        model = self.model.ptr
        if self.context.n_seq != 1:
            return "a context of several sequences"
        if lc.llama_model_is_recurrent(model) or lc.llama_model_is_hybrid(model):
            return "a recurrent or hybrid model's memory"
        if lc.llama_model_n_swa(model) > 0:
            return "a sliding-window cache"
        return None

    @property
    def n_layer(self) -> int:
        return lc.llama_model_n_layer(self.model.ptr)

    def state_since(self, start: int) -> memoryview:
        """The state of the cells at positions `start` on: llama.cpp writes them as the state of
        a second sequence that shares them for the moment (see kvstate.py)."""
        lc.llama_memory_seq_cp(self._mem, 0, 1, start, -1)
        try:
            return self._seq_state(1)
        finally:
            lc.llama_memory_seq_rm(self._mem, 1, -1, -1)

    def restore_pieces(self, base: bytes | memoryview, pieces: Sequence[tuple[int, bytes | memoryview]]) -> None:
        """Restores a state saved whole, then pieces of it saved by `state_since`, in order, each
        (the position it was taken from, its bytes): the cells from there on are dropped, the
        piece read as the second sequence's, whose cells then join the first."""
        self.restore_bytes(base)
        for start, piece in pieces:
            lc.llama_memory_seq_rm(self._mem, 0, start, -1)
            self._set_seq_state(piece, 1, "a piece of the saved context state")
            lc.llama_memory_seq_cp(self._mem, 1, 0, -1, -1)
            lc.llama_memory_seq_rm(self._mem, 1, -1, -1)

    def restore_bytes(self, data: bytes | memoryview) -> None:
        lc.llama_memory_clear(self._mem, True)
        self._set_seq_state(data, 0, "the saved context state")

    def embed(self, texts: Sequence[str], pooling: str = "mean") -> list[list[float]]:
        """One pooled embedding per text, several texts to each llama_decode call. The embedding
        context lives for this call only."""
        model = self.model.ptr
        n_embd = lc.llama_model_n_embd(model)
        encoder_only = lc.llama_model_has_encoder(model) and not lc.llama_model_has_decoder(model)
        tokenized = [self.tokenize(t, add_special=True, parse_special=False) for t in texts]
        for i, toks in enumerate(tokenized):
            if len(toks) > self.EMBED_BATCH:
                raise InvalidParameter(f"text {i} is {len(toks)} tokens; at most {self.EMBED_BATCH} can be embedded")
        out: list[list[float]] = []
        with ExitStack() as stack:
            ctx = self._embedding_context(pooling)
            stack.callback(lc.llama_free, ctx)
            batch = lc.llama_batch_init(self.EMBED_BATCH, 0, 1)
            stack.callback(lc.llama_batch_free, batch)
            start = 0
            while start < len(tokenized):
                group: list[list[int]] = []
                used = 0
                while (start + len(group) < len(tokenized) and len(group) < self.EMBED_SEQS
                       and used + len(tokenized[start + len(group)]) <= self.EMBED_BATCH):
                    used += len(tokenized[start + len(group)])
                    group.append(tokenized[start + len(group)])
                n = 0
                for seq, toks in enumerate(group):
                    for pos, tok in enumerate(toks):
                        batch.token[n], batch.pos[n], batch.n_seq_id[n] = tok, pos, 1
                        batch.seq_id[n][0], batch.logits[n] = seq, True
                        n += 1
                batch.n_tokens = n
                lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
                rc = (lc.llama_encode if encoder_only else lc.llama_decode)(ctx, batch)
                if rc != 0:
                    raise EngineError(f"llama.cpp failed to compute embeddings (code {rc}){LOG.reason()}")
                for seq in range(len(group)):
                    ptr = lc.llama_get_embeddings_seq(ctx, seq)
                    if not ptr:
                        raise refuse_embeddings(self.name)
                    out.append(ptr[:n_embd])
                self.embed_calls += 1
                start += len(group)
        return out

    def _embedding_context(self, pooling: str):
        types = {"mean": lc.LLAMA_POOLING_TYPE_MEAN, "last": lc.LLAMA_POOLING_TYPE_LAST, "cls": lc.LLAMA_POOLING_TYPE_CLS}
        if pooling not in types:
            raise InvalidParameter(f"--pooling must be one of {', '.join(types)}, not '{pooling}'")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = self.EMBED_BATCH
        cparams.n_seq_max = self.EMBED_SEQS
        cparams.kv_unified = True
        cparams.n_threads = cparams.n_threads_batch = self.context.n_threads
        cparams.embeddings = True
        cparams.pooling_type = types[pooling]
        cparams.no_perf = True
        LOG.clear_errors()
        ctx = lc.llama_init_from_model(self.model.ptr, cparams)
        if not ctx:
            raise refuse_embeddings(self.name)
        return ctx

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "LlamaBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
