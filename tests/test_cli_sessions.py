"""Named sessions through the real command: exact resume, damage, names, locks, disk budget."""

from __future__ import annotations

import json

import pytest

HOT = ["--seed", "11", "--temperature", "0.9", "--repeat-penalty", "1.3"]


def run_json(quipu, *args, input=None):
    r = quipu("run", "--json", *args, input=input)
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout), r.stderr.decode()


@pytest.mark.model
def test_bundled_64_tokens_equal_32_resumed_in_a_new_process_then_32_more(quipu):
    full, _ = run_json(quipu, "-S", "whole", *HOT, "-n", "64", "Write a poem about rivers.")
    first, _ = run_json(quipu, "-S", "half", *HOT, "-n", "32", "Write a poem about rivers.")
    rest, err = run_json(quipu, "-S", "half", "--continue", "-n", "32")
    assert full["finish_reason"] == first["finish_reason"] == "length"
    assert first["text"] + rest["text"] == full["text"]
    assert rest["usage"]["cached_tokens"] == rest["usage"]["prompt_tokens"] - 1
    assert rest["timings"]["restore_s"] > 0 and err == ""


@pytest.mark.model
def test_bundled_chat_turns_resume_exactly(quipu, bundled_model):
    from quipu.engine.settings import ContextSettings
    from quipu.engine.llama import LlamaBackend
    from quipu.sessions.conversation import Conversation
    from quipu.sessions.inference import InferenceSession
    from quipu.sessions.params import SamplingParams

    a, _ = run_json(quipu, "-S", "chat", *HOT, "-n", "24", "Hi! Name a river.")
    b, _ = run_json(quipu, "-S", "chat", "-n", "24", "Now name a mountain.")
    assert b["usage"]["cached_tokens"] > a["usage"]["prompt_tokens"]

    params = SamplingParams(temperature=0.9, repeat_penalty=1.3, seed=11)
    with LlamaBackend(bundled_model, ContextSettings(n_ctx=8192)) as backend:
        conv = Conversation.start(InferenceSession(backend, params))
        one = conv.send("Hi! Name a river.", max_tokens=24)
        two = conv.send("Now name a mountain.", max_tokens=24)
    assert (a["text"], b["text"]) == (one.text, two.text)


def tiny(quipu, tiny_model, *args, **kw):
    return quipu("run", "-m", tiny_model, *args, **kw)


def session_files(home, name):
    root = home / "data" / "sessions"
    return root / f"{name}.json", root / f"{name}.kv"


def test_second_turn_reuses_the_context(quipu, tiny_model):
    a = json.loads(tiny(quipu, tiny_model, "--json", "-S", "s", "-n", "8", *HOT, "hello").stdout)
    b = json.loads(tiny(quipu, tiny_model, "--json", "-S", "s", "-n", "8", "the sky").stdout)
    assert a["usage"]["cached_tokens"] == 0
    assert b["usage"]["cached_tokens"] >= a["usage"]["prompt_tokens"]
    assert b["seed"] == 11 and b["session"] == "s"


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda b: b[: len(b) // 3], id="truncated"),
        pytest.param(lambda b: b[:100] + bytes([b[100] ^ 0x55]) + b[101:], id="flipped-header"),
        pytest.param(lambda b: b[:-5000] + bytes([b[-5000] ^ 1]) + b[-4999:], id="flipped-state"),
        pytest.param(lambda b: b"\x00" * len(b), id="zeros"),
        pytest.param(lambda b: b"", id="empty"),
        pytest.param(lambda b: b"garbage" * 100, id="garbage"),
    ],
)
def test_damaged_state_is_rebuilt_from_the_transcript(quipu, tiny_model, home, damage):
    tiny(quipu, tiny_model, "-S", "s", "-n", "8", *HOT, "hello")
    transcript, state = session_files(home, "s")
    state.write_bytes(damage(state.read_bytes()))
    r = tiny(quipu, tiny_model, "--json", "-S", "s", "-n", "8", "the sky")
    assert r.returncode == 0, r.stderr.decode()
    assert "re-reading" in r.stderr.decode()
    assert json.loads(r.stdout)["usage"]["cached_tokens"] == 0
    assert "Traceback" not in r.stderr.decode()
    # The rebuilt session was saved whole again and resumes from its state.
    r = tiny(quipu, tiny_model, "--json", "-S", "s", "-n", "4", "blue")
    assert r.returncode == 0 and r.stderr == b"" and json.loads(r.stdout)["usage"]["cached_tokens"] > 0


