"""A hybrid session's cost on disk and in writes, on a random `qwen35` whose recurrent state has
Qwen 3.5 4B's dimensions (24 Gated DeltaNet layers of 32 value heads of 128 x 128, every fourth
layer attention; the rest as small as llama.cpp loads), written with the tests' writer: over a
20-turn session (`quipu run -S`, a process a turn), the bytes each turn writes to the session's
state files (a file written again counts whole), against the recurrent state and the whole state;
the session's bytes on disk at the end; its next turn's first token in a new process, its context
restored; and, in a new process each (the session opened as `quipu chat` opens it), /undo of the
last turn and a new message, and /retry, to their first token."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import quipu_cmd

ROOT = Path(__file__).resolve().parent.parent
TURNS = 20
QUESTIONS = ["Tell me of the sky.", "And of the world?", "Is Paris blue?", "Say hello again.", "Why is it so?"]


def _model(folder: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from tinymodel import write_tiny_qwen35

    return write_tiny_qwen35(folder / "qwen35-4b-state.gguf", n_embd=256, n_layer=32, n_head=2, n_head_kv=2,
                             n_ff=512, n_ctx_train=8192, d_state=128, n_group=16, n_v_heads=32,
                             chat_template=(ROOT / "tests" / "templates" / "Qwen3.5-4B.jinja").read_text())


# In a new process: the session opened as a chat opens it (its state restored), then /undo of the
# last turn and a new message, or /retry; the seconds from the command to the first token.
_BACK = """
import json, sys, time
from quipu.app.chat import ChatSession
from quipu.app.environment import Environment
from quipu.app.turn_options import TurnOptions
home, model, threads, what = sys.argv[1:]
env = Environment.load({"QUIPU_HOME": home})
opts = TurnOptions.of(model=model, max_tokens=1, temperature=0.0, threads=int(threads), ctx=8192)
started = time.perf_counter()
chat = ChatSession.open(env, opts, name="s")
opened = time.perf_counter() - started
started = time.perf_counter()
if what == "undo":
    chat.undo()
    back = time.perf_counter() - started
    answer = chat.send("Say it once more.")
else:
    back = 0.0
    answer = chat.retry()
chat.close()
print(json.dumps({"open_s": opened, "first_s": back + answer.stats.ttft_s, "read": answer.stats.prompt_tokens
                  - answer.stats.cached_tokens}))
"""


def _files(sessions: Path, name: str) -> dict[str, tuple[int, int, int]]:
    """The session's state files: (inode, modification time, size) by name."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_size)
            for p in sessions.glob(f"{name}.kv*")}


def _written(before: dict[str, tuple[int, int, int]], after: dict[str, tuple[int, int, int]]) -> int:
    """What a turn wrote: a file made or written again whole, its size; a log grown, its growth."""
    total = 0
    for file, (ino, mtime, size) in after.items():
        old = before.get(file)
        if old is None or old[0] != ino:
            total += size
        elif file.endswith(".kvlog") and mtime != old[1]:
            total += max(0, size - old[2])
    return total


def bench_hybrid_sessions(threads: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = _model(folder)
        env = {"QUIPU_HOME": str(folder / "home")}
        sessions = folder / "home" / "data" / "sessions"
        common = ["-m", str(model), "--threads", str(threads), "--ctx", "8192", "-t", "0", "-n", "24", "--json",
                  "-S", "s"]
        state_bytes = recurrent = 0
        written: list[int] = []
        for turn in range(TURNS):
            before = _files(sessions, "s") if sessions.exists() else {}
            quipu_cmd("run", *common, QUESTIONS[turn % len(QUESTIONS)] + f" ({turn})", env=env)
            written.append(_written(before, _files(sessions, "s")))
        on_disk = sum(size for _, _, size in _files(sessions, "s").values())
        for copy in ("undo", "retry"):
            shutil.copytree(folder / "home", folder / copy)
        out = json.loads(quipu_cmd("run", *common, "And at last?", env=env)[1].stdout)
        first = out["timings"]["restore_s"] + out["timings"]["ttft_s"]
        back = {}
        for what in ("undo", "retry"):
            r = subprocess.run([sys.executable, "-c", _BACK, str(folder / what), str(model), str(threads), what],
                               capture_output=True, text=True, check=True)
            back[what] = json.loads(r.stdout.splitlines()[-1])
        probe = (
            "import sys; from pathlib import Path\n"
            "from quipu.engine.llama import LlamaBackend\n"
            "from quipu.engine.settings import ContextSettings\n"
            "from quipu.engine.native import lc\n"
            "b = LlamaBackend(Path(sys.argv[1]), ContextSettings(n_ctx=8192, n_threads=1))\n"
            "toks = b.vocab.tokenize('hello ' * 400, add_special=True, parse_special=False)\n"
            "b.prefill(toks, 0)\n"
            "print(len(b.native.seq_state(0, lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)), len(b.memory.snapshot_bytes()))\n")
        r = subprocess.run([sys.executable, "-c", probe, str(model)], capture_output=True, text=True, check=True)
        recurrent, state_bytes = (int(x) for x in r.stdout.split())
    mb = 1 << 20
    mean = sum(written) / len(written)
    return [
        {"what": f"hybrid session (a random qwen35 with Qwen 3.5 4B's recurrent state), {TURNS} turns: bytes a "
                 "turn writes to its state, mean / largest (MB), in recurrent states",
         "quipu": f"{mean / mb:.1f} / {max(written) / mb:.1f}",
         "ratio": f"{mean / recurrent:.2f} / {max(written) / recurrent:.2f} recurrent states "
                  f"({recurrent / mb:.1f} MB each)"},
        {"what": f"hybrid session, after {TURNS} turns: its state's bytes on disk (MB), in recurrent states",
         "quipu": round(on_disk / mb, 1),
         "ratio": f"{on_disk / recurrent:.2f} recurrent states; the whole state at ~400 tokens "
                  f"{state_bytes / mb:.1f} MB"},
        {"what": f"hybrid session, after {TURNS} turns: the next turn in a new process, restore and first token (s)",
         "quipu": round(first, 3)},
        {"what": f"hybrid session, after {TURNS} turns, opened in a new process (s): /undo of the last turn and a "
                 "new message to its first token; /retry to its first token (the prompt's tokens read again)",
         "quipu": f"{back['undo']['first_s']:.3f} / {back['retry']['first_s']:.3f}",
         "ratio": f"read {back['undo']['read']} / {back['retry']['read']} tokens; opened in "
                  f"{back['undo']['open_s']:.2f} s"},
    ]
