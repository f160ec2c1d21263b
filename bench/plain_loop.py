"""The reference: a plain ctypes loop over the same llama.cpp calls quipu makes, no framework."""

from __future__ import annotations

import ctypes
import time

import llama_cpp as lc


QUIET = lc.llama_log_callback(lambda level, text, user: None)  # kept alive: C holds the pointer


def load_model(model_path: str):
    """llama.cpp's model, its log silenced."""
    lc.llama_log_set(QUIET, ctypes.c_void_p(0))
    lc.llama_backend_init()
    return lc.llama_model_load_from_file(model_path.encode(), lc.llama_model_default_params())


def context_params(n_ctx: int, n_batch: int, n_threads: int):
    """A context's parameters as quipu sets them on the CPU: steps of `n_batch`, flash attention
    off (where it is on, the thread count changes the sums)."""
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_batch, n_batch
    cp.n_threads = cp.n_threads_batch = n_threads
    cp.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.no_perf = True
    return cp


def plain_loop(model_path: str, prompt_tokens: list[int], n_decode: int, *, n_ctx: int, n_batch: int,
               n_threads: int, seed: int = 1) -> dict:
    """Prefills `prompt_tokens`, then samples and decodes `n_decode` tokens (never stopping early)."""
    model = load_model(model_path)
    vocab = lc.llama_model_get_vocab(model)
    ctx = lc.llama_init_from_model(model, context_params(n_ctx, n_batch, n_threads))
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    for s in (
        lc.llama_sampler_init_penalties(lc.llama_vocab_n_tokens(vocab), 64, 1.1, 0.0, 0.0),
        lc.llama_sampler_init_top_k(40),
        lc.llama_sampler_init_top_p(0.95, 1),
        lc.llama_sampler_init_min_p(0.05, 1),
        lc.llama_sampler_init_temp(0.8),
        lc.llama_sampler_init_dist(seed),
    ):
        lc.llama_sampler_chain_add(chain, s)

    t0 = time.perf_counter()
    arr = (lc.llama_token * len(prompt_tokens))(*prompt_tokens)
    for off in range(0, len(prompt_tokens), n_batch):
        n = min(n_batch, len(prompt_tokens) - off)
        ptr = ctypes.cast(ctypes.addressof(arr) + off * ctypes.sizeof(lc.llama_token), ctypes.POINTER(lc.llama_token))
        assert lc.llama_decode(ctx, lc.llama_batch_get_one(ptr, n)) == 0
    t1 = time.perf_counter()
    tok = (lc.llama_token * 1)()
    buf = ctypes.create_string_buffer(64)
    first = last = 0.0
    for i in range(n_decode):
        if i:
            assert lc.llama_decode(ctx, lc.llama_batch_get_one(tok, 1)) == 0
        tok[0] = lc.llama_sampler_sample(chain, ctx, -1)
        lc.llama_token_to_piece(vocab, tok[0], buf, 64, 0, False)
        last = time.perf_counter()
        if i == 0:
            first = last
    lc.llama_sampler_free(chain)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    return {
        "prefill_tok_s": len(prompt_tokens) / (t1 - t0),
        "decode_tok_s": (n_decode - 1) / (last - first),
    }
