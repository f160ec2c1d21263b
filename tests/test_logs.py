"""What a user keeps: every answer in a searchable log, a follow-up without a name, and roles.
The real command on the bundled model; the log is read back through `quipu logs`, as a user
reads it."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import subprocess
import sys

import pytest

pytestmark = pytest.mark.model

SHORT = ["-n", "6", "--seed", "3", "-t", "0"]


def logged(quipu, *args):
    r = quipu("logs", "--json", "-n", "100", *args)
    assert r.returncode == 0, r.stderr.decode()
    return [json.loads(line) for line in r.stdout.decode().splitlines()]


def test_every_answer_is_logged_and_found_again_by_a_word_in_it(quipu, home):
    for text in ("Name one zebra fact.", "Name a river in Spain."):
        r = quipu("run", *SHORT, text)
        assert r.returncode == 0, r.stderr.decode()
    records = logged(quipu)
    assert [r["prompt"] for r in records] == ["Name a river in Spain.", "Name one zebra fact."]  # (newest first)
    first = records[1]
    assert first["answer"] and first["model"] == "SmolLM2-135M-Instruct" and first["fingerprint"]
    assert first["options"]["max_tokens"] == 6 and first["options"]["temperature"] == 0.0
    assert first["options"]["seed"] == 3 and first["finish_reason"] in ("stop", "length")
    assert first["prompt_tokens"] > 5 and first["completion_tokens"] >= 1 and first["command"] == "run"
    found = logged(quipu, "-q", "zebra")
    assert [r["prompt"] for r in found] == ["Name one zebra fact."]
    assert logged(quipu, "-q", "nothingsaidthis") == []
    shown = quipu("logs", "show", str(first["id"])).stdout.decode()
    assert "Name one zebra fact." in shown and first["answer"] in shown
    plain = quipu("logs").stdout.decode()
    assert plain.index("zebra") < plain.index("Spain")  # (oldest first on a screen, newest last)
    # Private, as everything quipu writes.
    path = quipu("logs", "path").stdout.decode().strip()
    assert path == str(home / "data" / "logs.db")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(home / "data").st_mode) == 0o700


def test_filters_removal_and_the_limit_the_config_sets(quipu, home):
    (home / "config").mkdir(parents=True, exist_ok=True)
    (home / "config" / "config.toml").write_text("[logs]\nmax_records = 3\n")
    for i in range(5):
        assert quipu("run", *SHORT, f"Count to {i}.").returncode == 0
    records = logged(quipu)
    assert [r["prompt"] for r in records] == ["Count to 4.", "Count to 3.", "Count to 2."]  # (the oldest dropped)
    assert logged(quipu, "-m", "smollm2") and not logged(quipu, "-m", "llama-3")
    assert len(logged(quipu, "--since", "1h")) == 3 and logged(quipu, "--since", "2999-01-01") == []
    assert quipu("run", *SHORT, "-S", "trip", "-s", "Be a guide.", "Plan a day.").returncode == 0
    assert quipu("run", *SHORT, "-S", "trip", "And a night?").returncode == 0
    trip = logged(quipu, "--session", "trip")
    assert [r["prompt"] for r in trip] == ["And a night?", "Plan a day."]
    assert {r["system"] for r in trip} == {"Be a guide."}  # (the session's own, not given again)
    assert trip[0]["conversation"] == trip[1]["conversation"] == "session:trip"
    records = logged(quipu)
    r = quipu("logs", "rm", str(records[0]["id"]))
    assert r.returncode == 0 and "1 answer removed" in r.stderr.decode()
    assert records[0]["id"] not in [x["id"] for x in logged(quipu)]
    assert quipu("logs", "rm", "--all").returncode == 0 and logged(quipu) == []
    # Bad input: one line, the usage exit code.
    huge = "9" * 25  # (past what SQLite holds)
    for args in (["-q", "AND OR"], ["-q", '"unclosed'], ["--since", "last tuesday"], ["-n", "0"], ["rm"],
                 ["show", "999"], ["-n", huge], ["show", huge], ["rm", huge], ["show", huge, "--to-session", "x"]):
        r = quipu("logs", *args)
        err = r.stderr.decode()
        assert r.returncode == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, (args, err)


def test_no_log_and_logs_off_write_nothing(quipu, home):
    r = quipu("run", *SHORT, "--no-log", "Say a secret word.")
    assert r.returncode == 0, r.stderr.decode()
    assert not (home / "data" / "logs.db").exists()
    assert quipu("logs", "off").returncode == 0
    assert quipu("run", *SHORT, "Say another secret.").returncode == 0
    assert quipu("chat", *SHORT, input="And one more.\n").returncode == 0
    listed = quipu("logs")
    assert "logging is off" in listed.stderr.decode()
    assert not (home / "data" / "logs.db").exists() or logged(quipu) == []
    assert quipu("logs", "on").returncode == 0
    assert quipu("run", *SHORT, "Say it now.").returncode == 0
    assert [r["prompt"] for r in logged(quipu)] == ["Say it now."]


def test_a_damaged_or_locked_log_never_costs_the_answer(quipu, home):
    assert quipu("run", *SHORT, "First.").returncode == 0
    log = home / "data" / "logs.db"
    # Held by another writer for longer than a run waits: the answer is out, and one warning says why.
    holder = subprocess.Popen([sys.executable, "-c",
                               "import sqlite3, sys, time\n"
                               f"db = sqlite3.connect({str(log)!r}, isolation_level=None)\n"
                               "db.execute('BEGIN EXCLUSIVE'); print('held', flush=True); time.sleep(30)\n"],
                              stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        r = quipu("run", *SHORT, "Second.")
    finally:
        holder.kill()
        holder.wait()
    err = r.stderr.decode()
    assert r.returncode == 0 and r.stdout.strip(), err
    assert "the answer was not logged" in err and "locked" in err and "Traceback" not in err
    # Damaged: garbage where the database was.
    log.write_bytes(b"this is not a database" * 100)
    for name in ("logs.db-wal", "logs.db-shm"):
        (home / "data" / name).unlink(missing_ok=True)
    r = quipu("run", *SHORT, "Third.")
    err = r.stderr.decode()
    assert r.returncode == 0 and r.stdout.strip() and "the answer was not logged" in err, err
    assert len([line for line in err.splitlines() if "not logged" in line]) == 1
    r = quipu("logs")
    assert r.returncode == 1 and "cannot" in r.stderr.decode() and "Traceback" not in r.stderr.decode()


def test_two_runs_at_once_both_land(quipu, home):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ["QUIPU_HOME"] = str(home)
    runs = [subprocess.Popen([sys.executable, "-m", "quipu", "run", *SHORT, f"Question {i}."], env=environ,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
            for i in range(3)]
    for p in runs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and b"not logged" not in err, err.decode()
    assert sorted(r["prompt"] for r in logged(quipu)) == ["Question 0.", "Question 1.", "Question 2."]
    with sqlite3.connect(home / "data" / "logs.db") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_follow_up_goes_on_with_the_last_answer_without_a_name(quipu, home):
    r = quipu("run", *SHORT, "My name is Ada. Reply with: ok.")
    assert r.returncode == 0, r.stderr.decode()
    first = logged(quipu)[0]
    shown = quipu("run", "-F", "--show-prompt", "What is my name?").stdout.decode()
    assert "My name is Ada." in shown and first["answer"].strip() in shown and "What is my name?" in shown
    r = quipu("run", *SHORT, "-F", "What is my name?")
    assert r.returncode == 0, r.stderr.decode()
    second = logged(quipu)[0]
    assert second["conversation"] == first["conversation"] == str(first["id"])
    assert second["prompt_tokens"] > first["prompt_tokens"] + first["completion_tokens"]
    # Another conversation meanwhile: --cid goes back to the first one.
    assert quipu("run", *SHORT, "Something else.").returncode == 0
    shown = quipu("run", "--cid", str(second["id"]), "--show-prompt", "And again?").stdout.decode()
    assert "My name is Ada." in shown and "What is my name?" in shown and "Something else" not in shown
    # `quipu logs` says which answer each follows up
    listed = quipu("logs").stdout.decode()
    assert f"#{second['id']}  " in listed and f"(follows #{first['id']})" in listed and listed.count("(follows") == 1
    alone = quipu("logs", "-n", "1", "-q", '"What is my name"').stdout.decode()
    assert f"(follows #{first['id']})" in alone  # (alone in the listing: the answer it follows, by its id)
    # The chat goes on with it too, as a new session, and its turns join that conversation.
    r = quipu("chat", *SHORT, "--cid", str(second["id"]), input="Say my name.\n")
    assert r.returncode == 0, r.stderr.decode()
    turn = logged(quipu)[0]
    assert turn["command"] == "chat" and turn["prompt"] == "Say my name."
    assert turn["prompt_tokens"] > second["prompt_tokens"] and turn["conversation"] == first["conversation"]
    shown = quipu("run", "-F", "--show-prompt", "Last one?").stdout.decode()
    assert "My name is Ada." in shown and "Say my name." in shown
    for args, said in ((["-F", "-S", "x", "hi"], "cannot be used with"), (["--cid", "999", "hi"], "no logged answer"),
                       (["--cid", "abc", "hi"], "id"), (["-F", "--raw", "hi"], "cannot be used with"),
                       (["--cid", "\u00b2", "hi"], "takes a logged answer's id"),  # (a digit int() does not read)
                       (["--cid", "9" * 25, "hi"], "takes a logged answer's id")):
        r = quipu("run", *args)
        err = r.stderr.decode()
        assert r.returncode == 2 and said in err and len(err.strip().splitlines()) == 1, (args, err)


def test_a_first_follow_up_with_nothing_logged_says_so(quipu):
    r = quipu("run", "-F", "hi")
    assert r.returncode == 2 and "no answer is logged yet" in r.stderr.decode()


def test_a_batchs_rows_are_logged(quipu, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "Name a bird."}\n{"prompt": "Name a fish."}\n')
    r = quipu("run", "--batch", rows, *SHORT)
    assert r.returncode == 0, r.stderr.decode()
    records = logged(quipu)
    assert sorted(r["prompt"] for r in records) == ["Name a bird.", "Name a fish."]
    assert {r["command"] for r in records} == {"batch"}


def test_a_role_s_prompt_holds_each_row_of_a_batch(quipu, tmp_path):
    # (a line of text, a JSON row's prompt, and a messages row's last message, each as run -R holds it)
    assert quipu("roles", "add", "fr", "--prompt", "Translate: $input").returncode == 0
    lines, rows = tmp_path / "lines.txt", tmp_path / "rows.jsonl"
    lines.write_text("Name a bird.\n")
    rows.write_text('{"prompt": "Name a fish."}\n'
                    '{"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}, '
                    '{"role": "user", "content": "Name a tree."}]}\n')
    for source in (lines, rows):
        r = quipu("run", "--batch", source, "-R", "fr", *SHORT)
        assert r.returncode == 0, r.stderr.decode()
    assert sorted(r["prompt"] for r in logged(quipu)) == ["Translate: Name a bird.", "Translate: Name a fish.",
                                                          "Translate: Name a tree."]


def test_roles_keep_a_system_prompt_a_prompt_and_options(quipu, home):
    r = quipu("roles", "add", "fr", "--system", "You translate into French.", "--prompt", "Translate: $input",
              "--set", "max_tokens=5", "--set", "temperature=0")
    assert r.returncode == 0, r.stderr.decode()
    assert stat.S_IMODE(os.stat(home / "config" / "roles" / "fr.toml").st_mode) == 0o600
    assert "fr" in quipu("roles", "list").stdout.decode()
    assert 'prompt = "Translate: $input"' in quipu("roles", "show", "fr").stdout.decode()
    shown = quipu("run", "-R", "fr", "--show-prompt", "Good morning").stdout.decode()
    assert "You translate into French." in shown and "Translate: Good morning" in shown
    r = quipu("run", "-R", "fr", "--seed", "1", "Good night")
    assert r.returncode == 0, r.stderr.decode()
    record = logged(quipu)[0]
    assert record["prompt"] == "Translate: Good night" and record["system"] == "You translate into French."
    assert record["options"]["max_tokens"] == 5 and record["options"]["role"] == "fr"
    # The command line over the role, the role over the config.
    (home / "config" / "config.toml").write_text('system = "From the config."\n[generation]\nmax_tokens = 9\n')
    assert quipu("run", "-R", "fr", "-n", "3", "--seed", "1", "Hello").returncode == 0
    assert logged(quipu)[0]["options"]["max_tokens"] == 3
    assert "You translate into French." in quipu("run", "-R", "fr", "--show-prompt", "x").stdout.decode()
    # A role in the config; a prompt without $input goes before the input.
    (home / "config" / "config.toml").write_text('[roles.terse]\nsystem = "Answer in one word."\n'
                                                 'prompt = "Question:"\nmax_tokens = 4\n')
    shown = quipu("run", "-R", "terse", "--show-prompt", "Why?").stdout.decode()
    assert "Answer in one word." in shown and "Question:\n\nWhy?" in shown
    r = quipu("chat", "-R", "terse", "--seed", "1", input="Why is the sky blue?\n")
    assert r.returncode == 0, r.stderr.decode()
    assert logged(quipu)[0]["prompt"] == "Question:\n\nWhy is the sky blue?"
    # A role that names what a mode refuses, unknown roles and keys: one line each.
    assert quipu("roles", "add", "loose", "--set", "tool_choice=required").returncode == 0
    rows = home / "rows.txt"
    rows.write_text("hi\n")
    for args, said in ((["run", "-R", "loose", "--batch", rows], "role 'loose'"),
                       (["run", "-R", "nope", "hi"], "no role 'nope'"),
                       (["roles", "add", "x", "--set", "colour=red"], "unknown key 'colour'"),
                       (["roles", "add", "../x", "--system", "s"], "a role's name"),
                       (["roles", "add", "fr", "--system", "again"], "is there already"),
                       (["roles", "rm", "terse"], "in the config file")):
        r = quipu(*args)
        err = r.stderr.decode()
        assert r.returncode == 2 and said in err and len(err.strip().splitlines()) == 1, (args, err)
    assert quipu("roles", "rm", "fr").returncode == 0
    assert "fr" not in quipu("roles", "list").stdout.decode().split()


def test_a_follow_up_restores_the_answer_it_follows_from_the_prompt_cache(quipu):
    # As a session's next turn: the earlier prompt and its answer come back from the cache, and
    # only the new message is read.
    paper = " ".join(["The river runs past the old mill and under the stone bridge."] * 20)
    r = quipu("run", "--json", "-n", "300", "--logit-bias", "<|im_end|>=-inf", "--seed", "1",
              paper + " What runs past the mill?")
    assert r.returncode == 0, r.stderr.decode()
    first = json.loads(r.stdout)["usage"]
    assert first["completion_tokens"] == 300  # (so the answer reaches past the next step's start)
    r = quipu("run", "--json", "-n", "8", "--seed", "1", "-F", "And the bridge?")
    assert r.returncode == 0, r.stderr.decode()
    usage = json.loads(r.stdout)["usage"]
    kept = first["prompt_tokens"] + first["completion_tokens"]
    # (the answer too, not only its prompt; to where a prefill step starts: docs/run.md)
    assert first["prompt_tokens"] < usage["cached_tokens"] <= kept


def test_a_logged_conversation_becomes_a_named_session(quipu):
    assert quipu("run", *SHORT, "My name is Ada.").returncode == 0
    assert quipu("run", *SHORT, "-F", "Remember it.").returncode == 0
    last = logged(quipu)[0]
    r = quipu("logs", "show", str(last["id"]), "--to-session", "ada")
    assert r.returncode == 0 and "2 exchanges" in r.stderr.decode(), r.stderr.decode()
    shown = quipu("sessions", "show", "ada").stdout.decode()
    assert "My name is Ada." in shown and "Remember it." in shown and last["answer"].strip()[:20] in shown
    r = quipu("run", *SHORT, "-S", "ada", "--show-prompt", "What is my name?")
    assert "My name is Ada." in r.stdout.decode() and "Remember it." in r.stdout.decode()
    r = quipu("logs", "show", str(last["id"]), "--to-session", "ada")
    assert r.returncode == 2 and "exists already" in r.stderr.decode()


def test_logs_show_keeps_line_breaks_and_escapes_control_characters(quipu):
    r = quipu("run", *SHORT, "--system", "Be brief.\nBe kind.", "First line.\nSecond line \x1b[31mred.")
    assert r.returncode == 0, r.stderr.decode()
    [record] = logged(quipu)
    shown = quipu("logs", "show", str(record["id"])).stdout.decode()
    # (line breaks are text, on a terminal and in a pipe; a terminal's control sequence is not)
    assert "Be brief.\nBe kind." in shown and "First line.\nSecond line \\x1b[31mred." in shown
    assert "\\n" not in shown and "\x1b[31m" not in shown


def test_a_log_another_tool_changed_is_read_for_what_quipu_knows_of_it(quipu, home):
    # (the log is "a SQLite database, open it with any tool": a column added to its table is left
    # alone; a value of another shape is said in one line, naming the answer, which `logs rm` drops)
    import sqlite3

    assert quipu("run", *SHORT, "Name a bird.").returncode == 0
    assert quipu("run", *SHORT, "Name a fish.").returncode == 0
    db = sqlite3.connect(home / "data" / "logs.db")
    db.execute("ALTER TABLE answers ADD COLUMN stars INTEGER")
    db.commit()
    assert [r["prompt"] for r in logged(quipu)] == ["Name a fish.", "Name a bird."]
    assert quipu("run", *SHORT, "-F", "And a tree?").returncode == 0
    first = min(r["id"] for r in logged(quipu))
    for column, value in (("options", "[1, 2]"), ("prompt_tokens", "many"), ("prompt", b"\xff")):
        db.execute(f"UPDATE answers SET {column} = ? WHERE id = ?", (value, first))
        db.commit()
        for args in (["logs"], ["logs", "show", str(first)], ["logs", "--json"]):
            r = quipu(*args)
            err = r.stderr.decode()
            assert r.returncode != 0 and f"(id {first}) whose {column}" in err and len(err.splitlines()) == 1, err
        db.execute("UPDATE answers SET options = NULL, prompt_tokens = 1, prompt = 'x' WHERE id = ?", (first,))
        db.commit()
    assert quipu("logs", "rm", str(first)).returncode == 0
    assert len(logged(quipu)) == 2


def test_a_follow_up_of_what_the_log_does_not_keep_is_refused_in_one_line(quipu, tmp_path):
    # (an answer that read an attached file, or messages given whole: the log keeps neither, so a
    # follow-up would go on without them; it is refused, and one of a plain answer goes on)
    notes, messages = tmp_path / "notes.txt", tmp_path / "messages.json"
    notes.write_text("The meeting is on Friday.\n")
    messages.write_text(json.dumps([{"role": "user", "content": "My name is Zed."},
                                    {"role": "assistant", "content": "Hello, Zed."},
                                    {"role": "user", "content": "What is my name?"}]))
    for given, said in ((["-a", notes, "When is the meeting?"], "read files (notes.txt)"),
                        (["--messages", messages], "read earlier messages")):
        assert quipu("run", *SHORT, *given).returncode == 0
        for follow in (["-F"], ["--cid", str(logged(quipu)[0]["id"])]):
            r = quipu("run", *SHORT, *follow, "And then?")
            err = r.stderr.decode()
            assert r.returncode == 2 and said in err and len(err.splitlines()) == 1, err
    assert quipu("run", *SHORT, "Name a bird.").returncode == 0
    assert quipu("run", *SHORT, "-F", "And a fish?").returncode == 0


def test_an_answer_of_a_session_whose_first_is_not_listed_names_the_session():
    from quipu.cli.logs import _follows
    from quipu.store.logbook import Record

    of_session = Record("Q", "A", "m", conversation="session:t2", id=7)
    assert _follows(of_session, [of_session]) == "  (in session t2)"
    other = Record("Q", "A", "m", conversation="3", id=7)
    assert _follows(other, [other]) == "  (in the conversation of #3)"


def test_a_chat_s_attached_file_is_logged_by_its_name_as_run_a_logs_it(quipu, home, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("The mill was built in 1820 by the river.\n" * 20)
    assert quipu("run", *SHORT, "-a", str(notes), "When was the mill built?").returncode == 0
    r = quipu("chat", *SHORT, input=f"/attach {notes}\nWhen was the mill built?\n".encode())
    assert r.returncode == 0, r.stderr.decode()
    chat, run = logged(quipu)[:2]
    assert chat["command"] == "chat" and run["command"] == "run"
    for record in (chat, run):  # (the message as typed, the file by its name and hash: not its text again)
        assert record["prompt"] == "When was the mill built?" and "1820" not in record["prompt"]
        assert [a["name"] for a in record["attachments"]] == ["notes.txt"]