def test_missing_state_is_rebuilt(quipu, tiny_model, home):
    tiny(quipu, tiny_model, "-S", "s", "-n", "8", "hello")
    session_files(home, "s")[1].unlink()
    r = tiny(quipu, tiny_model, "-S", "s", "-n", "8", "again")
    assert r.returncode == 0 and "no saved context state" in r.stderr.decode()


def test_a_rebuild_is_timed_as_restoring_and_each_second_counts_once(quipu, tiny_model, home):
    words = " ".join(["the sky is blue and the world is hello"] * 30)
    tiny(quipu, tiny_model, "-S", "t", "-n", "8", *HOT, words)
    session_files(home, "t")[1].unlink()
    r = tiny(quipu, tiny_model, "--json", "-S", "t", "-n", "8", "again")
    assert r.returncode == 0, r.stderr.decode()
    out = json.loads(r.stdout)
    t, usage = out["timings"], out["usage"]
    assert usage["cached_tokens"] == 0 and usage["prompt_tokens"] > 300
    assert t["restore_s"] > 0  # re-reading 300 tokens is restoring...
    assert t["prefill_s"] <= t["ttft_s"]  # ...and not this turn's prefill, which is within its first token
    # The turn read only its new message, so its prefill speed is that message's tokens over its time.
    assert t["prefill_tok_s"] * t["prefill_s"] < 50


def test_a_save_that_changed_no_context_leaves_the_state_file_alone(quipu, tiny_model, home):
    tiny(quipu, tiny_model, "-S", "keep", "-n", "8", *HOT, "hello")
    state = session_files(home, "keep")[1]
    before = state.stat()
    r = quipu("chat", "-m", tiny_model, "-S", "keep", input="/set temperature 0.5\n/system be brief\n")
    assert r.returncode == 0, r.stderr.decode()
    after = state.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    record = json.loads(session_files(home, "keep")[0].read_text())
    assert record["params"]["temperature"] == 0.5 and record["messages"][0]["content"] == "be brief"
    # The next turn changes the context: the state is written, and it resumes from it.
    r = tiny(quipu, tiny_model, "--json", "-S", "keep", "-n", "4", "more")
    assert r.returncode == 0 and "re-reading" not in r.stderr.decode()
    assert state.stat().st_ino != before.st_ino
    r = tiny(quipu, tiny_model, "--json", "-S", "keep", "-n", "4", "again")
    assert json.loads(r.stdout)["usage"]["cached_tokens"] > 0 and r.stderr == b""


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda b: b[: len(b) // 2], id="truncated"),
        pytest.param(lambda b: b"", id="empty"),
        pytest.param(lambda b: b.replace(b'"tokens"', b'"tokenz"'), id="no-tokens"),
        pytest.param(lambda b: b.replace(b'"n_decoded": ', b'"n_decoded": 9999'), id="bad-count"),
        pytest.param(lambda b: b"\xff\xfe" + b, id="not-utf8"),
        pytest.param(lambda b: b.replace(b'"hello"', b'"hel\\ud800lo"', 1), id="lone-surrogate"),
    ],
)
def test_damaged_transcript_is_a_clear_error_and_left_untouched(quipu, tiny_model, home, damage):
    tiny(quipu, tiny_model, "-S", "s", "-n", "8", "hello")
    transcript, state = session_files(home, "s")
    damaged = damage(transcript.read_bytes())
    transcript.write_bytes(damaged)
    before_state = state.read_bytes()
    r = tiny(quipu, tiny_model, "-S", "s", "-n", "8", "again")
    err = r.stderr.decode()
    assert r.returncode == 1, err
    assert "damaged" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert transcript.read_bytes() == damaged and state.read_bytes() == before_state


@pytest.mark.parametrize("name", ["../x", "a/b", "", ".hidden", "x" * 65, "semi;colon", "sp ace"])
def test_bad_session_names_are_usage_errors(quipu, tiny_model, home, name):
    r = tiny(quipu, tiny_model, "-S", name, "hello")
    assert r.returncode == 2 and "session name" in r.stderr.decode()
    assert not (home.parent / "x.json").exists()


