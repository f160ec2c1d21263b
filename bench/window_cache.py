"""What keeping every cell of a sliding-window model's cache costs a decode, in one process.

quipu keeps the window layers' cells that have gone out of the window (llama.cpp's full-size
window cache, its default), which a bit-for-bit resume, `/undo` and the prompt cache read back;
llama-bench keeps the window alone. Two contexts on one model (Gemma 3 270M, when its package is
installed), one of each, decode by turns, `repeats` rounds each of reading to a depth and
decoding 32 tokens from there (timed); a row is the median of the rounds' ratios (full-size over
window alone), at two depths on the benchmark's threads, and at the deeper on one thread.

llama.cpp's CPU flash attention shares a one-token decode's cells out among the threads in equal
runs of cell indices; a full-size window cache holds the window's cells last, so past twice the
window they all fall in the last thread's run and the others wait for it.
"""

from __future__ import annotations

import statistics
import time

DEPTHS = (1400, 2800)
ROUND = 32


def bench_window_cache(threads: int, repeats: int) -> list[dict]:
    from bench.llama_bench import models

    # The benchmark's threads at two depths, and one thread (nothing shared out) at the deeper.
    runs = [(depth, threads) for depth in DEPTHS] + ([(DEPTHS[-1], 1)] if threads > 1 else [])
    rows = []
    for name, path in models()[1:]:  # (the sliding-window models)
        for depth, n_threads in runs:
            ratio, full, window = _by_turns(path, depth, n_threads, repeats)
            rows.append({"what": f"{name}: decode tok/s at {depth} tokens of context on {n_threads} thread"
                                 f"{'s' if n_threads > 1 else ''}, the full-size window cache (quipu's) vs "
                                 "the window alone (llama-bench's), by turns in one process",
                         "quipu": round(full, 1), "llama.cpp": f"{window:.1f} (the window alone)",
                         "ratio": round(ratio, 3)})
    return rows


def _by_turns(path: str, depth: int, n_threads: int, repeats: int) -> tuple[float, float, float]:
    """(median of the rounds' ratios, full-size tok/s, window-alone tok/s), medians."""
    import llama_cpp as lc

    from bench.plain_loop import context_params, load_model

    model = load_model(path)
    n_batch = 256
    batch = lc.llama_batch_init(n_batch, 0, 1)
    tokens = [(i * 7919) % 20000 + 100 for i in range(depth + ROUND)]

    def decode(ctx, start: int, stop: int) -> None:
        batch.n_tokens = stop - start
        for i, pos in enumerate(range(start, stop)):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tokens[pos], pos, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = pos == stop - 1
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama.cpp could not decode")

    contexts = {}
    for full in (True, False):
        cp = context_params(4096, n_batch, n_threads)
        cp.swa_full = full
        contexts[full] = lc.llama_init_from_model(model, cp)
    speeds: dict[bool, list[float]] = {True: [], False: []}
    try:
        for rnd in range(repeats):
            for full in ((True, False) if rnd % 2 == 0 else (False, True)):
                ctx = contexts[full]
                # Read to the depth afresh, as llama-bench does: the window alone has written over
                # the cells a round's tokens needed once the next round is decoded.
                lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
                for start in range(0, depth, n_batch):
                    decode(ctx, start, min(start + n_batch, depth))
                started = time.perf_counter()
                for pos in range(depth, depth + ROUND):
                    decode(ctx, pos, pos + 1)
                    lc.llama_get_logits_ith(ctx, -1)  # (waits for the decode)
                speeds[full].append(ROUND / (time.perf_counter() - started))
    finally:
        for ctx in contexts.values():
            lc.llama_free(ctx)
        lc.llama_batch_free(batch)
        lc.llama_model_free(model)
    ratios = [f / w for f, w in zip(speeds[True], speeds[False], strict=True)]
    return statistics.median(ratios), statistics.median(speeds[True]), statistics.median(speeds[False])
