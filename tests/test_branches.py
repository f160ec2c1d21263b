"""A conversation is a tree: /edit, /retry and /undo keep every branch; /switch (and `run -S
NAME --branch ID`) restores a branch's context from its saved state, so it goes on exactly as
an uninterrupted run of its conversation would (bit for bit on the logits), in the same process
and in a new one; a branch is saved as what it adds; damage to one branch's piece costs that
branch alone a re-read."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import pytest

from quipu.app.branches import rows
from quipu.app.chat import ChatSession
from quipu.app.environment import Environment
from quipu.app.turn_options import TurnOptions
from quipu.errors import UsageError
from quipu.engine.native import lc
from quipu.store.statefile import read_log

QUESTIONS = ["Name a fruit.", "Name a colour.", "Name a city.", "Name an animal.", "Name a river."]
ONWARDS = " The oldest mill is the first one, by the old stone bridge over the river."


def _chat(home, model, name):
    env = Environment.load({"QUIPU_HOME": str(home)})
    return ChatSession.open(env, TurnOptions.of(model=str(model), max_tokens=12, seed=7, temperature=1.0),
                            name=name)


def _logits(chat) -> bytes:
    backend = chat.named.session.backend
    return ctypes.string_at(lc.llama_get_logits_ith(backend.native.ptr, -1), 4 * backend.n_vocab)


def _same_onwards(one, other) -> bool:
    """Whether two chats' contexts give the same logits, bit for bit, now and at each token of
    ONWARDS read one at a time (as a reply's are)."""
    same = _logits(one) == _logits(other)
    for token in one.named.session.backend.vocab.tokenize(ONWARDS, add_special=False, parse_special=False):
        for chat in (one, other):
            chat.named.session.feed_prompt([token])
        same = same and _logits(one) == _logits(other)
    return same


@pytest.mark.parametrize("which", ["bundled_model", "gemma_model"])
def test_switching_back_goes_on_as_if_nothing_had_happened_in_this_process_and_a_new_one(which, request, tmp_path):
    model = request.getfixturevalue(which)
    # What the first branch would have said, never interrupted.
    straight = _chat(tmp_path / "straight", model, "s")
    for q in QUESTIONS:
        want = straight.send(q)
    branched = _chat(tmp_path / "branched", model, "b")
    for q in QUESTIONS[:4]:
        branched.send(q)
    branched.edit("Name a planet.", n=2)
    assert [(r.id, r.current) for r in rows(*branched.branches())] == [(1, False), (2, True)]
    assert branched.switch("1") == 1 and branched.notices == []
    got = branched.send(QUESTIONS[4])
    assert got.text == want.text and got.tokens == want.tokens
    assert _same_onwards(straight, branched)
    branched.close()
    straight.close()

    # A new process (a new context on a model loaded again): the second branch, gone on with,
    # is what a conversation that never had the first would say.
    again = _chat(tmp_path / "branched", model, "b")
    assert again.switch("2") == 2 and again.notices == []
    assert again.named.session.rebuilt_tokens == 0  # (its state restored, nothing read again)
    got = again.send("Name a moon.")
    alone = _chat(tmp_path / "alone", model, "a")
    for q in (QUESTIONS[0], "Name a planet.", "Name a moon."):
        want = alone.send(q)
    assert got.text == want.text and _same_onwards(again, alone)
    again.close()
    alone.close()


def test_edit_retry_and_undo_keep_every_branch_and_switch_names_them(tiny_model, tmp_path):
    chat = _chat(tmp_path, tiny_model, "t")
    for q in QUESTIONS[:3]:
        chat.send(q)
    first = [m.content for m in chat.messages]
    chat.edit("Name a planet.", n=2)
    edited = [m.content for m in chat.messages]
    chat.retry()
    retried = [m.content for m in chat.messages]
    assert retried[:-1] == edited[:-1] == first[:2] + ["Name a planet."] and retried != edited
    assert chat.undo() and [m.content for m in chat.messages] == first[:2]
    # 1: the first three exchanges; 2: the edit and its reply; 3: the other reply (/retry kept
    # 2's); /undo kept 3, and went back to before its last exchange (a beginning of them all).
    found = rows(*chat.branches())
    assert [(r.id, r.under) for r in found if not r.current] == [(1, None), (2, 1), (3, 2)]
    # (2 leaves 1 at exchange 2, its message edited; 3 leaves 2 there too, at its reply)
    assert {r.id: r.leaves_at for r in found}[2] == 2 and {r.id: r.leaves_at for r in found}[3] == 2
    assert chat.switch("3") == 3 and [m.content for m in chat.messages] == retried
    assert chat.switch("parent") == 2 and [m.content for m in chat.messages] == edited
    assert chat.switch("parent") == 1 and [m.content for m in chat.messages] == first
    chat.edit("Name a star.", n=2)  # (a second branch from 1's second exchange: beside 2)
    star = rows(*chat.branches())[-1]
    assert star.current and star.under == 1 and star.leaves_at == 2
    assert chat.switch("prev") == 2 and chat.switch("next") == star.id
    with pytest.raises(Exception, match="no later branch"):
        chat.switch("next")
    with pytest.raises(Exception, match="no branch 9"):
        chat.switch("9")
    chat.close()
    # Every branch is in the transcript, as what it adds to the current one's beginning.
    record = json.loads((tmp_path / "data" / "sessions" / "t.json").read_text())
    assert record["tree"]["current"]["id"] == star.id
    assert sorted(b["id"] for b in record["tree"]["branches"]) == [1, 2, 3]
    assert all(b["shared"] >= 2 for b in record["tree"]["branches"])  # (the first exchange, at least)


def test_a_branch_is_saved_as_what_it_adds(bundled_model, tmp_path):
    chat = _chat(tmp_path, bundled_model, "w")
    long = " ".join(["The river runs past the old mill and under the stone bridge."] * 40)
    chat.send(long)
    for q in QUESTIONS[:3]:
        chat.send(q)
    chat.named.flush()
    root = tmp_path / "data" / "sessions"
    before = sum((root / f"w.{ext}").stat().st_size for ext in ("kv", "kvlog") if (root / f"w.{ext}").exists())
    chat.edit("Name a planet.", n=4)
    chat.named.flush()
    after = sum((root / f"w.{ext}").stat().st_size for ext in ("kv", "kvlog"))
    state = (root / "w.kv").stat().st_size
    assert 0 < after - before < state / 4  # (its own cells, not a copy of the ~600 shared tokens')
    chat.close()


def test_damage_to_one_branch_s_piece_costs_that_branch_alone_a_re_read(tiny_model, tmp_path):
    chat = _chat(tmp_path, tiny_model, "d")
    for q in QUESTIONS[:3]:
        chat.send(q)
    chat.edit("Name a planet.", n=3)
    second = [m.content for m in chat.messages]
    chat.switch("1")
    chat.close()
    log = tmp_path / "data" / "sessions" / "d.kvlog"
    pieces, _, _ = read_log(log)
    start = pieces[-2][1]  # (the last piece: the edit's turn, branch 2's own)
    data = bytearray(log.read_bytes())
    data[(start + pieces[-1][1]) // 2] ^= 0x40
    log.write_bytes(bytes(data))
    again = _chat(tmp_path, tiny_model, "d")
    assert again.notices == [] and again.named.session.rebuilt_tokens == 0  # (branch 1 needs nothing of it)
    again.switch("2")
    said = " ".join(again.notices)
    assert "damaged" in said and "re-reading" in said
    assert [m.content for m in again.messages] == second
    assert again.send("Name a moon.").text
    again.close()


def _quipu(home, *args, input=None):
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    env["QUIPU_HOME"] = str(home)
    return subprocess.run([sys.executable, "-m", "quipu", *map(str, args)], input=input, capture_output=True,
                          env=env, timeout=300)


def test_the_tree_from_the_command_line(tiny_model, tmp_path):
    lines = "\n".join(QUESTIONS[:4] + ["/edit 2 Name a planet.", "/tree", "/edit", "/switch 1", "/tree"]) + "\n"
    r = _quipu(tmp_path, "chat", "-m", tiny_model, "-S", "t", "-n", "4", "--seed", "3", input=lines.encode())
    err = r.stderr.decode()
    assert r.returncode == 0, err
    trees = [line for line in err.splitlines() if '"Name a' in line]
    assert trees[0].startswith("  1") and trees[1].startswith("*") and "from exchange 2" in trees[1]
    assert trees[2].startswith("* 1")  # (after /switch 1)
    assert "usage: /edit [N] TEXT" in err  # (/edit with no text, in a pipe)
    shown = _quipu(tmp_path, "sessions", "tree", "t").stdout.decode().splitlines()
    assert [line.split()[0] for line in shown] == ["*", "└"] and "Name a planet." in shown[1]
    # A turn on the second branch from the command line; it becomes the current one.
    r = _quipu(tmp_path, "run", "-S", "t", "--branch", "2", "-n", "4", "Name a moon.")
    assert r.returncode == 0, r.stderr.decode()
    said = json.loads(_quipu(tmp_path, "sessions", "export", "t", "--format", "json").stdout)
    assert [m["content"] for m in said["messages"] if m["role"] == "user"] == [QUESTIONS[0], "Name a planet.",
                                                                                "Name a moon."]
    assert [(b["id"], b["current"]) for b in said["branches"]] == [(1, False), (2, True)]
    assert len([m for m in said["branches"][0]["messages"] if m["role"] == "user"]) == 4
    assert "branch 2 of 2" in _quipu(tmp_path, "sessions", "show", "t").stdout.decode().splitlines()[0]
    # A chat opened on a branch, then switched: it stays where it was switched to.
    r = _quipu(tmp_path, "chat", "-S", "t", "--branch", "1", "-n", "4", input=b"/tree\n/switch 2\n/tree\n")
    trees = [line for line in r.stderr.decode().splitlines() if '"Name a' in line]
    assert r.returncode == 0 and trees[0].startswith("* 1") and trees[3].lstrip().startswith("*"), r.stderr.decode()
    r = _quipu(tmp_path, "run", "-S", "t", "--branch", "7", "-n", "4", "x")
    assert r.returncode == 2 and "has no branch 7 (it has 1, 2" in r.stderr.decode()
    # A branch made a session of its own.
    assert _quipu(tmp_path, "sessions", "fork", "t", "u", "--branch", "1").returncode == 0
    alone = json.loads((tmp_path / "data" / "sessions" / "u.json").read_text())
    assert "tree" not in alone and len([m for m in alone["messages"] if m["role"] == "user"]) == 4
    r = _quipu(tmp_path, "run", "-S", "u", "-n", "4", "--json", "Name a lake.")
    assert r.returncode == 0 and "re-reading" not in r.stderr.decode(), r.stderr.decode()


def test_a_damaged_tree_is_one_line(tiny_model, tmp_path):
    r = _quipu(tmp_path, "chat", "-m", tiny_model, "-S", "t", "-n", "2",
               input="\n".join(QUESTIONS[:2] + ["/edit 1 Name a planet."]).encode() + b"\n")
    assert r.returncode == 0, r.stderr.decode()
    path = tmp_path / "data" / "sessions" / "t.json"
    whole = json.loads(path.read_text())
    for damage in ({"shared": 10**6}, {"next": 1}):  # (a branch past the messages; a next id one has)
        record = json.loads(json.dumps(whole))
        if "next" in damage:
            record["tree"]["next"] = damage["next"]
        else:
            record["tree"]["branches"][0].update(damage)
        path.write_text(json.dumps(record))
        r = _quipu(tmp_path, "sessions", "show", "t")
        err = r.stderr.decode()
        assert r.returncode != 0 and err.count("\n") == 1 and "damaged" in err and "Traceback" not in err, damage


def test_edit_puts_the_message_in_the_prompt_of_a_terminal(tiny_model, tmp_path):
    import os

    import pexpect

    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ.update(QUIPU_HOME=str(tmp_path), PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm")
    child = pexpect.spawn(sys.executable, ["-m", "quipu", "chat", "-m", str(tiny_model), "-n", "2", "-S", "p"],
                          env=environ, encoding="utf-8", codec_errors="replace", dimensions=(30, 120), timeout=60)
    for line in ("Name a fruit.", "Name a colour.", "/edit 1"):
        child.expect_exact("\x1b[?2004h")
        child.expect("›")
        child.send(line + "\r")
    child.expect("edit it and press Enter")
    child.expect("Name a fruit.")  # (the message, waiting in the prompt to be changed)
    child.sendcontrol("u")  # (the line cleared)
    child.send("Name a planet.\r")
    child.expect_exact("\x1b[?2004h")
    child.send("/tree\r")
    child.expect("from exchange 1")
    child.expect_exact("\x1b[?2004h")
    child.expect("›")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    record = json.loads((tmp_path / "data" / "sessions" / "p.json").read_text())
    assert [m["content"] for m in record["messages"] if m["role"] == "user"] == ["Name a planet."]
    assert len(record["tree"]["branches"]) == 1


def test_compact_makes_a_branch_of_a_summary_and_the_last_exchanges_and_switch_undoes_it(tiny_model, tmp_path):
    from quipu.app.compact import compact, summarize

    chat = _chat(tmp_path, tiny_model, "c")
    for i, q in enumerate(QUESTIONS[:4]):
        chat.send(q + ONWARDS * 3 if i < 2 else q)  # (the older exchanges long enough to be worth a summary)
    before = [m.content for m in chat.messages]
    held = list(chat.named.session.tokens)
    summary = summarize(chat, "Keep the names.")
    assert summary  # (the model's words; nothing changed meanwhile, the context restored exactly)
    assert [m.content for m in chat.messages] == before and chat.named.session.tokens == held
    assert chat.named.session.rebuilt_tokens == 0
    with pytest.raises(UsageError, match="nothing compacted"):  # (a summary that would grow the context)
        compact(chat, "The user asked for a fruit. " * 100)
    assert [m.content for m in chat.messages] == before and len(rows(*chat.branches())) == 1
    made = compact(chat, "The user asked for a fruit, a colour, a city and an animal.")
    now = [m.content for m in chat.messages]
    assert now[-4:] == before[-4:]  # (the last two exchanges as they were)
    assert now[-6].endswith("The user asked for a fruit, a colour, a city and an animal.") and len(now) < len(before)
    used = chat.context_used
    chat.send(QUESTIONS[4])
    assert chat.last_stats is not None and chat.last_stats.cached_tokens >= used - 1  # (read when it was made)
    assert [(r.id, r.current) for r in rows(*chat.branches())] == [(1, False), (made, True)]
    assert chat.switch("1") == 1 and [m.content for m in chat.messages] == before
    chat.close()


def test_compact_and_trim_from_the_chat_keep_the_conversation_as_a_branch(tiny_model, tmp_path):
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.toml").write_text("[chat]\ncompact_keep = 1\n")
    long = [q + ONWARDS * 3 for q in QUESTIONS[:2]]  # (older exchanges worth a summary)
    # (/trim on the first branch, more than half full: it drops its oldest exchange, a branch of its own)
    lines = [*long, QUESTIONS[2], "/compact", "/tree", "/switch 1", "/trim", "/tree", "/switch 1"]
    r = _quipu(tmp_path, "chat", "-m", tiny_model, "-S", "k", "-n", "4", "--ctx", "900",
               input=("\n".join(lines) + "\n").encode())
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert "compacted into branch 2" in err and "dropped 2 old messages" in err and "on branch 1" in err
    shown = _quipu(tmp_path, "sessions", "tree", "k").stdout.decode()
    assert shown.count("\n") == 3 and "A summary of our conversation" in shown  # (1, its summary, the trimmed)
    few = _quipu(tmp_path, "chat", "-m", tiny_model, "-S", "few", "-n", "4", input=b"Hi.\n/compact\n")
    assert "nothing to compact: the conversation has 1 exchange" in few.stderr.decode()


def test_the_log_knows_which_answer_each_follows_up(tiny_model, tmp_path):
    said = []
    for args in (["Name a fruit."], ["-F", "Another?"], ["-F", "A third?"], ["--cid", "1", "A colour instead?"],
                 ["-F", "More?"]):
        r = _quipu(tmp_path, "run", "-m", tiny_model, "-n", "3", *args)
        assert r.returncode == 0, r.stderr.decode()
        said.append(r.stdout.decode().strip())
    shown = _quipu(tmp_path, "logs", "show", "5").stdout.decode()
    assert "follows: #1 → #4 → #5" in shown
    listed = _quipu(tmp_path, "logs").stdout.decode()
    assert "#4" in listed and "(follows #1)" in listed.split("#4")[1].splitlines()[0]
    prompt = _quipu(tmp_path, "run", "-m", tiny_model, "-F", "--show-prompt", "x").stdout.decode()
    assert "A colour instead?" in prompt and "Another?" not in prompt and "A third?" not in prompt


def test_a_log_from_before_parents_is_read_and_written(tiny_model, tmp_path):
    import sqlite3

    from quipu.store import logbook

    path = tmp_path / "data" / "logs.db"
    path.parent.mkdir(parents=True)
    db = sqlite3.connect(path)
    db.executescript(logbook._TABLES.replace(",\n    parent INTEGER", ""))
    db.execute("PRAGMA user_version = 1")
    db.execute("INSERT INTO answers (at, conversation, command, model, prompt, answer) VALUES (1, '1', 'run', 'm', "
               "'old question', 'old answer')")
    db.commit()
    db.close()
    r = _quipu(tmp_path, "run", "-m", tiny_model, "-n", "3", "--cid", "1", "And now?")
    assert r.returncode == 0, r.stderr.decode()
    assert "follows: #1 → #2" in _quipu(tmp_path, "logs", "show", "2").stdout.decode()


def test_a_full_context_offers_to_summarize_and_keeps_the_whole_conversation(tiny_model, tmp_path, monkeypatch):
    import io

    from quipu.cli.repl import Repl
    from quipu.cli.terminal import Terminal

    chat = _chat(tmp_path, tiny_model, "f")
    for i, q in enumerate(QUESTIONS[:4]):
        chat.send(q + ONWARDS * 3 if i < 2 else q)  # (the older exchanges long enough to be worth a summary)
    before = [m.content for m in chat.messages]
    err = io.StringIO()
    repl = Repl(chat, Terminal(io.StringIO(), io.StringIO(), err, False, False, False, False), chat.env)
    monkeypatch.setattr(repl, "ask", lambda question, default, choices="dnc": "s")  # (the user's answer: summarize)
    repl.context_full(None)
    assert "compacted into branch 2" in err.getvalue() and len(chat.messages) < len(before)
    assert chat.switch("1") == 1 and [m.content for m in chat.messages] == before
    chat.close()


def test_a_follow_up_goes_on_from_the_branch_the_chat_was_on(tiny_model, tmp_path):
    # (an /edit, /undo or /retry moves the chat to another branch: the next answer follows up the
    # last reply of that branch, and -F and --cid give the model that branch alone)
    def chat(name, *lines):
        r = _quipu(tmp_path, "chat", "-m", tiny_model, "-S", name, "-n", "3", input=("\n".join(lines) + "\n").encode())
        assert r.returncode == 0, r.stderr.decode()

    def prompt(*how):
        r = _quipu(tmp_path, "run", "-m", tiny_model, *how, "--show-prompt", "Next")
        assert r.returncode == 0, r.stderr.decode()
        return r.stdout.decode()

    def logged(n):
        return [json.loads(line) for line in _quipu(tmp_path, "logs", "-n", str(n), "--json").stdout.decode().split("\n")
                if line][::-1]  # (oldest first)

    chat("e1", "One", "Two", "/edit 1 Uno")
    shown = prompt("-F")
    assert "Uno" in shown and "One" not in shown and "Two" not in shown
    chat("u1", "Alpha", "Beta", "/undo", "Gamma")
    shown = prompt("-F")
    assert "Alpha" in shown and "Gamma" in shown and "Beta" not in shown
    chat("r1", "Red", "Green", "/retry")
    red, green, again = logged(3)
    assert again["parent"] == red["id"] and green["parent"] == red["id"]  # (the retried reply follows Red's)
    shown = prompt("--cid", str(again["id"]))
    assert shown.count("Green") == 1 and "Red" in shown  # (one Green: the branch, not both replies)
    assert green["answer"] not in shown or green["answer"] == again["answer"]


def test_a_retried_reply_after_an_undo_leaves_at_its_own_exchange(tiny_model, tmp_path):
    # (One, Two, Three, /undo, /retry: the new branch parts from the first at exchange 2's reply)
    chat = _chat(tmp_path, tiny_model, "w")
    for q in QUESTIONS[:3]:
        chat.send(q)
    assert chat.undo()
    chat.retry()
    found = {r.id: r for r in rows(*chat.branches())}
    here = next(r for r in found.values() if r.current)
    assert here.under == 1 and here.leaves_at == 2 and here.first.startswith("(another reply)")
    # the first branch's row says what it says there: exchange 2's reply, as it was
    replies = [m["content"] for m in chat.branches()[1][0].messages if m["role"] == "assistant"]
    assert found[1].first == "(its reply) " + " ".join(replies[1].split())
    chat.close()
