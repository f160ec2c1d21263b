"""`quipu chat` cannot be crashed: thousands of random lines, every slash command with random,
quoted, unbalanced, empty, huge and binary-looking arguments, control characters, whitespace and
prefixes of commands. Seeded, so a failure replays; QUIPU_STRESS=N runs N times as many."""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys

import pytest

from quipu.cli.repl import Repl
from quipu.cli.slash import COMMANDS, parse_command
from quipu.engine.http import ServerSettings
from quipu.cli.terminal import Terminal

STRESS = int(os.environ.get("QUIPU_STRESS", "1"))
WORDS = ["hello", "the", "sky", "is", "blue", "Paris", "world", "x", "-", "0", "1e9", "nan", "inf", "-1"]
KEYS = ["temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "seed", "max_tokens",
        "top-k", "bogus", ""]


def random_text(rng: random.Random) -> str:
    kind = rng.randrange(12)
    if kind == 0:
        return ""
    if kind == 1:
        return rng.choice([" ", "  ", "\t", " \t "])
    if kind == 2:
        return rng.choice(['"', "'", '"abc', "'abc", '"a b" c', '""', "''", "\"'", "a\\", "\\"])
    if kind == 3:
        return "".join(chr(rng.randrange(1, 32)) for _ in range(rng.randrange(1, 6))).replace("\n", "").replace("\r", "")
    if kind == 4:
        return "x" * rng.choice([200, 5_000, 40_000])
    if kind == 5:
        return "".join(chr(rng.randrange(0x80, 0x3000)) for _ in range(rng.randrange(1, 20)))
    if kind == 6:
        return "<|im_end|>" + rng.choice(["", "<|im_start|>system", "</s>", "<s>"])
    if kind == 7:
        return f"{rng.choice(KEYS)} {rng.choice(WORDS + [str(rng.randrange(-10, 10**rng.randrange(1, 30)))])}"
    if kind == 8:
        return "../" + rng.choice(["x", "etc/passwd", ""])
    if kind == 9:
        return f"fz-{rng.randrange(4)}"
    return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 8)))


def random_line(rng: random.Random) -> str:
    """A line a user might type, or mistype; never one that leaves the chat."""
    while True:
        kind = rng.randrange(10)
        if kind < 3:
            line = random_text(rng)
        else:
            name = rng.choice(COMMANDS).name
            if kind == 3:
                name = name[: rng.randrange(0, len(name) + 1)]
            elif kind == 4:
                name = name.upper()
            line = f"{rng.choice(['/', '/', ' /', '//'])}{name}{rng.choice([' ', '', '  '])}{random_text(rng)}"
        if "\n" in line or "\r" in line:
            continue
        command, _ = parse_command(line) if line.strip().startswith("/") else (None, "")
        if command is None or command.name != "exit":
            return line


# Faults a chat-API server throws between lines, mixed in with good replies: an error before
# the first token, a stream cut or broken in the middle, a refused key.
FAULTS = ["ok"] * 6 + ["500", "cut", "malformed", "401"]


@pytest.fixture(params=["local", "llama-server", "chat-api"])
def chat(request, tmp_path, tiny_model):
    """A chat on each host: the tiny model here, the bundled one on a real llama-server, and the
    fake chat-API server (whose faults the test mixes in)."""
    from quipu.app.chat import ChatSession
    from quipu.app.environment import Environment
    from quipu.app.turn_options import TurnOptions

    env = Environment.load({"QUIPU_HOME": str(tmp_path / "home")})
    server = None
    if request.param == "local":
        opts = TurnOptions.of(model=str(tiny_model), max_tokens=3, seed=5, ctx=384)
    elif request.param == "llama-server":
        opts = TurnOptions.of(server=ServerSettings(url=request.getfixturevalue("llama_server").url), max_tokens=3, seed=5)
    else:
        server = request.getfixturevalue("fake")
        opts = TurnOptions.of(server=ServerSettings(url=server.url), max_tokens=6, seed=5)  # (a stream is cut at its 5th piece)
    session = ChatSession.open(env, opts, name="fz")
    yield env, session, server
    session.close()


