"""What a newcomer runs into in a first hour: each refusal says what the user did and what to do,
one line, the documented exit code; what a session remembers, it remembers on resume."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from limits import small_filesystem


def one_line(r) -> str:
    err = r.stderr.decode()
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("args, words", [
    (["-t", "inf"], "temperature must be a finite number"),
    (["--top-p", "nan"], "top-p must be a finite number"),
    (["--schema", '{"enum": []}'], "enum at / must list at least one value"),
    (["--schema", '{"type": "string", "maxLength": 2.5}'], "maxLength at / must be a whole number of 0 or more"),
    (["--schema", '{"type": "array", "minItems": 5, "maxItems": 2}'], "minItems at / (5) is more than maxItems (2)"),
    (["--schema", '{"properties": {"a": {"type": "string", "minLength": -1}}}'],
     "minLength at /properties/a must be a whole number of 0 or more"),
])
def test_values_no_answer_could_keep_to_are_refused(quipu, tiny_model, args, words):
    r = quipu("run", "-m", tiny_model, *args, "hi")
    assert r.returncode == 2 and words in one_line(r)


def test_config_values_are_finite_and_in_range(quipu, tiny_model, home):
    config = home / "config" / "config.toml"
    config.parent.mkdir(parents=True)
    for text, words in (("[generation]\ntemperature = inf\n", "line 2: temperature must be a finite number"),
                        ("[remote]\ntimeout = 0\n", "line 2: timeout is the longest wait in seconds, more than 0"),
                        ("[remote]\ntimeout = nan\n", "timeout is the longest wait"),
                        ("[remote]\ntimeout = -1\n", "timeout is the longest wait")):
        config.write_text(text)
        r = quipu("run", "-m", tiny_model, "hi")
        assert r.returncode == 2 and words in one_line(r), text


def test_a_batch_file_with_a_nul_byte_is_refused(quipu, tiny_model, tmp_path):
    rows = tmp_path / "rows.txt"
    rows.write_bytes(b"first question\nsecond\x00question\n")
    r = quipu("run", "-m", tiny_model, "--batch", rows)
    assert r.returncode == 2 and "is binary data" in one_line(r) and r.stdout == b""


def test_nothing_to_embed_is_a_usage_error(quipu, tiny_model):
    r = quipu("embed", "-m", tiny_model, "")
    assert r.returncode == 2 and "text 1 is empty" in one_line(r)


def test_models_info_of_an_unknown_name_says_so_plainly(quipu):
    r = quipu("models", "info", "nosuch")
    err = one_line(r)
    assert r.returncode == 2 and "model 'nosuch' is neither a file nor a known name" in err and "--model" not in err


def test_a_damaged_kv_type_is_the_session_s_fault_not_the_user_s(quipu, tiny_model, home):
    assert quipu("run", "-m", tiny_model, "-S", "odd", "-n", "2", "hi").returncode == 0
    path = home / "data" / "sessions" / "odd.json"
    record = json.loads(path.read_text())
    record["context"]["kv_type"] = "q4_0"
    path.write_text(json.dumps(record))
    before = path.read_bytes()
    r = quipu("run", "-m", tiny_model, "-S", "odd", "-n", "2", "again")
    err = one_line(r)
    assert r.returncode == 1 and "session 'odd' is damaged" in err and "q4_0" in err and "--kv-type must" not in err
    assert path.read_bytes() == before  # left as it is
    fixed = quipu("run", "-m", tiny_model, "-S", "odd", "--kv-type", "f16", "-n", "2", "again")
    assert fixed.returncode == 0, fixed.stderr.decode()


def test_a_relative_quipu_home_is_made_absolute_once(tmp_path, monkeypatch):
    from quipu import paths

    monkeypatch.chdir(tmp_path)
    dirs = paths.dirs({"QUIPU_HOME": "rel/home"})
    assert dirs.data.is_absolute() and dirs.data == tmp_path / "rel" / "home" / "data"


def test_the_chat_keeps_every_setting_set_and_lists_them(tmp_path, tiny_model):
    from quipu.app.chat import ChatSession
    from quipu.app.environment import Environment
    from quipu.app.turn_options import TurnOptions
    from quipu.cli.repl import Repl
    from quipu.cli.terminal import Terminal

    env = Environment.load({"QUIPU_HOME": str(tmp_path / "home")})
    opts = TurnOptions.of(model=str(tiny_model), ctx=512, seed=3, temperature=1.0)
    chat = ChatSession.open(env, opts, name="kept")
    err = io.StringIO()
    repl = Repl(chat, Terminal(io.StringIO(), io.StringIO(), err, False, False, False, False), env)
    repl.safely("/set max_tokens 3")
    repl.safely("/set top_k 7")
    repl.safely("/set temperature inf")  # refused, one line
    assert "quipu: error: temperature must be a finite number" in err.getvalue()
    repl.safely("hello there")
    repl.safely("/sessions")
    assert " 1 turn " in err.getvalue()
    chat.close()
    # Resumed in a new chat: the reply length is remembered as the sampling settings are.
    chat = ChatSession.open(env, TurnOptions(model=str(tiny_model)), name="kept")
    try:
        listed = {k: (v, origin) for k, v, origin in chat.settings()}
        assert listed["max_tokens"] == (3, "session") and listed["top_k"] == (7, "session")
        assert listed["temperature"] == (1.0, "session")
        outcome = chat.send("and again")
        assert len(outcome.tokens) <= 3
        err = io.StringIO()
        Repl(chat, Terminal(io.StringIO(), io.StringIO(), err, False, False, False, False), env).safely("/set")
        said = err.getvalue()
        assert "max_tokens" in said and "session" in said and "repeat_penalty" in said and "usage" not in said
    finally:
        chat.close()


def test_the_set_table_s_columns_are_in_line(home, tiny_model, monkeypatch):
    from quipu.app.chat import ChatSession
    from quipu.app.environment import Environment
    from quipu.app.turn_options import TurnOptions
    from quipu.cli.repl import Repl
    from quipu.cli.terminal import Terminal

    monkeypatch.setenv("QUIPU_HOME", str(home))
    env = Environment.load()
    chat = ChatSession.open(env, TurnOptions(model=str(tiny_model)))
    try:
        err = io.StringIO()
        Repl(chat, Terminal(io.StringIO(), io.StringIO(), err, False, False, False, False), env).safely("/set")
    finally:
        chat.close()
    # each row's origin (its last word) where every other row's is: max_tokens' long default too
    rows = [line for line in err.getvalue().splitlines() if line.startswith("  ")]
    assert any("until the reply ends" in row for row in rows)
    assert len(rows) > 5 and len({len(line) - len(line.split()[-1]) for line in rows}) == 1, err.getvalue()


def test_a_run_in_a_session_keeps_its_reply_length(quipu, tiny_model):
    first = quipu("run", "-m", tiny_model, "-S", "short", "-n", "2", "--seed", "1", "--json", "hi")
    assert first.returncode == 0, first.stderr.decode()
    again = json.loads(quipu("run", "-m", tiny_model, "-S", "short", "--seed", "1", "--json", "and?").stdout)
    assert again["usage"]["completion_tokens"] <= 2
    # (every end-of-turn token banned, and seeded: a random reply may still spell the template's
    # end as text, which ends it, so the draws are fixed)
    longer = json.loads(quipu("run", "-m", tiny_model, "-S", "short", "-n", "9", "--temperature", "1", "--seed", "1",
                              "--logit-bias", "0=-inf", "--logit-bias", "2=-inf", "--logit-bias", "4=-inf",
                              "--json", "more").stdout)
    assert longer["usage"]["completion_tokens"] > 2  # the command line wins, and is kept from then on


def test_a_failed_save_ends_the_streamed_line_before_the_error(tmp_path, tiny_model):
    home = tmp_path / "small"
    sessions = home / "data" / "sessions"
    sessions.mkdir(parents=True)
    with small_filesystem(sessions, "256k"):
        environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
        environ["QUIPU_HOME"] = str(home)
        r = subprocess.run([sys.executable, "-m", "quipu", "run", "-m", str(tiny_model), "--ctx", "2048", "-S", "big",
                            "-n", "30", "--logit-bias", "2=-inf", "x " * 300], env=environ, capture_output=True,
                           stdin=subprocess.DEVNULL)
        assert r.returncode == 1 and "could not save" in r.stderr.decode()
        assert r.stdout and r.stdout.endswith(b"\n")


@pytest.mark.parametrize("args, words", [
    (["run", "-t", "abc", "x"], "Invalid value for '--temperature' / '-t': not a number"),
    (["chat", "-n", "1.5"], "Invalid value for '--max-tokens' / '-n': not a whole number"),
    (["sessions", "show"], "Missing argument 'name'"),
    (["run", "--nope", "x"], "No such option: --nope"),
])
def test_typer_s_usage_errors_speak_in_quipu_s_voice(quipu, args, words):
    r = quipu(*args)
    err = one_line(r)
    assert r.returncode == 2 and err.startswith("quipu: error: ") and words in err and "--help" in err
    assert "Usage:" not in err and "╭" not in err


def test_help_names_values_in_words_not_type_tags(quipu):
    for args in (["run", "--help"], ["chat", "--help"], ["embed", "--help"], ["models", "list", "--help"],
                 ["sessions", "show", "--help"]):
        out = quipu(*args).stdout.decode()
        assert "<bool>" not in out and "<str>" not in out and "<int>" not in out and "list[" not in out, args
    assert "NUMBER" in quipu("run", "--help").stdout.decode()
