"""The llama.cpp backend, on llama-cpp-python's low-level (ctypes) API: a context on a loaded
model (model.py), its decoding, its samplers (native, or shaped in Python for grammars,
filters and processors), its state bytes and embeddings."""

from __future__ import annotations

import ctypes
from contextlib import ExitStack
from pathlib import Path
from typing import Sequence

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
from quipu.engine.grammar import init_grammar_sampler
from quipu.engine.logs import LOG
from quipu.engine.model import LlamaModel
from quipu.engine.text import utf8_after
from quipu.errors import EngineError, InvalidParameter, ModelLoadError

MAX_DEFAULT_CTX = 8192
_KV_GGML_TYPES = {"f16": lc.GGML_TYPE_F16, "q8_0": lc.GGML_TYPE_Q8_0}
# How many of the likeliest tokens a rejected token's grammar is tried on before all of them.
GRAMMAR_FIRST_TRY = 512
# llama_token_data as NumPy lays it out: candidates built from the logits without a Python loop.
_TOKEN_DATA = [("id", "<i4"), ("logit", "<f4"), ("p", "<f4")]

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
        cparams.n_seq_max = n_seq  # each sequence has its own n_ctx / n_seq cells (not unified)
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
        self._grammar = None
        self._id_range = None
        self._utf8_pending = b""  # the bytes of a character the reply has begun and not finished
        self._utf8_standalone = None
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
        if n_keep <= 0:
            lc.llama_memory_clear(self._mem, True)
        elif not lc.llama_memory_seq_rm(self._mem, 0, n_keep, -1):
            raise EngineError("llama.cpp could not trim the context")

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

    def reopen(self) -> "LlamaBackend":
        """A new context with the same settings on the same loaded model: no second load."""
        return LlamaBackend(self.model, self.context, verbose=LOG.verbose)

    # ---- sampling -----------------------------------------------------------------------

    def set_sampler(self, settings: SamplerSettings) -> None:
        grammar = init_grammar_sampler(lc, self.model.vocab, settings.grammar) if settings.grammar else None
        self._free_sampler()
        self._settings = settings
        self._grammar = grammar
        self._chain = SamplerChain(self.n_vocab, settings)
        self._sampler = self._chain.ptr

    def _free_sampler(self) -> None:
        if self._chain is not None:
            self._chain.free()
            self._chain = self._sampler = None
        if self._grammar is not None:
            lc.llama_sampler_free(self._grammar)
            self._grammar = None

    def sampler_reset(self, window: Sequence[int]) -> None:
        self._chain.reset(window)

    def sampler_accept(self, tokens: Sequence[int]) -> None:
        self._chain.accept(tokens)

    def constraint_reset(self, reply: Sequence[int]) -> None:
        if self._grammar is None:
            return
        lc.llama_sampler_reset(self._grammar)
        self._utf8_pending = b""
        for tok in reply:
            # llama.cpp aborts the process on a token its grammar does not allow: check first.
            if not self._grammar_allows(tok):
                lc.llama_sampler_reset(self._grammar)
                raise InvalidParameter("the reply so far does not keep to the grammar; generate it anew instead")
            lc.llama_sampler_accept(self._grammar, tok)
            self._utf8_pending = utf8_after(self._utf8_pending, self.token_bytes(tok)) or b""

    def _grammar_allows(self, token: int) -> bool:
        import numpy as np

        one = np.array([(token, 0.0, 0.0)], dtype=_TOKEN_DATA)
        self._apply(self._grammar, one)
        return not np.isneginf(one["logit"][0])

    def _reseed(self, draw_seed: int) -> None:
        self._chain.reseed(draw_seed)

    def sample(self, draw_seed: int, history: Sequence[int] = (), processors: Sequence[LogitsProcessor] = (),
               token_filter: TokenFilter | None = None) -> int:
        self._reseed(draw_seed)
        if self._grammar is None and not processors and token_filter is None:
            return lc.llama_sampler_sample(self._sampler, self._ctx, -1)
        return self._sample_shaped(draw_seed, history, processors, token_filter)

    def _sample_shaped(self, draw_seed: int, history: Sequence[int], processors: Sequence[LogitsProcessor],
                       token_filter: TokenFilter | None) -> int:
        """Sampling with Python in the loop, as llama.cpp's common sampler does it: processors and
        the filter change the logits in place; the chain picks a token; the grammar only checks
        that one token, and only when it is rejected is the grammar applied to every candidate
        and the token picked again (the same draw)."""
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
        token = self._pick(logits, with_grammar=False)
        if self._grammar is not None:
            # What a grammar admits must also be text: a token that would break UTF-8 (a random
            # or very hot model emits stray bytes) is as rejected as one the grammar refuses.
            if not (self._grammar_allows(token) and self._utf8_continues(token)):
                self._reseed(draw_seed)
                token = self._pick_allowed(logits, history)
                if not self._utf8_continues(token):
                    self._reseed(draw_seed)
                    token = self._pick_allowed(np.where(self._utf8_mask(), logits, -np.inf), history)
                if not (self._grammar_allows(token) and self._utf8_continues(token)):
                    raise EngineError("the grammar allows no token here")
            lc.llama_sampler_accept(self._grammar, token)
            self._utf8_pending = utf8_after(self._utf8_pending, self.token_bytes(token)) or b""
        lc.llama_sampler_accept(self._sampler, token)
        return token

    def _pick_allowed(self, logits, history: Sequence[int]) -> int:
        """The chain's pick among the tokens the grammar allows. The grammar is tried on the
        likeliest few hundred tokens first (by logit after the biases and the repeat penalty, as
        the chain sees them): when at least top-k of them are allowed (one, for greedy), those
        hold the chain's whole choice; only otherwise is every token of the vocabulary checked."""
        import numpy as np

        settings = self._settings
        need = 1 if settings.temperature <= 0 else settings.top_k
        few = min(self.n_vocab, GRAMMAR_FIRST_TRY)
        if need <= 0 or few == self.n_vocab:
            return self._pick(logits, with_grammar=True)
        seen = logits.copy()
        for token, bias in settings.logit_bias:
            seen[token] += bias
        if settings.repeat_penalty != 1.0 and settings.repeat_last_n:
            window = np.unique(np.asarray(history[-settings.repeat_last_n:], dtype=np.int64))
            window = window[(window >= 0) & (window < self.n_vocab)]
            held = seen[window]
            seen[window] = np.where(held <= 0, held * settings.repeat_penalty, held / settings.repeat_penalty)
        top = np.argpartition(-seen, few - 1)[:few]
        candidates = np.empty(few, dtype=_TOKEN_DATA)
        candidates["id"] = top
        candidates["logit"] = logits[top]
        candidates["p"] = 0.0
        self._apply(self._grammar, candidates)
        if np.count_nonzero(np.isfinite(candidates["logit"])) < need:
            return self._pick(logits, with_grammar=True)
        selected = self._apply(self._sampler, candidates)
        if selected < 0:
            raise EngineError("no token is allowed here (the grammar, the filter or the biases rule out every one)")
        return int(candidates["id"][selected])

    def _utf8_continues(self, token: int) -> bool:
        return utf8_after(self._utf8_pending, self.token_bytes(token)) is not None

    def _utf8_mask(self):
        """Which tokens keep the reply valid UTF-8 after what it holds."""
        import numpy as np

        if self._utf8_pending:
            return np.fromiter((self._utf8_continues(t) for t in range(self.n_vocab)), dtype=bool, count=self.n_vocab)
        if self._utf8_standalone is None:
            self._utf8_standalone = np.fromiter((utf8_after(b"", self.token_bytes(t)) is not None
                                                 for t in range(self.n_vocab)), dtype=bool, count=self.n_vocab)
        return self._utf8_standalone

    def _pick(self, logits, *, with_grammar: bool) -> int:
        import numpy as np

        candidates = np.empty(self.n_vocab, dtype=_TOKEN_DATA)
        candidates["id"] = self._ids()
        candidates["logit"] = logits
        candidates["p"] = 0.0
        if with_grammar:
            self._apply(self._grammar, candidates)
        selected = self._apply(self._sampler, candidates)
        if selected < 0:
            raise EngineError("no token is allowed here (the grammar, the filter or the biases rule out every one)")
        return int(candidates["id"][selected])

    def _apply(self, sampler, candidates) -> int:
        """Applies a sampler to a NumPy array of candidates in place; returns the selected index."""
        data = lc.llama_token_data_array(
            candidates.ctypes.data_as(lc.llama_token_data_p), len(candidates), -1, False)
        lc.llama_sampler_apply(sampler, ctypes.byref(data))
        return data.selected

    def _ids(self):
        if self._id_range is None:
            import numpy as np

            self._id_range = np.arange(self.n_vocab, dtype=np.int32)
        return self._id_range

    # ---- state --------------------------------------------------------------------------

    def snapshot_bytes(self) -> memoryview:
        """The context's state, as a view of the one buffer llama.cpp wrote it into (no copy)."""
        size = lc.llama_state_seq_get_size(self._ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        written = lc.llama_state_seq_get_data(self._ctx, buf, size, 0)
        if written != size:
            raise EngineError("llama.cpp could not write the context state")
        return memoryview(buf).cast("B")

    def restore_bytes(self, data: bytes | memoryview) -> None:
        lc.llama_memory_clear(self._mem, True)
        view = memoryview(data).cast("B")
        if view.readonly:
            buf = (ctypes.c_uint8 * len(view)).from_buffer_copy(view)
        else:  # read where it lies: a state is tens of megabytes
            buf = (ctypes.c_uint8 * len(view)).from_buffer(view)
        read = lc.llama_state_seq_set_data(self._ctx, buf, len(view), 0)
        if read != len(view):
            lc.llama_memory_clear(self._mem, True)
            raise EngineError(f"llama.cpp refused the saved context state{LOG.reason()}")

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
                group, used = [], 0
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