def saved_messages(env, name: str) -> list[tuple[str, str]]:
    from quipu.store.store import SessionStore

    store = SessionStore(env.dirs.sessions)
    if not store.exists(name):
        return []  # a new session is written with its first change
    return [(m["role"], m["content"]) for m in store.load_transcript(name).messages]


def test_random_lines_never_crash_the_repl_and_every_turn_is_saved(chat):
    env, session, server = chat
    err = io.StringIO()
    term = Terminal(io.StringIO(), io.StringIO(), err, False, False, False, False)
    repl = Repl(session, term, env)
    rng = random.Random(1234)
    lines = (1000 if session.capabilities.kind == "local" else 250) * STRESS
    for i in range(lines):
        line = random_line(rng)
        if server is not None:
            server.mode = rng.choice(FAULTS)
        repl.safely(line)
        said = err.getvalue()
        assert "unexpected" not in said and "Traceback" not in said, f"line {i}: {line!r}\n{said[-2000:]}"
        assert repl.running
        # Whatever the line did, what is on disk is what the chat holds; a session new from /new
        # comes to be on disk with its first turn (until then it holds its system prompt at most).
        mine = [(m.role, m.content) for m in repl.chat.messages]
        on_disk = saved_messages(env, repl.chat.name)
        if on_disk or any(role != "system" for role, _ in mine):
            assert on_disk == mine, f"line {i}: {line!r}"


def fuzz_input(seed: int, n: int) -> bytes:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        line = random_line(rng).encode("utf-8", "surrogatepass")
        if rng.randrange(20) == 0:
            line += bytes([rng.randrange(0x80, 0x100)])  # not UTF-8 at all
        out.append(line)
    return b"\n".join(out) + b"\n"


def test_thousands_of_piped_lines_exit_0_and_every_session_loads(quipu, tiny_model, home):
    # (a first turn: a session comes to be on disk with its first turn, and the lines that follow
    # may leave it for another at once)
    data = b"hello\n" + fuzz_input(99, 1000 * STRESS)
    r = quipu("chat", "-m", tiny_model, "-n", "2", "--seed", "7", "--ctx", "384", "-S", "pipe", input=data,
              timeout=900)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "unexpected" not in err, err[-3000:]
    listed = quipu("sessions", "list", "--json")
    assert listed.stderr == b""  # a damaged session would be named here
    assert "pipe" in [s["name"] for s in json.loads(listed.stdout)]
    check = quipu("run", "-m", tiny_model, "-S", "pipe", "-n", "2", "--json", "still there?")
    assert check.returncode == 0, check.stderr.decode()


def test_random_keys_in_a_terminal(home, tiny_model):
    import pexpect
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ.update(QUIPU_HOME=str(home), PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm")
    child = pexpect.spawn(sys.executable, ["-m", "quipu", "chat", "-m", str(tiny_model), "-n", "2", "-S", "tty"],
                          env=environ, encoding="utf-8", codec_errors="replace", dimensions=(30, 120), timeout=60)
    child.expect("›")
    rng = random.Random(5)
    for _ in range(40 * STRESS):
        line = random_line(rng)[:300]
        child.send(line + "\r")
        # (a new prompt turns bracketed paste on first: the "›" of the line just sent, drawn again
        # as it is accepted, is not the next prompt, and keys sent then would reach the turn)
        child.expect_exact("\x1b[?2004h")
        child.expect("›")
    # A stray escape may leave text in the input (Alt-Enter, as the keys' timing falls): Ctrl-C
    # clears it, so that Ctrl-D then leaves.
    child.sendcontrol("c")
    child.expect("to leave")
    child.expect("›")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    transcript = child.before or ""
    assert child.exitstatus == 0, transcript[-2000:]
    assert "Traceback" not in transcript and "unexpected" not in transcript
    r = subprocess.run([sys.executable, "-m", "quipu", "sessions", "show", "tty"], env=environ, capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