def test_nul_in_a_session_name_is_refused(tiny_model):
    from quipu.errors import SessionNameError
    from quipu.store.store import validate_name

    with pytest.raises(SessionNameError):
        validate_name("a\x00b")


def test_a_session_in_use_is_refused_with_a_clear_message(quipu, tiny_model, home):
    from quipu.store.store import SessionStore

    tiny(quipu, tiny_model, "-S", "busy", "-n", "4", "hello")
    store = SessionStore(home / "data" / "sessions")
    with store.lock("busy"):
        r = tiny(quipu, tiny_model, "-S", "busy", "-n", "4", "again")
    assert r.returncode == 1 and "in use" in r.stderr.decode()


def test_another_model_rebuilds_with_a_warning_and_a_vanished_one_is_refused(quipu, tiny_model, home, tmp_path):
    from tinymodel import write_tiny_gguf

    from quipu.store.store import SessionStore

    def users():
        return [m for m in SessionStore(home / "data" / "sessions").load_transcript("m").messages if m["role"] == "user"]

    other = write_tiny_gguf(tmp_path / "other.gguf", seed=5)
    tiny(quipu, tiny_model, "-S", "m", "-n", "4", "hello")
    assert "context_before" in users()[0]  # (where /undo goes back to, in the context that model read)
    r = quipu("run", "-m", other, "--json", "-S", "m", "-n", "4", "again")
    assert r.returncode == 0 and "was made with" in r.stderr.decode()
    assert json.loads(r.stdout)["usage"]["cached_tokens"] == 0
    # the first model's marks are dropped: the context was read again, on the other model
    assert ["context_before" in m for m in users()] == [False, True]
    other.unlink()
    r = quipu("run", "-S", "m", "-n", "4", "third")
    assert r.returncode == 2 and "--model" in r.stderr.decode()


def test_kv_q8_halves_the_state_and_is_kept_on_resume(quipu, tiny_model, home):
    tiny(quipu, tiny_model, "-S", "f16", "-n", "16", *HOT, "hello world the sky")
    tiny(quipu, tiny_model, "-S", "q8", "--kv-type", "q8_0", "-n", "16", *HOT, "hello world the sky")
    f16, q8 = session_files(home, "f16")[1].stat().st_size, session_files(home, "q8")[1].stat().st_size
    assert q8 < 0.6 * f16
    r = tiny(quipu, tiny_model, "--json", "-S", "q8", "-n", "4", "blue")
    assert r.returncode == 0 and r.stderr == b""
    assert json.loads(r.stdout)["usage"]["cached_tokens"] > 0


def as_saved_before_the_layout_was_recorded(state):
    """A session's state file whose metadata reads as a quipu that did not record the cache's
    layout wrote it (for f16, V transposed: flash attention was kept off)."""
    from quipu.store.statefile import decode_state, encode_state

    blob = decode_state(state.read_bytes())
    context = {k: v for k, v in blob.meta["context"].items() if k != "v_trans"}
    state.write_bytes(encode_state({**blob.meta, "context": context}, bytes(blob.state)))


def test_a_session_remembers_its_flash_attention_and_another_layout_is_read_again(quipu, tiny_model, home):
    whole = json.loads(tiny(quipu, tiny_model, "--json", "-S", "whole", "--flash-attn", "off", "-n", "8", *HOT,
                            "hello").stdout)
    assert whole["usage"]["cached_tokens"] == 0
    assert tiny(quipu, tiny_model, "-S", "off", "--flash-attn", "off", "-n", "8", *HOT, "hello").returncode == 0
    # Continued without the option: the layout it was saved in, restored as it is.
    then = tiny(quipu, tiny_model, "--json", "-S", "whole", "-n", "8", "the sky")
    assert then.returncode == 0 and then.stderr == b""
    then_out = json.loads(then.stdout)
    assert then_out["usage"]["cached_tokens"] > 0
    # Continued with flash attention on: the state is of the other layout, read again with a warning.
    r = tiny(quipu, tiny_model, "--json", "-S", "off", "--flash-attn", "on", "-n", "8", "the sky")
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert "laid out without flash attention" in err and "re-reading its context" in err
    assert json.loads(r.stdout)["usage"]["cached_tokens"] == 0
    # Saved again in that layout, it restores without a word, and is remembered so.
    r = tiny(quipu, tiny_model, "--json", "-S", "off", "-n", "4", "blue")
    assert r.returncode == 0 and r.stderr == b"" and json.loads(r.stdout)["usage"]["cached_tokens"] > 0


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_a_state_saved_before_the_layout_was_recorded_still_restores(quipu, tiny_model, home, kv_type):
    # (f16: flash attention was kept off, and the session goes on so; q8_0: it was on)
    tiny(quipu, tiny_model, "-S", "old", "--kv-type", kv_type, "--flash-attn", "off" if kv_type == "f16" else "auto",
         "-n", "8", *HOT, "hello")
    as_saved_before_the_layout_was_recorded(session_files(home, "old")[1])
    r = tiny(quipu, tiny_model, "--json", "-S", "old", "-n", "4", "blue")
    assert r.returncode == 0 and r.stderr == b""
    assert json.loads(r.stdout)["usage"]["cached_tokens"] > 0


