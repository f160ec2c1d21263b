"""A conversation's branches, on the bundled model, in one process as a chat runs them:

- switching to another branch of a ~3,000-token session and asking, to the first token, against
  the same with the session's saved state gone (the branch read again from its transcript);
- a session of 50 branches (each an /edit of its last message) on disk, against the sum of what
  each added: the shared conversation's state once, and each branch's own tokens at the state's
  bytes a token.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.common import context_text, median

N_TOKENS = 3000
BRANCHES = 50


class _FirstToken:
    """A reply's sink that notes when its first piece came."""

    def __init__(self) -> None:
        from quipu.sessions.base import ReplySink

        self.at: float | None = None
        outer = self

        class Sink(ReplySink):
            def text(self, piece: str) -> None:
                if outer.at is None:
                    outer.at = time.perf_counter()

        self.sink = Sink()


def _chat(home: Path, model: str, threads: int, name: str):  # type: ignore[no-untyped-def]
    from quipu.app.chat import ChatSession
    from quipu.app.environment import Environment
    from quipu.app.turn_options import TurnOptions

    env = Environment.load({"QUIPU_HOME": str(home)})
    return ChatSession.open(env, TurnOptions.of(model=model, threads=threads, max_tokens=8, seed=1, ctx=8192),
                            name=name)


def _switch_and_ask(chat, to: str) -> float:  # type: ignore[no-untyped-def]
    """Seconds from the switch to the first token of the next reply."""
    first = _FirstToken()
    started = time.perf_counter()
    chat.switch(to)
    chat.send("Who built the bridge?", sink=first.sink)
    return (first.at or time.perf_counter()) - started


def bench_branches(model: str, threads: int, repeats: int, home: str) -> list[dict]:
    rows: list[dict] = []
    text = context_text(model, N_TOKENS)
    switched, reread, tokens = [], [], 0
    for i in range(repeats):
        folder = Path(home) / f"branches{i}"
        chat = _chat(folder, model, threads, "b")
        chat.send(text + "\n\nWhat is this about?")
        chat.send("And the mill?")
        chat.edit("And the ford?", n=2)  # (branch 2, current; branch 1 asked about the mill)
        chat.named.flush()
        switched.append(_switch_and_ask(chat, "1"))
        tokens = chat.context_used
        chat.switch("2")
        chat.named.flush()
        sessions = folder / "data" / "sessions"
        for state in sessions.glob("b.kv*"):
            state.unlink()
        reread.append(_switch_and_ask(chat, "1"))
        chat.close()
    rows.append({"what": f"switch to another branch of a {tokens:,}-token session and ask, to the first token (s): "
                         "restored vs the branch read again", "quipu": round(median(switched), 3),
                 "re-read from scratch": round(median(reread), 3), "ratio": round(median(switched) / median(reread), 3)})

    folder = Path(home) / "branches-disk"
    chat = _chat(folder, model, threads, "d")
    chat.send(context_text(model, 600) + "\n\nWhat is this about?")
    chat.send("And the first town?")
    chat.named.flush()
    sessions = folder / "data" / "sessions"
    base = (sessions / "d.kv").stat().st_size
    shared_tokens = chat.named.session.n_decoded
    per_token = base / shared_tokens
    own = 0
    for k in range(BRANCHES):
        chat.edit(f"And town number {k + 2}?", n=2)
        chat.named.flush()
        own += chat.named.session.n_decoded - _parts_at(chat)
    chat.close()
    on_disk = sum(p.stat().st_size for p in sessions.glob("d.kv*"))
    ideal = base + own * per_token
    rows.append({"what": f"a session of {BRANCHES + 1} branches on disk (MB), vs its shared state and each branch's "
                         "own tokens at the state's bytes a token", "quipu": round(on_disk / 1e6, 2),
                 "re-read from scratch": f"{ideal / 1e6:.2f} (what they add)", "ratio": round(on_disk / ideal, 3)})
    return rows


def _parts_at(chat) -> int:  # type: ignore[no-untyped-def]
    """Where the current branch parts from the one it was made from: its edited message's start."""
    return next(m.context_before or 0 for m in reversed(chat.messages) if m.role == "user")
