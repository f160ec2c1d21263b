"""A turn's save writes what the turn added: the state file once, then a piece of the state log
for each turn (the cells it added), each checksummed. A session saved so resumes exactly; a
piece cut short by a kill, or damaged, costs re-reading what it held, never the session."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

import pytest

from quipu.store.statefile import read_log

LONG = " ".join(["the sky is blue and the world is hello"] * 30)
HOT = ["--seed", "4", "-t", "1.0", "--repeat-penalty", "1.2"]
TURNS = ["Paris is the sky", "hello there", "the world is blue"]


def files(home, name):
    root = home / "data" / "sessions"
    return root / f"{name}.json", root / f"{name}.kv", root / f"{name}.kvlog"


def turn(quipu, model, name, prompt, *extra):
    r = quipu("run", "-m", model, "-S", name, "-n", "12", *HOT, "--json", *extra, prompt)
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout), r.stderr.decode()


def tokens(home, name):
    return json.loads(files(home, name)[0].read_text())["tokens"]


def test_each_turn_writes_only_its_cells_and_the_session_resumes_exactly(quipu, tiny_model, home):
    turn(quipu, tiny_model, "a", LONG)
    transcript, state, log = files(home, "a")
    whole = state.read_bytes()
    sizes = []
    for prompt in TURNS:
        held = json.loads(transcript.read_text())["n_decoded"]
        out, err = turn(quipu, tiny_model, "a", prompt)
        # restored: all but the last reply, which the tiny model spells unlike its template
        assert err == "" and out["usage"]["cached_tokens"] >= held - 13
        sizes.append(log.stat().st_size)
    assert state.read_bytes() == whole  # the state file was not written again
    pieces, end, damage = read_log(log)
    assert len(pieces) == 3 and end == sizes[-1] and damage is None
    held = json.loads(transcript.read_text())
    base_tokens = pieces[0][0].meta["start"]
    for (piece, _), before, after in zip(pieces, [0] + sizes, sizes, strict=False):
        # Each turn wrote its own cells: bytes in proportion to the tokens it added.
        added = piece.meta["n_decoded"] - piece.meta["start"]
        assert after - before < len(whole) * added / base_tokens * 1.2 + 4096
        assert added < 120
    assert pieces[-1][0].meta["n_decoded"] == held["n_decoded"]
    # The same turns in one process (a piped chat, nothing restored between them): the same tokens.
    chat = quipu("chat", "-m", tiny_model, "-S", "b", "-n", "12", *HOT, input="\n".join([LONG, *TURNS, "and more"]) + "\n")
    assert chat.returncode == 0, chat.stderr.decode()
    out, err = turn(quipu, tiny_model, "a", "and more")  # restored from the state file and three pieces
    assert err == "" and tokens(home, "a") == tokens(home, "b")


def test_a_rewind_into_saved_cells_replaces_them_and_a_deep_one_saves_whole(quipu, tiny_model, home):
    # /undo goes back into what the pieces hold: the next piece replaces the cells from there,
    # and the session resumes to the tokens of the same chat in one process. Going back over
    # most of the context (a reset) saves the state whole again.
    steps = [LONG, TURNS[0], "/undo", TURNS[1]]
    whole = quipu("chat", "-m", tiny_model, "-S", "one", "-n", "12", *HOT, input="\n".join(steps) + "\n")
    assert whole.returncode == 0, whole.stderr.decode()
    turn(quipu, tiny_model, "u", LONG)
    turn(quipu, tiny_model, "u", TURNS[0])
    transcript, state, log = files(home, "u")
    first = state.read_bytes()
    r = quipu("chat", "-S", "u", "-n", "12", input="/undo\n" + TURNS[1] + "\n")
    assert r.returncode == 0 and "warning" not in r.stderr.decode(), r.stderr.decode()
    assert state.read_bytes() == first
    metas = [piece.meta for piece, _ in read_log(log)[0]]
    assert any(b["start"] < a["n_decoded"] for a, b in zip(metas, metas[1:], strict=False))  # back into a piece before
    assert tokens(home, "u") == tokens(home, "one")
    out, err = turn(quipu, tiny_model, "u", "again")
    assert err == "" and out["usage"]["cached_tokens"] > 1000
    # The /undo kept its exchange as a branch, whose state is a path of the log: a reset adds a
    # piece beside it. A session of one branch saves whole again.
    r = quipu("chat", "-S", "u", "--verbose", input="/reset\nhello\n")
    assert r.returncode == 0 and "saved whole" not in r.stderr.decode() and log.exists(), r.stderr.decode()
    turn(quipu, tiny_model, "w", LONG)
    turn(quipu, tiny_model, "w", TURNS[0])
    r = quipu("chat", "-S", "w", "--verbose", input="/reset\nhello\n")
    assert r.returncode == 0, r.stderr.decode()
    assert "saved whole (most of the context is new)" in r.stderr.decode() and not files(home, "w")[2].exists()


def _chain(quipu, model, home, name):
    turn(quipu, model, name, LONG)
    for prompt in TURNS:
        turn(quipu, model, name, prompt)
    return read_log(files(home, name)[2])[0]


def test_a_damaged_piece_costs_reading_again_what_it_and_those_after_it_held(quipu, tiny_model, home):
    # Each piece in turn: a byte of it flipped. The pieces before it are restored, the rest of
    # the context is read again from the transcript, with a warning; the next turn restores all.
    pieces = _chain(quipu, tiny_model, home, "d")
    _, _, log = files(home, "d")
    good = log.read_bytes()
    saved = tokens(home, "d")
    starts = [0] + [end for _, end in pieces]
    for k, (piece, end) in enumerate(pieces):
        shutil.copytree(home / "data" / "sessions", home / "backup", dirs_exist_ok=True)
        damaged = bytearray(good)
        damaged[(starts[k] + end) // 2] ^= 0x40
        log.write_bytes(bytes(damaged))
        out, err = turn(quipu, tiny_model, "d", "next")
        assert "a piece of the saved context state is damaged" in err and "re-reading" in err
        assert out["usage"]["cached_tokens"] >= piece.meta["start"] - 1  # what came before it was restored
        assert tokens(home, "d")[:len(saved) - 13] == saved[:-13]  # (the last reply's end is the template's)
        _, err = turn(quipu, tiny_model, "d", "after")
        assert err == ""
        shutil.rmtree(home / "data" / "sessions")
        shutil.copytree(home / "backup", home / "data" / "sessions")


def test_a_piece_cut_short_anywhere_leaves_the_session_at_its_last_whole_turn(quipu, tiny_model, home):
    # A kill while a piece is written leaves the log cut somewhere in it, the transcript not
    # yet written: the session resumes at the turn before, from its state, without a word.
    pieces = _chain(quipu, tiny_model, home, "k")
    transcript, _, log = files(home, "k")
    full = log.read_bytes()
    last_start = pieces[-2][1]
    earlier = json.loads(transcript.read_text())
    earlier_tokens = pieces[-2][0].meta["n_decoded"]
    rng = random.Random(7)
    cuts = sorted({last_start, last_start + 1, len(full) - 1, *rng.sample(range(last_start, len(full)), 6)})
    for cut in cuts:
        log.write_bytes(full[:cut])
        # (the transcript as it was before that turn's save: its tokens end where the piece began)
        record = dict(earlier, tokens=earlier["tokens"][:earlier_tokens + 1], n_decoded=earlier_tokens)
        record["messages"] = earlier["messages"][:-2]
        transcript.write_text(json.dumps(record))
        r = quipu("run", "-S", "k", "-n", "4", "--json", "go on")
        assert r.returncode == 0 and r.stderr == b"", (cut, r.stderr.decode())
        assert json.loads(r.stdout)["usage"]["cached_tokens"] >= earlier_tokens - 1, cut
        _chain_again = read_log(log)
        assert _chain_again[2] is None  # the next save went where the cut piece was
        log.write_bytes(full)


@pytest.mark.parametrize("field, value", [("layout", "some-other-layout"), ("base", "0" * 16),
                                          ("build", "another build")])
def test_a_piece_of_another_layout_build_or_state_file_is_not_used(quipu, tiny_model, home, field, value):
    # A piece whose layout is not the one this quipu reads, of another llama.cpp build, or that
    # follows another state file, is never given to llama.cpp: what it held is read again.
    from quipu.store.statefile import PIECE_MAGIC, state_chunks

    pieces = _chain(quipu, tiny_model, home, "l")
    _, _, log = files(home, "l")
    rewritten = []
    for piece, _ in pieces:
        meta = dict(piece.meta, **{field: value}) if piece is pieces[1][0] else piece.meta
        rewritten += [bytes(c) for c in state_chunks(meta, piece.state, PIECE_MAGIC)]
    log.write_bytes(b"".join(rewritten))
    out, err = turn(quipu, tiny_model, "l", "next")
    assert err == ""
    assert pieces[0][0].meta["n_decoded"] - 1 <= out["usage"]["cached_tokens"]
    assert out["usage"]["cached_tokens"] < pieces[1][0].meta["n_decoded"] + 12


def test_the_layout_check_refuses_what_is_not_a_piece_of_this_model():
    # The check of a piece against the layout read from the vendored llama.cpp.
    import struct

    from quipu.engine.kvstate import MAGIC, check_piece
    from quipu.errors import SnapshotError

    def cache(cells, first, n_layer, seq, v_trans):
        out = struct.pack("<II", 1, cells)
        out += b"".join(struct.pack("<iIi", first + i, 1, seq) for i in range(cells))
        out += struct.pack("<II", v_trans, n_layer)
        out += b"".join(struct.pack("<iQ", 1, 8) + b"k" * 8 * cells for _ in range(n_layer))
        out += b"".join(struct.pack("<iII", 1, 2, 4) + b"v" * 8 * cells for _ in range(n_layer))
        return out

    def piece(cells, first, n_layer=2, seq=1, extra=b"", v_trans=1):
        return struct.pack("<Ii", MAGIC, seq) + cache(cells, first, n_layer, seq, v_trans) + extra

    assert check_piece(piece(3, 10), seq_id=1, cells=3, first=10, n_layer=2).last == 12
    # A sliding-window model's: its full-attention layers' cache, then its window layers'.
    head = struct.pack("<Ii", MAGIC, 1)
    windowed = head + cache(3, 10, 1, 1, 1) + cache(3, 10, 2, 1, 1)
    assert check_piece(windowed, seq_id=1, cells=3, first=10, n_layer=3).cells == 3
    for bad, why in ((head + cache(3, 10, 1, 1, 1) + cache(2, 11, 2, 1, 1), "2 cells, not 3"),  # (out of the window)
                     (head + cache(3, 10, 1, 1, 1) + cache(3, 10, 2, 1, 0), "layout"),
                     (head + cache(3, 10, 1, 1, 1), "layout quipu reads"),
                     (windowed + cache(3, 10, 1, 1, 1), "layout")):
        with pytest.raises(SnapshotError, match=why):
            check_piece(bad, seq_id=1, cells=3, first=10, n_layer=3)
    for bad, why in ((piece(3, 11), "position"), (piece(3, 10, n_layer=3), "layout"), (piece(2, 10), "cells"),
                     (piece(3, 10, extra=b"x"), "layout quipu reads"), (piece(3, 10, seq=0), "begin"),
                     (piece(3, 10)[:-1], "ends early"), (piece(3, 10, v_trans=2), "layout")):
        with pytest.raises(SnapshotError, match=why):
            check_piece(bad, seq_id=1, cells=3, first=10, n_layer=2)


def test_fork_copies_in_the_kernel_and_keeps_the_pieces(quipu, tiny_model, home):
    _chain(quipu, tiny_model, home, "f")
    r = quipu("sessions", "fork", "f", "g")
    assert r.returncode == 0, r.stderr.decode()
    for a, b in zip(files(home, "f")[1:], files(home, "g")[1:], strict=False):
        assert a.read_bytes() == b.read_bytes()
    out, err = turn(quipu, tiny_model, "g", "and more")
    assert err == "" and out["usage"]["cached_tokens"] > 300


def test_kill_9_at_any_moment_of_a_turn_leaves_the_session_at_a_finished_turn(quipu, tiny_model, home):
    # A turn's process killed at each moment in turn, each one observed, not timed: as it
    # starts (loading), once its reply has begun (generating), once the state log has grown
    # (writing its piece), once the transcript has changed (writing it). The session is at its
    # last finished turn or at the one being saved, and the next turn goes on from it. (A
    # process that ends before its moment is seen is a finished turn, which must hold too.)
    import time

    from limits import STRESS

    _chain(quipu, tiny_model, home, "k")
    transcript, _, log = files(home, "k")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ["QUIPU_HOME"] = str(home)

    def seen(proc, changed) -> None:
        while proc.poll() is None and not changed():
            time.sleep(0.001)  # (polled: the kill waits for what is observed, however long it takes)

    for i in range(4 * STRESS):
        before = json.loads(transcript.read_text())
        log_size, text = log.stat().st_size, transcript.read_bytes()
        proc = subprocess.Popen([sys.executable, "-m", "quipu", "run", "-S", "k", "-n", "12", f"turn {i}"],
                                env=environ, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
        moment = i % 4
        if moment == 1:
            proc.stdout.read(1)
        elif moment == 2:
            seen(proc, lambda size=log_size: log.stat().st_size != size)
        elif moment == 3:
            seen(proc, lambda was=text: transcript.read_bytes() != was)
        proc.kill()
        proc.wait()
        proc.stdout.close()
        after = json.loads(transcript.read_text())
        old, new = before["messages"], after["messages"]
        assert new[:len(old)] == old and len(new) - len(old) in (0, 2)  # as it was, or with the turn
        r = quipu("run", "-S", "k", "-n", "4", "--json", "go on")
        assert r.returncode == 0 and "Traceback" not in r.stderr.decode(), r.stderr.decode()
        assert json.loads(r.stdout)["usage"]["cached_tokens"] > 1000  # restored, not read again


def test_dropping_the_oldest_exchanges_moves_the_kept_cells_instead_of_reading_them_again(make_backend):
    # A full context made room for: the oldest exchanges' tokens go, the kept ones move down
    # (llama.cpp's K-shift), and the next turn reads only its own message. /undo still goes
    # back to the exact context before the last exchange.
    from quipu.sessions.conversation import Conversation
    from quipu.sessions.inference import InferenceSession
    from quipu.sessions.params import SamplingParams
    from quipu.sessions.trim import drop_oldest

    backend = make_backend(n_ctx=2048)
    session = InferenceSession(backend, SamplingParams(seed=3, temperature=1.0))
    conv = Conversation.start(session, "You are brief.")
    for i in range(4):
        conv.send(f"message number {i} " + "the sky is blue " * 10, max_tokens=10)
    held = len(session.tokens)
    assert drop_oldest(conv, 2048 - held + 150) == 2  # the oldest exchange: its two messages
    kept = session.n_decoded
    assert kept < held - 150 and [m.content[:16] for m in conv.messages if m.role == "user"] == \
        ["message number 1", "message number 2", "message number 3"]
    conv.send("and now?", max_tokens=5)
    assert session.stats.cached_tokens >= kept - 1  # the kept exchanges were not read again
    before_undo = conv.messages[-2]
    assert conv.undo() and len(session.tokens) == before_undo.context_before
    assert session.n_decoded == (before_undo.decoded_before or before_undo.context_before)  # (its last token to read)



def test_a_chat_s_prompt_comes_back_with_the_transcript_written_and_a_kill_then_costs_at_most_that_turn(
        quipu, tiny_model, home):
    # The transcript is on disk when the prompt returns; the state is written while the user
    # types. A kill -9 the moment the prompt is back leaves the turn in the transcript; resumed,
    # the session holds the same tokens either way (the state was written, or the turn is read again).
    import signal

    import pexpect
    turn(quipu, tiny_model, "c", LONG)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ.update(QUIPU_HOME=str(home), PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm")
    child = pexpect.spawn(sys.executable, ["-m", "quipu", "chat", "-S", "c", "-n", "12"], env=environ,
                          encoding="utf-8", dimensions=(30, 120), timeout=120)
    child.expect("›")
    child.send("hello there\r")
    child.send("/context\r")  # (answered once the turn is over and the prompt is back)
    child.expect(r"context: \d+ of")
    os.kill(child.pid, signal.SIGKILL)
    child.close()
    record = json.loads(files(home, "c")[0].read_text())
    assert [m["content"] for m in record["messages"] if m["role"] == "user"][-1] == "hello there"
    out, err = turn(quipu, tiny_model, "c", "and then?")
    assert "Traceback" not in err and out["usage"]["cached_tokens"] > 1000
    assert tokens(home, "c")[:len(record["tokens"]) - 13] == record["tokens"][:-13]


def test_a_model_whose_last_layers_share_a_cache_saves_its_later_turns_as_pieces(quipu, home, tmp_path):
    # Gemma 4's small models (and Gemma 3n) have layers that read an earlier layer's cache: the
    # context's state holds fewer layers than the model, and a piece holds those it holds.
    sys.path.insert(0, os.path.dirname(__file__))
    from tinymodel import write_tiny_gemma4

    model = write_tiny_gemma4(tmp_path / "gemma4.gguf")
    said = []
    for prompt in [LONG, *TURNS]:
        r = quipu("run", "-m", model, "-S", "g", "-n", "12", *HOT, "--verbose", prompt)
        assert r.returncode == 0, r.stderr.decode()[-800:]
        said.append(r.stderr.decode())
    assert not any("saved whole" in s for s in said[1:]), [line for s in said for line in s.splitlines() if "whole" in line]
    pieces, _, damage = read_log(home / "data" / "sessions" / "g.kvlog")
    assert len(pieces) == len(TURNS) and damage is None
    chat = quipu("chat", "-m", model, "-S", "one", "-n", "12", *HOT, input="\n".join([LONG, *TURNS]) + "\n")
    assert chat.returncode == 0, chat.stderr.decode()[-800:]
    assert tokens(home, "g") == tokens(home, "one")