@pytest.mark.parametrize("args, said", [
    (["--flash-attn", "maybe"], "--flash-attn must be one of auto, on, off"),
    (["--flash-attn", "off", "--kv-type", "q8_0"], "needs flash attention"),
])
def test_a_flash_attention_that_cannot_be_is_one_line(quipu, tiny_model, args, said):
    r = tiny(quipu, tiny_model, *args, "-n", "4", "hello")
    err = r.stderr.decode()
    assert r.returncode == 2 and said in err and len(err.strip().splitlines()) == 1


def test_disk_budget_drops_least_recent_state_but_never_transcripts(quipu, tiny_model, home):
    for name in ("old", "mid", "new"):
        tiny(quipu, tiny_model, "-S", name, "-n", "8", "hello")
    size = session_files(home, "new")[1].stat().st_size
    (home / "config").mkdir()
    (home / "config" / "config.toml").write_text(f"[sessions]\nmax_state_bytes = {2 * size + size // 2}\n")
    r = tiny(quipu, tiny_model, "-S", "new", "-n", "4", "more")
    assert r.returncode == 0
    assert not session_files(home, "old")[1].exists()
    assert all(session_files(home, n)[0].exists() for n in ("old", "mid", "new"))
    assert session_files(home, "new")[1].exists()
    r = tiny(quipu, tiny_model, "-S", "old", "-n", "4", "back")
    assert r.returncode == 0 and "re-reading" in r.stderr.decode()


