"""A hybrid model (Qwen 3.5's architecture: Gated DeltaNet layers, a recurrent state, and M-RoPE
attention every fourth layer), random, of a size to time (written here with the tests' writer,
`tests/tinymodel.py`, with Qwen 3.5's own chat template), at about 3,000 tokens:

- a session's next turn in a new process, its context restored from the snapshot (its recurrent
  state set back to the checkpoint before the last reply, which the template leaves out of the
  next prompt), against the same turn with the snapshot gone (read again from the transcript):
  the time of the turn to its first token, and the ratio;
- a second question about a piped document against the same question with --no-cache (the
  document restored from the checkpoint where it ends), to the first token;
- the bytes a 20-token turn writes (its cells to the session's state log, and one recurrent state),
  against the whole state;
- the bytes of the recurrent states a session keeps beside its cells (two).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from bench.common import median, quipu_cmd

ROOT = Path(__file__).resolve().parent.parent
N_TOKENS = 3000
WORDS = "the sky is blue and the world is hello; Paris is the sky of the world. "


def _model(folder: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from tinymodel import write_tiny_qwen35

    # 12 layers of width 768 (9 DeltaNet, 3 attention), heads of 128 as Qwen 3.5's: about 350 MB.
    return write_tiny_qwen35(folder / "qwen35-bench.gguf", n_embd=768, n_layer=12, n_head=6, n_head_kv=2,
                             n_ff=2048, n_ctx_train=8192, d_state=128, n_group=2, n_v_heads=6,
                             chat_template=(ROOT / "tests" / "templates" / "Qwen3.5-4B.jinja").read_text())


def _first_token(data: dict) -> float:
    """A turn's seconds to its first token, its restore or re-read included (the model's load not)."""
    timings = data["timings"]
    return timings["restore_s"] + timings["ttft_s"]


def bench_hybrid(threads: int, repeats: int) -> list[dict]:
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = _model(folder)
        size = model.stat().st_size
        common = ["-m", str(model), "--threads", str(threads), "--ctx", "8192", "-t", "0", "-n", "20", "--json"]
        text = WORDS * (N_TOKENS // 20)
        restored, reread, pieces, wholes, kept = [], [], [], [], []
        for i in range(repeats):
            env = {"QUIPU_HOME": str(folder / f"s{i}")}
            sessions = folder / f"s{i}" / "data" / "sessions"
            quipu_cmd("run", *common, "-S", "a", text + " What is blue?", env=env)
            quipu_cmd("sessions", "fork", "a", "b", env=env)
            for state in sessions.glob("b.kv*"):
                state.unlink()
            whole = (sessions / "a.kv").stat().st_size
            _, r = quipu_cmd("run", *common, "-S", "a", "And the world?", env=env)
            restored.append(_first_token(json.loads(r.stdout)))
            log = sessions / "a.kvlog"
            states = sorted(sessions.glob("a.kvr*"), key=lambda p: p.stat().st_mtime_ns)
            pieces.append((log.stat().st_size if log.exists() else whole) + states[-1].stat().st_size)
            wholes.append(whole + states[-1].stat().st_size)
            _, r = quipu_cmd("run", *common, "-S", "b", "And the world?", env=env)
            reread.append(_first_token(json.loads(r.stdout)))
            kept.append(sum(p.stat().st_size for p in states))
        tokens = json.loads(r.stdout)["usage"]["prompt_tokens"]
        rows.append({"what": f"hybrid (random qwen35, {size / 1e6:.0f} MB): a session's next turn after {tokens:,} "
                             "tokens, to its first token (s): restored vs read again from the transcript",
                     "quipu": round(median(restored), 3), "re-read from scratch": round(median(reread), 3),
                     "ratio": round(median(restored) / median(reread), 3)})
        cached, uncached = [], []
        for i in range(repeats):
            env = {"QUIPU_HOME": str(folder / f"d{i}")}
            quipu_cmd("run", *common, "What is blue?", env=env, stdin=text.encode())
            _, r = quipu_cmd("run", *common, "And the world?", env=env, stdin=text.encode())
            cached.append(_first_token(json.loads(r.stdout)))
            _, r = quipu_cmd("run", *common, "--no-cache", "And the world?", env=env, stdin=text.encode())
            uncached.append(_first_token(json.loads(r.stdout)))
        rows.append({"what": f"hybrid: a 2nd question about a {N_TOKENS:,}-token piped document, to its first token "
                             "(s), vs --no-cache", "quipu": round(median(cached), 3),
                     "re-read from scratch": round(median(uncached), 3),
                     "ratio": round(median(cached) / median(uncached), 3)})
        rows.append({"what": "hybrid: a 20-token turn: bytes it writes (MB: its cells, one recurrent state) vs the whole state",
                     "quipu": round(median(pieces) / 1e6, 3), "re-read from scratch": f"{median(wholes) / 1e6:.3f} (whole)",
                     "ratio": round(median(pieces) / median(wholes), 3)})
        rows.append({"what": "hybrid: the recurrent states a session keeps beside its cells (MB), against the whole state",
                     "quipu": round(median(kept) / 1e6, 3), "ratio": round(median(kept) / median(wholes), 3)})
    return rows

