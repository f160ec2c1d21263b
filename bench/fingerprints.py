"""A model's identity: its fingerprint covers the whole file (SHA-256, in parts on the threads the
process may use), paid once and remembered by path, size, times and inode; what a run pays to know the model again, on files of
5 and 20 GB (sparse, so the figures are the hash's, not the disk's), against hashing the first
8 MiB alone (what quipu did before)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench.common import median


def bench_fingerprints(repeats: int) -> list[dict]:
    from quipu import models
    from quipu.app.environment import Environment
    from quipu.app.local import model_fingerprint

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        env = Environment.load({"QUIPU_HOME": str(Path(tmp) / "home")})
        for gb in (5, 20):
            path = Path(tmp) / f"model-{gb}.gguf"
            with open(path, "wb") as fh:
                fh.write(b"GGUF")
                fh.truncate(gb << 30)
            started = time.perf_counter()
            model_fingerprint(path, env)
            first = time.perf_counter() - started
            runs, heads = [], []
            for _ in range(repeats):
                models._FINGERPRINTS.clear()  # (a new process: only the record on disk)
                started = time.perf_counter()
                model_fingerprint(path, env)
                runs.append(time.perf_counter() - started)
                started = time.perf_counter()
                models.head_fingerprint(path)
                heads.append(time.perf_counter() - started)
            rows.append({"what": f"a model's fingerprint, {gb} GB file: the whole file hashed once (s)",
                         "quipu": round(first, 2)})
            rows.append({"what": f"a model's fingerprint, {gb} GB file: what each run pays to know it again (ms) "
                                 "(goal < 20)", "quipu": round(median(runs) * 1000, 2)})
            rows.append({"what": f"a model's fingerprint, {gb} GB file: hashing its first 8 MiB alone, as quipu did "
                                 "before, each run (ms)", "quipu": round(median(heads) * 1000, 2)})
    return rows