def test_sessions_commands(quipu, tiny_model, home):
    tiny(quipu, tiny_model, "-S", "alpha", "-s", "You are terse.", "-n", "6", "hello")
    tiny(quipu, tiny_model, "-S", "beta", "-n", "6", "the sky")
    listed = json.loads(quipu("sessions", "list", "--json").stdout)
    assert [s["name"] for s in listed] == ["beta", "alpha"]  # most recently used first
    tiny(quipu, tiny_model, "-S", "alpha", "-n", "2", "again")
    assert [s["name"] for s in json.loads(quipu("sessions", "list", "--json").stdout)] == ["alpha", "beta"]
    listed = json.loads(quipu("sessions", "list", "--json").stdout)
    alpha = next(s for s in listed if s["name"] == "alpha")
    assert alpha["turns"] == 2 and alpha["tokens"] > 0 and alpha["size_bytes"] > 0
    table = quipu("sessions", "list").stdout.decode()
    assert "alpha" in table and "beta" in table

    shown = quipu("sessions", "show", "alpha").stdout.decode()
    assert "hello" in shown and "You are terse." in shown

    assert quipu("sessions", "fork", "alpha", "gamma").returncode == 0
    assert quipu("sessions", "fork", "alpha", "beta").returncode == 2
    r = tiny(quipu, tiny_model, "--json", "-S", "gamma", "-n", "4", "more")
    assert json.loads(r.stdout)["usage"]["cached_tokens"] > 0

    assert quipu("sessions", "rename", "beta", "delta").returncode == 0
    names = {s["name"] for s in json.loads(quipu("sessions", "list", "--json").stdout)}
    assert names == {"alpha", "gamma", "delta"}

    md = quipu("sessions", "export", "alpha", "--format", "markdown").stdout.decode()
    assert md.startswith("# alpha") and "## User" in md and "hello" in md
    js = json.loads(quipu("sessions", "export", "alpha", "--format", "json").stdout)
    assert [m["role"] for m in js["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert quipu("sessions", "export", "alpha", "--format", "pdf").returncode == 2

    assert quipu("sessions", "rm", "alpha", "gamma").returncode == 0
    assert {s["name"] for s in json.loads(quipu("sessions", "list", "--json").stdout)} == {"delta"}
    r = quipu("sessions", "rm", "nope")
    assert r.returncode == 2 and "no session" in r.stderr.decode()
    assert quipu("sessions", "show", "../etc").returncode == 2


def test_continue_needs_a_session_and_no_prompt(quipu, tiny_model):
    assert tiny(quipu, tiny_model, "--continue").returncode == 2
    tiny(quipu, tiny_model, "-S", "c", "-n", "4", "hello")
    assert tiny(quipu, tiny_model, "-S", "c", "--continue", "more").returncode == 2
    assert tiny(quipu, tiny_model, "-S", "c", "--continue", "-n", "4").returncode == 0


def test_a_full_session_says_how_to_go_on(quipu, tiny_model):
    assert tiny(quipu, tiny_model, "--ctx", "256", "-S", "f", "-n", "200", *HOT, "hello").returncode == 0
    for i in range(8):
        r = tiny(quipu, tiny_model, "-S", "f", "-n", "40", f"the sky is blue {i}")
        if r.returncode != 0:
            break
    err = r.stderr.decode()
    assert r.returncode == 2 and "session 'f' is full" in err and "--ctx" in err and "/trim" in err
    r = tiny(quipu, tiny_model, "--ctx", "1024", "-S", "f", "-n", "4", "more room")
    assert r.returncode == 0 and "other context settings" in r.stderr.decode()


def test_sessions_show_in_a_pipe_is_not_wrapped_and_escapes_control_characters(quipu, tiny_model):
    long = "word " * 40 + "end."
    r = tiny(quipu, tiny_model, "-S", "wide", "-n", "2", long + "\nnext line \x1b[2J")
    assert r.returncode == 0, r.stderr.decode()
    shown = quipu("sessions", "show", "wide").stdout.decode()
    assert long + "\nnext line \\x1b[2J" in shown  # (one line as long as it is, its break kept)
    assert "\x1b[2J" not in shown


@pytest.mark.model
def test_sessions_list_shows_local_time_in_one_format_and_the_whole_size(quipu, home):
    import re
    from datetime import datetime, timedelta, timezone

    for text in ("one", "two"):  # (a second turn adds to the state's log)
        assert quipu("run", "-S", "when", "-n", "2", text).returncode == 0
    root = home / "data" / "sessions"
    whole = sum((root / f"when.{ext}").stat().st_size for ext in ("json", "kv", "kvlog"))
    assert (root / "when.kvlog").stat().st_size > 0
    [listed] = json.loads(quipu("sessions", "list", "--json").stdout)
    assert listed["size_bytes"] == whole
    updated = datetime.fromisoformat(listed["updated"])
    table = quipu("sessions", "list", env={"TZ": "Asia/Kolkata"}).stdout.decode()
    there = (updated.astimezone(timezone.utc) + timedelta(hours=5, minutes=30)).strftime("%Y-%m-%d %H:%M")
    assert there in table and not re.search(r"\d[T+]\d|\+00:00", table)  # (local, to the minute)


def test_sessions_in_a_chat_fit_a_100_column_terminal(tmp_path, tiny_model):
    import io

    from quipu.app.chat import ChatSession
    from quipu.app.environment import Environment
    from quipu.app.turn_options import TurnOptions
    from quipu.cli.repl import Repl
    from quipu.cli.terminal import Terminal

    env = Environment.load({"QUIPU_HOME": str(tmp_path / "home")})
    err = io.StringIO()
    term = Terminal(io.StringIO(), io.StringIO(), err, False, False, False, False)
    chat = ChatSession.open(env, TurnOptions.of(model=str(tiny_model), max_tokens=2),
                            name="a-rather-long-session-name-for-a-chat-about-rivers")
    try:
        repl = Repl(chat, term, env)
        repl.safely("hello")
        repl.safely("/sessions")
    finally:
        chat.close()
    lines = [line for line in err.getvalue().splitlines() if "tokens" in line and "turn" in line]
    assert lines and all(len(line) <= 100 for line in lines), lines
