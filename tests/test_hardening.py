"""What quipu promises about sessions, the prompt cache and input, tested the hard way: fuzzed
files, kill -9, two writers, a full disk, hostile models and templates, Ctrl-C at any moment.

The loops run a few times by default; QUIPU_STRESS=N runs them N times."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from limits import small_filesystem

from quipu.errors import SessionSaveError, SnapshotError
from quipu.store.statefile import MAGIC, decode_state, encode_state
from quipu.store.store import SessionStore
from quipu.store.transcript import Transcript, check

STRESS = int(os.environ.get("QUIPU_STRESS", "4"))
VALID = encode_state({"fingerprint": "x", "n_decoded": 3}, bytes(range(256)) * 8)


# ---- the state file reader -----------------------------------------------------------------

def test_every_truncation_is_refused():
    for n in range(len(VALID)):
        with pytest.raises(SnapshotError):
            decode_state(VALID[:n])


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.integers(0, len(VALID) - 1), st.integers(1, 255), min_size=1, max_size=8))
def test_any_changed_bytes_are_refused(changes):
    data = bytearray(VALID)
    for at, xor in changes.items():
        data[at] ^= xor
    with pytest.raises(SnapshotError):
        decode_state(bytes(data))


@settings(max_examples=300)
@given(st.binary(max_size=4096))
def test_garbage_is_refused(data):
    with pytest.raises(SnapshotError):
        decode_state(data)


@settings(max_examples=100)
@given(st.binary(min_size=len(VALID), max_size=len(VALID)))
def test_garbage_of_the_same_size_is_refused(data):
    with pytest.raises(SnapshotError):
        decode_state(MAGIC + data[8:])


def with_checksum(body: bytes) -> bytes:
    import hashlib

    return body + hashlib.sha256(body).digest()


@pytest.mark.parametrize(
    "body, message",
    [
        (struct.pack("<8sII", MAGIC, 1, 0xFFFFFFFF) + b"{}" + b"\x00" * 40, "length"),
        (struct.pack("<8sII", MAGIC, 1, 2) + b"{}" + struct.pack("<Q", 2**63), "length"),
        (struct.pack("<8sII", MAGIC, 99, 2) + b"{}" + struct.pack("<Q", 0), "format 99"),
        (struct.pack("<8sII", MAGIC, 1, 4) + b"{bad" + struct.pack("<Q", 0), "JSON"),
        (struct.pack("<8sII", MAGIC, 1, 5) + b"[1,2]" + struct.pack("<Q", 0), "not an object"),
        (struct.pack("<8sII", MAGIC, 1, 2) + b"\xff\xfe" + struct.pack("<Q", 0), "JSON"),
    ],
)
def test_huge_lengths_wrong_versions_and_bad_metadata_under_a_valid_checksum(body, message):
    started = time.perf_counter()
    with pytest.raises(SnapshotError, match=message):
        decode_state(with_checksum(body))
    assert time.perf_counter() - started < 5  # no unbounded allocation or scan


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=6),
    max_leaves=20,
)


@settings(max_examples=300)
@given(json_values)
def test_transcript_checker_never_raises(value):
    assert check(value) is None or isinstance(check(value), str)


@settings(max_examples=100, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=2048))
def test_any_transcript_bytes_load_or_fail_cleanly(tmp_path, data):
    store = SessionStore(tmp_path)
    store.transcript_path("fz").write_bytes(data)
    with pytest.raises(SnapshotError):
        store.load_transcript("fz")


def tiny_cmd(tiny_model, *args):
    return [sys.executable, "-m", "quipu", "run", "-m", str(tiny_model), *map(str, args)]


def environ(home, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    env.update(QUIPU_HOME=str(home), **extra)
    return env


def test_a_forged_state_with_a_valid_checksum_is_not_trusted_blindly(quipu, tiny_model, home):
    assert quipu("run", "-m", tiny_model, "-S", "forged", "-n", "8", "hello").returncode == 0
    store = SessionStore(home / "data" / "sessions")
    blob = decode_state(store.state_path("forged").read_bytes())
    # Everything about it checks out except that the KV bytes are random.
    assert quipu("sessions", "fork", "forged", "intact").returncode == 0
    junk = random.Random(1).randbytes(len(blob.state))
    store.state_path("forged").write_bytes(encode_state(blob.meta, junk))
    forged = quipu("run", "-m", tiny_model, "--json", "-S", "forged", "-n", "8", "again")
    intact = quipu("run", "-m", tiny_model, "--json", "-S", "intact", "-n", "8", "again")
    assert forged.returncode == 0 and intact.returncode == 0, forged.stderr.decode()
    assert "re-reading" in forged.stderr.decode() and intact.stderr == b""
    # The junk was refused and the context re-read: the reply is the one the intact copy gives.
    assert json.loads(forged.stdout)["usage"]["cached_tokens"] == 0
    assert json.loads(forged.stdout)["text"] == json.loads(intact.stdout)["text"]


CACHED_SYSTEM = "You are the sky. " + " ".join(f"hello {i} the sky is blue." for i in range(40))


def test_a_forged_cache_entry_with_a_valid_checksum_is_not_trusted_blindly(quipu, tiny_model, home):
    args = ("run", "-m", tiny_model, "--json", "-t", "0", "-n", "8", "-s", CACHED_SYSTEM)
    assert quipu(*args, "hello").returncode == 0
    [entry] = (home / "cache" / "prompts").glob("*.kv")
    blob = decode_state(entry.read_bytes())
    entry.write_bytes(encode_state(blob.meta, random.Random(2).randbytes(len(blob.state))))
    forged = quipu(*args, "the sky")
    honest = quipu(*args, "--no-cache", "the sky")
    assert forged.returncode == 0 and forged.stderr == b"", forged.stderr.decode()
    assert json.loads(forged.stdout)["usage"]["cached_tokens"] == 0
    assert json.loads(forged.stdout)["text"] == json.loads(honest.stdout)["text"]


def test_a_full_filesystem_never_fails_a_run_for_its_cache(quipu, tiny_model, tmp_path):
    home = tmp_path / "small"
    cache = home / "cache" / "prompts"
    cache.mkdir(parents=True)
    with small_filesystem(cache, "64k"):
        args = ("run", "-m", tiny_model, "--json", "-t", "0", "-n", "8", "-s", CACHED_SYSTEM, "hello")
        full = quipu(*args, env={"QUIPU_HOME": str(home)})
        honest = quipu(*args, "--no-cache", env={"QUIPU_HOME": str(home)})
        assert full.returncode == 0 and full.stderr == b"", full.stderr.decode()
        assert json.loads(full.stdout)["text"] == json.loads(honest.stdout)["text"]
        assert [p for p in cache.iterdir()] == []  # no partial entry left behind


# ---- kill -9 ---------------------------------------------------------------------------------

SAVER = r"""
import sys
from quipu.app.named import NamedSession
from quipu.app.environment import Environment
from quipu.app.turn_options import TurnOptions
from quipu.app.local import LocalHost
from quipu.store.store import SessionStore
env = Environment.load()
store = SessionStore(env.dirs.sessions)
opts = TurnOptions.of(model=sys.argv[1], max_tokens=64, seed=1)
with store.lock("k"):
    named = NamedSession.open(store, "k", opts, env, LocalHost())
    turn = 0
    while True:
        turn += 1
        # One exchange at a time: however many saves fit before the kill, the session stays small.
        named.conversation.reset()
        named.conversation.send(f"hello number {turn}", max_tokens=16)
        named.save()
        print(turn, flush=True)
