"""Pooled embeddings of texts, computed on a context of their own that lives for one call
(several texts to each llama_decode call). A part of `LlamaBackend` (`llama.py`)."""

from __future__ import annotations

from contextlib import ExitStack
from typing import TYPE_CHECKING, Any, Sequence

from quipu.engine.base import refuse_embeddings
from quipu.engine.logs import LOG
from quipu.engine.native import lc
from quipu.errors import EngineError, InvalidParameter

if TYPE_CHECKING:
    from quipu.engine.model import LlamaModel


class Embeddings:
    """Embeddings of texts by `model`, on `n_threads` threads."""

    EMBED_BATCH = 2048
    EMBED_SEQS = 64

    def __init__(self, model: LlamaModel, n_threads: int, name: str):
        self.model = model
        self.n_threads = n_threads
        self.name = name

    def embed(self, texts: Sequence[str | Sequence[int]], pooling: str = "mean") -> list[list[float]]:
        """One pooled embedding per text (or its tokens, given as they are), several texts to
        each llama_decode call. The embedding context lives for this call only."""
        model = self.model.ptr
        n_embd = lc.llama_model_n_embd(model)
        encoder_only = lc.llama_model_has_encoder(model) and not lc.llama_model_has_decoder(model)
        tokenized = [self.model.tokenize(t, add_special=True, parse_special=False) if isinstance(t, str) else list(t)
                     for t in texts]
        for i, toks in enumerate(tokenized):
            wrong = next((t for t in toks if not 0 <= t < self.model.n_vocab), None)
            if wrong is not None:
                raise InvalidParameter(f"input {i} holds token {wrong}, which is not one of the model's "
                                       f"{self.model.n_vocab} (0 to {self.model.n_vocab - 1})")
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
                start += len(group)
        return out

    def _embedding_context(self, pooling: str) -> Any:
        types = {"mean": lc.LLAMA_POOLING_TYPE_MEAN, "last": lc.LLAMA_POOLING_TYPE_LAST, "cls": lc.LLAMA_POOLING_TYPE_CLS}
        if pooling not in types:
            raise InvalidParameter(f"--pooling must be one of {', '.join(types)}, not '{pooling}'")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = self.EMBED_BATCH
        cparams.n_seq_max = self.EMBED_SEQS
        cparams.kv_unified = True
        cparams.n_threads = cparams.n_threads_batch = self.n_threads
        cparams.embeddings = True
        cparams.pooling_type = types[pooling]
        cparams.no_perf = True
        LOG.clear_errors()
        ctx = lc.llama_init_from_model(self.model.ptr, cparams)
        if not ctx:
            raise refuse_embeddings(self.name)
        return ctx