"""


def test_kill_9_while_saving_never_leaves_a_broken_session(tiny_model, home):
    rng = random.Random(7)
    store = SessionStore(home / "data" / "sessions")
    for _ in range(STRESS):
        proc = subprocess.Popen([sys.executable, "-c", SAVER, str(tiny_model)], env=environ(home),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout.readline()  # at least one save is done
        time.sleep(rng.uniform(0.0, 0.3))
        proc.kill()
        out, _ = proc.communicate()
        done = int(([b"1"] + out.split())[-1])  # the last save the writer saw finish
        record = store.load_transcript("k")
        saved = int(record.messages[0]["content"].split()[-1])
        # The last finished save, or the one it was writing when it died.
        assert [m["role"] for m in record.messages] == ["user", "assistant"] and saved in (done, done + 1)
        blob, why = store.load_state("k")
        assert blob is not None, why
        r = subprocess.run(tiny_cmd(tiny_model, "-S", "k", "-n", "4", "check"), env=environ(home),
                           capture_output=True, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, r.stderr.decode()
        assert not list((home / "data" / "sessions").glob(".*.tmp-*")), "a temporary file was left behind"


@pytest.mark.model
def test_kill_9_during_a_run_loses_at_most_that_turn(home):
    rng = random.Random(3)
    store = SessionStore(home / "data" / "sessions")
    first = subprocess.run([sys.executable, "-m", "quipu", "run", "-S", "kill", "-n", "8", "Hello."],
                           env=environ(home), capture_output=True, stdin=subprocess.DEVNULL)
    assert first.returncode == 0, first.stderr.decode()
    turns = 1
    for i in range(2 * STRESS):
        proc = subprocess.Popen([sys.executable, "-m", "quipu", "run", "-S", "kill", "-n", "48", "--temperature", "0",
                                 "--logit-bias", "0=-inf", "--logit-bias", "2=-inf", "--logit-bias", "4=-inf",
                                 f"Tell me fact {i}."],
                                env=environ(home), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                stdin=subprocess.DEVNULL)
        # The reply has begun (the model cannot end it early: end-of-text is banned), so each kill
        # lands while it is generated or saved, however fast the machine.
        assert proc.stdout.read(1)
        time.sleep(rng.uniform(0.0, 0.4))
        proc.kill()
        proc.wait()
        now = sum(m["role"] == "assistant" for m in store.load_transcript("kill").messages)
        assert now in (turns, turns + 1)
        turns = now
    assert turns >= 1
    r = subprocess.run([sys.executable, "-m", "quipu", "run", "-S", "kill", "-n", "4", "--json", "Still there?"],
                       env=environ(home), capture_output=True, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr.decode()
    assert not list((home / "data" / "sessions").glob(".*.tmp-*"))


# ---- two writers -----------------------------------------------------------------------------

@pytest.mark.model
def test_two_runs_on_one_session_never_lose_a_turn_silently(home):
    procs = [
        subprocess.Popen([sys.executable, "-m", "quipu", "run", "-S", "same", "-n", "200", f"Write about topic {i}."],
                         env=environ(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        for i in range(3)
    ]
    results = [(p.wait(timeout=300), p.stderr.read().decode()) for p in procs]
    for code, err in results:
        assert code == 0 or (code == 1 and "in use" in err), err
    ok = sum(code == 0 for code, _ in results)
    record = SessionStore(home / "data" / "sessions").load_transcript("same")
    assert sum(m["role"] == "assistant" for m in record.messages) == ok
    assert sum(m["role"] == "user" for m in record.messages) == ok


LOCKER = r"""
import os, sys, time
from quipu.errors import SessionNotFound
from quipu.store.store import SessionStore
root, rounds = sys.argv[1], int(sys.argv[2])
store = SessionStore(root)
inside = os.path.join(root, "inside")
overlaps = 0
for i in range(rounds):
    if i % 3 == 2:
        try:
            store.remove("s")  # takes the lock, removes the session and its lock file
        except SessionNotFound:
            pass
        continue
    with store.lock("s", wait_s=120):
        try:
            fd = os.open(inside, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:  # someone else holds "the" lock too
            overlaps += 1
            continue
        store.transcript_path("s").write_text("{}")
        time.sleep(0.001)
        os.close(fd)
        os.unlink(inside)
print(overlaps)
"""


def test_one_writer_at_a_time_while_sessions_are_removed(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", LOCKER, str(tmp_path), str(15 * STRESS)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(4)]
    results = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err.decode() for _, err in results]
    assert [int(out) for out, _ in results] == [0, 0, 0, 0]


# ---- a full disk ------------------------------------------------------------------------------

def test_a_failed_save_leaves_the_previous_one_intact(tmp_path, monkeypatch):
    store = SessionStore(tmp_path)
    record = Transcript(model={}, params={}, context={"n_ctx": 64, "n_batch": 64, "kv_type": "f16"}, messages=[],
                        tokens=[1], n_decoded=0, draws=0)
    store.save("disk", record, b"state-1", {"n": 1})
    before = (store.transcript_path("disk").read_bytes(), store.state_path("disk").read_bytes())

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(SessionSaveError, match="No space left on device.*previous save is intact"):
        store.save("disk", Transcript(**{**record.__dict__, "tokens": [1, 2]}), b"state-2", {"n": 2})
    monkeypatch.undo()
    assert (store.transcript_path("disk").read_bytes(), store.state_path("disk").read_bytes()) == before
    assert not list(tmp_path.glob(".*.tmp-*"))


def test_a_full_filesystem_is_a_clear_error(quipu, tiny_model, tmp_path):
    home = tmp_path / "small"
    (home / "data" / "sessions").mkdir(parents=True)
    with small_filesystem(home / "data" / "sessions", "256k"):  # (the injected failure above covers it elsewhere)
        r = quipu("run", "-m", tiny_model, "-S", "big", "-n", "4", "hello", env={"QUIPU_HOME": str(home)})
        first = r.returncode
        r = quipu("run", "-m", tiny_model, "--ctx", "2048", "-S", "big", "-n", "200", "x " * 300,
                  env={"QUIPU_HOME": str(home)})
        err = r.stderr.decode()
        assert first == 0
        assert r.returncode == 1 and "could not save" in err and "Traceback" not in err
        record = SessionStore(home / "data" / "sessions").load_transcript("big")
        assert record.turns == 1


# ---- hostile models, templates and input ---------------------------------------------------------

def test_hostile_model_files(quipu, tiny_model, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_model.read_bytes()[:5000])
    absurd = tmp_path / "absurd.gguf"
    absurd.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**62, 2**62) + b"\x00" * 64)
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    for path, code, words in ((truncated, 1, "could not load"), (absurd, 1, "could not load"),
                              (fifo, 1, "not a regular file"), (tmp_path, 1, "directory")):
        r = quipu("run", "-m", path, "hi", timeout=60)
        err = r.stderr.decode()
        assert r.returncode == code and words in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "template, words",
    [
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "chat template"),
        ("{{ raise_exception('no system messages') }}", "refused the conversation"),
        ("{% for m in messages %}{{ m.content }", "broken"),
        ("{{ cycler.__init__.__globals__.os.system('touch /tmp/quipu-pwned') }}", "chat template"),
    ],
)
def test_a_harmful_or_failing_template_is_a_clear_error(quipu, tmp_path, template, words):
    from tinymodel import write_tiny_gguf

    model = write_tiny_gguf(tmp_path / "evil.gguf", chat_template=template)
    r = quipu("run", "-m", model, "hi")
    err = r.stderr.decode()
    assert r.returncode == 1 and words in err and "Traceback" not in err, err
    assert not os.path.exists("/tmp/quipu-pwned")


def test_stdin_closed_or_empty(tiny_model, home):
    with_prompt = subprocess.run(tiny_cmd(tiny_model, "-n", "4", "hello"), env=environ(home), capture_output=True,
                                 stdin=subprocess.DEVNULL, close_fds=True)
    assert with_prompt.returncode == 0
    closed = subprocess.run(" ".join(map(repr, tiny_cmd(tiny_model, "-n", "4"))) + " <&-", shell=True,
                            env=environ(home), capture_output=True)
    assert closed.returncode == 2 and b"no prompt" in closed.stderr


def test_ten_megabytes_on_stdin_are_refused_quickly(tiny_model, home):
    data = (b"the sky is blue " * 700_000)[:10_000_000]
    started = time.perf_counter()
    r = subprocess.run(tiny_cmd(tiny_model), input=data, env=environ(home), capture_output=True)
    assert r.returncode == 2 and b"context holds" in r.stderr
    assert time.perf_counter() - started < 60


# ---- Ctrl-C at any moment --------------------------------------------------------------------------

CLASS_MADE_AT_CTRL_C = """
import sys
from quipu.cli.boundary import guarded

class Lands:  # a Ctrl-C that arrives while Python makes a class (a module being imported)
    def __set_name__(self, owner, name):
        raise KeyboardInterrupt

sys.exit(guarded(lambda: type("Made", (), {"part": Lands()})))
"""


def test_a_ctrl_c_python_wraps_in_another_error_is_still_an_interruption(home):
    # (Python 3.11 reports it as "RuntimeError: Error calling __set_name__", caused by the Ctrl-C.)
    r = subprocess.run([sys.executable, "-c", CLASS_MADE_AT_CTRL_C], env=environ(home), capture_output=True)
    assert r.returncode == 130, r.stderr.decode()
    assert r.stderr.decode().strip() == "quipu: interrupted"


def _mapped(pid: int, name: str) -> bool:
    """Whether the process maps a file whose path holds `name` (a library loaded, a model read)."""
    try:
        return name in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _holds(pid: int, path: Path) -> bool:
    """Whether the process has `path` open (a session's lock while it holds it)."""
    try:
        return any(os.readlink(fd) == str(path) for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False


@pytest.mark.model
def test_ctrl_c_at_any_stage_exits_130_and_leaves_a_loadable_session(home, bundled_model):
    # Each signal is sent at a moment the test sees the run reach (llama.cpp's library loaded, the
    # model's file mapped, the session's lock taken, the reply streaming), on a run far from done
    # (thousands of tokens, its end-of-turn banned), so it lands while quipu works: exit 130, one
    # line, and a session that loads.
    long = ["-n", "4000", "--logit-bias", "<|im_end|>=-inf", "--seed", "1"]
    lock = home / "data" / "sessions" / "sig.lock"

    def reply_streams(proc) -> bool:
        return proc.stdout.read(1) != b""

    moments = {
        "llama.cpp loaded": lambda proc: _mapped(proc.pid, "libllama"),
        "the model mapped": lambda proc: _mapped(proc.pid, bundled_model.name),
        "the session locked": lambda proc: _holds(proc.pid, lock) and _mapped(proc.pid, bundled_model.name),
        "the reply streaming": reply_streams,
    }
    for i in range(max(1, STRESS // 2)):
        for moment, reached in moments.items():
            proc = subprocess.Popen([sys.executable, "-m", "quipu", "run", "-S", "sig", *long, f"Tell me fact {i}."],
                                    env=environ(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL)
            deadline = time.monotonic() + 120
            while not reached(proc):
                assert proc.poll() is None and time.monotonic() < deadline, (moment, proc.stderr.read().decode())
                time.sleep(0.005)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 130, (moment, err.decode())
            assert b"Traceback" not in err and b"Exception ignored" not in err, (moment, err.decode())
    r = subprocess.run([sys.executable, "-m", "quipu", "run", "-S", "sig", "-n", "4", "OK?"], env=environ(home),
                       capture_output=True, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr.decode()
