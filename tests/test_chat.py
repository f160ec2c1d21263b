"""`quipu chat`: the command table and dispatch without a terminal, then the real REPL in a
pseudo-terminal, driven as a user drives it."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time

import pytest

from quipu.cli.repl import Repl, SlashCompleter
from quipu.cli.slash import COMMANDS, parse_command
from quipu.cli.terminal import Terminal

REQUIRED = {"help", "exit", "save", "load", "sessions", "reset", "undo", "retry", "continue", "system", "set",
            "stats", "context"}


def test_the_table_has_every_command_once_with_help():
    names = [c.name for c in COMMANDS]
    assert REQUIRED <= set(names) and len(names) == len(set(names))
    assert all(c.help and callable(c.handler) for c in COMMANDS)


@pytest.mark.parametrize(
    "line, name, arg",
    [("/help", "help", ""), ("/set top_k 5", "set", "top_k 5"), ("/sys be brief", "system", "be brief"),
     ("/SAVE x", "save", "x"), ("/s", None, "s"), ("/nope", None, "nope")],
)
def test_parse_command(line, name, arg):
    command, rest = parse_command(line)
    assert (command.name if command else None, rest) == (name, arg)


def test_completion_comes_from_the_table():
    from prompt_toolkit.document import Document

    got = [c.text for c in SlashCompleter().get_completions(Document("/re"), None)]
    assert got == ["/reset", "/retry", "/regex"]
    assert list(SlashCompleter().get_completions(Document("hello /re"), None)) == []


def test_a_file_argument_completes_as_a_path(tmp_path, monkeypatch):
    from prompt_toolkit.completion import CompleteEvent
    from prompt_toolkit.document import Document

    (tmp_path / "photo.png").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("")
    monkeypatch.chdir(tmp_path)
    done = [c.text for c in SlashCompleter().get_completions(Document("/attach pho"), CompleteEvent())]
    assert done == ["to.png"]  # (what the path lacks)
    assert [c.text for c in SlashCompleter().get_completions(Document("/system pho"), CompleteEvent())] == []


@pytest.fixture
def repl(tmp_path, tiny_model):
    from quipu.app.chat import ChatSession
    from quipu.app.environment import Environment
    from quipu.app.turn_options import TurnOptions

    env = Environment.load({"QUIPU_HOME": str(tmp_path / "home")})
    out, err = io.StringIO(), io.StringIO()
    term = Terminal(io.StringIO(), out, err, False, False, False, False)
    # (a seed whose first reply's text reads again as its own tokens: the random model's bytes
    # need not, and /undo then goes back to where they part, before the reply)
    chat = ChatSession.open(env, TurnOptions.of(model=str(tiny_model), max_tokens=8, seed=4), name="unit")
    yield Repl(chat, term, env), out, err
    chat.close()


def test_dispatch_without_a_terminal(repl):
    r, out, err = repl
    r.safely("hello there")
    assert out.getvalue().strip()
    used = r.chat.context_used
    before = list(r.chat.named.session.tokens)
    r.safely("the sky")
    assert r.chat.context_used > used
    r.safely("/undo")
    # the context as it was, or as far as the turn left it so (a reply cut by -n may have its
    # last token read again with the template's text after it)
    after = list(r.chat.named.session.tokens)
    assert after == before[:len(after)] and len(after) >= used - 2
    r.safely("/set temperature 0")
    assert r.chat.params.temperature == 0
    r.safely("/set top_p 9")
    assert "top-p" in err.getvalue()
    r.safely("/system be brief")
    assert r.chat.messages[0].content == "be brief"
    r.safely("/save copy")
    assert "copy" in [i.name for i in r.chat.sessions()]
    r.safely("/reset")
    assert [m.role for m in r.chat.messages] == ["system"]
    r.safely("/help")
    assert all(f"/{name}" in err.getvalue() for name in REQUIRED)
    r.safely("/load copy")
    assert r.chat.name == "copy" and len(r.chat.messages) == 3
    r.safely("/exit")
    assert r.running is False


def test_retry_draws_a_new_reply_in_place(repl):
    r, out, err = repl
    r.safely("hello")
    first = r.chat.messages[-1].content
    r.safely("/retry")
    assert [m.role for m in r.chat.messages] == ["user", "assistant"]
    assert r.chat.messages[-1].content != first


def run_chat(home, *args, input: bytes, env=None):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ.update(QUIPU_HOME=str(home), **(env or {}))
    return subprocess.run([sys.executable, "-m", "quipu", "chat", *args], input=input, capture_output=True,
                          env=environ, timeout=300)


@pytest.mark.model
def test_piped_chat_prints_one_reply_per_line_and_exits_0(home):
    r = run_chat(home, "-n", "16", "--seed", "3", "-S", "piped", input=b"Hi\nBye\n")
    assert r.returncode == 0, r.stderr.decode()
    assert b"\x1b" not in r.stdout
    record = json.loads((home / "data" / "sessions" / "piped.json").read_text())
    assert [m["role"] for m in record["messages"]] == ["user", "assistant", "user", "assistant"]
    replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
    assert r.stdout.decode() == "".join(reply if reply.endswith("\n") else reply + "\n" for reply in replies)


def test_a_piped_chat_without_a_name_keeps_no_session_but_what_it_saves(home, tiny_model):
    sessions = home / "data" / "sessions"
    r = run_chat(home, "-m", tiny_model, "-n", "4", input=b"hello\nthe sky\n")
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.strip() and "not kept" in r.stderr.decode() and "-S NAME" in r.stderr.decode()
    assert list(sessions.glob("*")) == []
    r = run_chat(home, "-m", tiny_model, "-n", "4", input=b"hello\n/save keepme\nthe sky\n/new\nagain\n")
    assert r.returncode == 0, r.stderr.decode()
    assert {p.stem for p in sessions.glob("*")} == {"keepme"}, list(sessions.glob("*"))
    resumed = run_chat(home, "-m", tiny_model, "-n", "4", "--resume", input=b"more\n")
    assert resumed.returncode == 0 and "session: keepme" in resumed.stderr.decode(), resumed.stderr.decode()
    record = json.loads((sessions / "keepme.json").read_text())
    assert [m["content"] for m in record["messages"] if m["role"] == "user"] == ["hello", "more"]


def test_a_full_context_drops_the_oldest_exchanges_and_goes_on(home, tiny_model):
    lines = "".join(f"the sky is blue and the world is hello number {i}\n" for i in range(12)).encode()
    r = run_chat(home, "-m", tiny_model, "--ctx", "256", "-n", "24", "-s", "be kind", "-S", "full", input=lines)
    assert r.returncode == 0, r.stderr.decode()
    assert "context is full" in r.stderr.decode()
    record = json.loads((home / "data" / "sessions" / "full.json").read_text())
    assert record["messages"][0] == {"role": "system", "content": "be kind"}
    assert record["messages"][-2]["content"].endswith("number 11")
    assert len(record["tokens"]) <= 256


def test_a_malformed_command_is_one_line_and_the_chat_goes_on(home, tiny_model):
    lines = '/save "abc\n/set top_k\n/load \'\n/system "unclosed\nhello\n'
    r = run_chat(home, "-m", tiny_model, "-n", "4", "-S", "typo", input=lines.encode())
    err = r.stderr.decode()
    assert r.returncode == 0 and "Traceback" not in err, err
    assert "quipu: error: " in err and "closing quotation" in err
    record = json.loads((home / "data" / "sessions" / "typo.json").read_text())
    assert [m["content"] for m in record["messages"] if m["role"] == "user"] == ["hello"]


def test_a_message_that_can_never_fit_is_refused_once(repl, monkeypatch):
    from quipu.app.named import NamedSession

    r, out, err = repl
    r.safely("hello")
    saves = []
    real_save = NamedSession.save
    monkeypatch.setattr(NamedSession, "save", lambda self: (saves.append(1), real_save(self)))
    r.safely(" ".join(["hello world the sky"] * (r.chat.context_size // 4)))
    said = err.getvalue()
    assert said.count("cannot fit") == 1 and "context is full" not in said, said
    assert f"context ({r.chat.context_size} tokens)" in said
    assert saves == []  # nothing was dropped, nothing saved
    assert [m.role for m in r.chat.messages] == ["user", "assistant"]
    r.safely("the sky")  # and the chat goes on
    assert len(r.chat.messages) == 4


def test_trim_keeps_the_last_exchange_though_it_holds_more_than_half_the_context(repl):
    # Room is made by the oldest exchanges; the last one (the reply just read, the one a full
    # context stopped in) stays, though half the context is then not free.
    r, out, err = repl
    r.safely("hello")
    conv, size = r.chat.named.conversation, r.chat.context_size
    long = "the sky"
    while conv.size_alone(long)[0] < size * 0.6:
        long += " hello world the sky"
    r.safely(long)
    assert [m.role for m in r.chat.messages] == ["user", "assistant"] * 2
    r.safely("/trim")
    assert "dropped 2 old messages" in err.getvalue()
    assert [m.content for m in r.chat.messages if m.role == "user"] == [long]
    r.safely("/trim")  # (nothing older to drop: said so, with how full the context is)
    assert "nothing to drop (the context is" in err.getvalue() and len(r.chat.messages) == 2


def test_a_message_larger_than_what_is_free_says_so_not_that_the_context_is_full(repl):
    r, out, err = repl
    conv, size = r.chat.named.conversation, r.chat.context_size

    def of(share: float) -> str:
        text = "the sky"
        while conv.size_alone(text)[0] < size * share:
            text += " hello world the sky"
        return text

    r.safely(of(0.55))  # (the context a little more than half full)
    big = of(0.5)  # (fits alone, not beside what is there)
    r.safely(big)
    said = err.getvalue()
    assert f"the message does not fit: it is {r.chat.size_of(big)} tokens" in said and "context is full" not in said
    assert f"of the context's {size} are free" in said


def test_reset_shows_the_context_it_left_and_trim_on_a_short_chat_drops_nothing(repl):
    r, out, err = repl
    r.safely("/system be brief")
    r.safely("hello there")
    r.safely("the sky")
    r.safely("/trim")  # (2% full: nothing to drop, and it says so)
    assert "nothing to drop (the context is" in err.getvalue() and "dropped 0" not in err.getvalue()
    before = r.chat.context_used
    r.safely("/reset")
    # the count is the one the next message reads on from, at once: the system prompt's
    system = r.chat.named.conversation.context_tokens(add_generation_prompt=False)
    assert r.chat.context_used == len(system) < before
    r.safely("/context")
    assert f"context: {r.chat.context_used} of" in err.getvalue().splitlines()[-1]


def test_a_long_line_piped_into_a_small_context_is_refused_once(home, tiny_model):
    long_line = " ".join(f"hello{i} world" for i in range(180))
    r = run_chat(home, "-m", tiny_model, "--ctx", "256", "-n", "8", "-S", "long",
                 input=f"hello\n{long_line}\nthe sky\n".encode())
    err = r.stderr.decode()
    assert r.returncode == 0 and "Traceback" not in err and "RecursionError" not in err, err
    assert err.count("cannot fit") == 1 and err.count("context is full") == 0, err
    record = json.loads((home / "data" / "sessions" / "long.json").read_text())
    assert [m["content"] for m in record["messages"] if m["role"] == "user"] == ["hello", "the sky"]


def test_room_is_made_for_a_long_message_that_fits_alone(home, tiny_model):
    lines = "".join(f"the sky is blue {i}\n" for i in range(4))
    long_line = " ".join(f"w{i}" for i in range(45))  # most of the context, but it fits alone
    r = run_chat(home, "-m", tiny_model, "--ctx", "256", "-n", "8", "-S", "room",
                 input=(lines + long_line + "\n").encode())
    err = r.stderr.decode()
    assert r.returncode == 0 and "Traceback" not in err, err
    # (said once: the message larger than what is free, with its size, or else the context full)
    assert err.count("the message does not fit: it is") + err.count("context is full") == 1, err
    assert "cannot fit" not in err, err
    record = json.loads((home / "data" / "sessions" / "room.json").read_text())
    assert record["messages"][-2]["content"] == long_line and record["messages"][-1]["role"] == "assistant"


def test_loading_the_open_session_says_so(repl):
    r, out, err = repl
    r.safely("hello")
    r.safely("/load unit")
    said = err.getvalue()
    assert "already" in said and "in use" not in said, said
    assert r.chat.name == "unit" and len(r.chat.messages) == 2


def test_a_chat_holds_its_session_against_a_run(home, tiny_model):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ["QUIPU_HOME"] = str(home)
    chat = subprocess.Popen([sys.executable, "-m", "quipu", "chat", "-m", str(tiny_model), "-S", "held"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ)
    try:
        deadline = time.time() + 60
        while not (home / "data" / "sessions" / "held.lock").exists() and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        r = subprocess.run([sys.executable, "-m", "quipu", "run", "-m", str(tiny_model), "-S", "held", "hi"],
                           capture_output=True, env=environ, stdin=subprocess.DEVNULL, timeout=120)
        assert r.returncode == 1 and "in use" in r.stderr.decode()
    finally:
        chat.communicate(b"hello\n", timeout=120)
    assert chat.returncode == 0


# ---- the real REPL in a pseudo-terminal ---------------------------------------------------

import pexpect


def spawn(home, *args):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ.update(QUIPU_HOME=str(home), PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm")
    child = pexpect.spawn(sys.executable, ["-m", "quipu", "chat", *args], env=environ, encoding="utf-8",
                          dimensions=(30, 120), timeout=120)
    child.expect("›")
    return child


def context_of(child) -> int:
    child.send("/context\r")
    child.expect(r"context: (\d+) of (\d+) tokens")
    used = int(child.match.group(1))
    child.expect("›")
    return used


@pytest.mark.model
def test_the_repl_as_a_person_uses_it(home):
    # End-of-text banned (the bundled model's <|endoftext|> and <|im_end|>): no reply ends early.
    child = spawn(home, "-S", "pty", "-n", "12", "--seed", "5", "-s", "You are brief.",
                  "--logit-bias", "0=-inf", "--logit-bias", "2=-inf")
    assert "new session 'pty'" in child.before
    # Tab completion of a slash command, and /help.
    child.send("/he")
    child.expect("show this help")  # the completion menu is up, with the command's help
    child.send("\t")
    child.expect("/help")  # the line now reads the completed command
    child.send("\r")
    child.expect("Ctrl-D leaves")
    child.expect("›")
    # A turn.
    child.send("Hello! Say hi back in one short sentence.\r")
    child.expect("›")
    empty = context_of(child)
    assert empty > 10
    # Ctrl-C during a reply stops it, keeps the program and the partial reply: the reply cannot
    # end by itself before 4,000 tokens, so the Ctrl-C lands while it streams, however fast.
    child.send("/set max_tokens 4000\r")
    child.expect("max_tokens = 4000")
    child.expect("›")
    child.send("Write a very long story about a dragon and a knight.\r")
    child.expect(r"\x1b\[\?2004l")  # the prompt has let go of the terminal: the reply follows
    child.expect(r"[A-Za-z]{4,} [A-Za-z]+ [A-Za-z]+ ")
    screen = child.before + child.after
    child.sendintr()
    child.expect(r"\[stopped\]")
    screen += child.before
    child.expect("›")
    after_story = context_of(child)
    assert after_story > empty
    # what the session keeps of the stopped reply is what the screen showed, word for word
    kept = json.loads((home / "data" / "sessions" / "pty.json").read_text())["messages"][-1]
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|[\r●]", "", screen).split()
    assert kept["role"] == "assistant" and kept["content"].split() == shown
    child.send("/set max_tokens 12\r")
    child.expect("max_tokens = 12")
    child.expect("›")
    # Ctrl-C at an empty prompt says how to leave, and does not.
    child.sendintr()
    child.expect("to leave")
    # The next turn works; /undo returns the context to exactly what it was.
    child.send("Thanks!\r")
    child.expect("›")
    assert context_of(child) > after_story
    child.send("/undo\r")
    child.expect("back before the last exchange")
    child.expect("›")
    assert context_of(child) == after_story
    child.send("/exit\r")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0

    # Resuming shows the earlier turns and continues from the saved context.
    child = spawn(home, "--resume")
    assert "resumed session 'pty'" in child.before
    assert "dragon" in child.before and "Thanks!" not in child.before
    assert context_of(child) == after_story
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


@pytest.mark.model
def test_history_search_multiline_paste_and_markdown(home):
    child = spawn(home, "-S", "keys", "-n", "12", "--markdown")
    child.send("Name a big river.\r")
    context_of(child)  # answered only once the reply is done: the prompt is live again
    # Esc-Enter adds a line; a bracketed paste of several lines is one message.
    child.send("first line")
    child.send("\x1b\r")
    child.send("second line\r")
    context_of(child)
    child.send("\x1b[200~pasted one\npasted two\x1b[201~")
    time.sleep(0.3)
    child.send("\r")
    context_of(child)
    child.sendeof()
    child.expect(pexpect.EOF)
    record = json.loads((home / "data" / "sessions" / "keys.json").read_text())
    users = [m["content"] for m in record["messages"] if m["role"] == "user"]
    assert users == ["Name a big river.", "first line\nsecond line", "pasted one\npasted two"]

    # History is kept across runs: Ctrl-R finds an earlier message.
    child = spawn(home, "-S", "keys", "-n", "4")
    child.send("\x12")  # Ctrl-R
    child.send("big riv")
    child.expect(r"Name a \S*big riv")  # the match, highlighted
    time.sleep(0.3)
    child.send("\r")  # takes the found line
    time.sleep(0.3)
    child.send("\r")  # sends it
    context_of(child)
    child.sendeof()
    child.expect(pexpect.EOF)
    record = json.loads((home / "data" / "sessions" / "keys.json").read_text())
    assert [m["content"] for m in record["messages"] if m["role"] == "user"][-1] == "Name a big river."


def test_reasoning_is_shown_dimmed_and_can_be_hidden(tmp_path, tiny_model):
    from pathlib import Path

    from quipu.app.chat import ChatSession
    from quipu.app.environment import Environment
    from quipu.app.turn_options import TurnOptions

    r1 = Path(__file__).parent / "templates" / "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja"
    qwen3 = Path(__file__).parent / "templates" / "Qwen-Qwen3-0.6B.jinja"
    env = Environment.load({"QUIPU_HOME": str(tmp_path / "home")})
    out, err = io.StringIO(), io.StringIO()
    term = Terminal(io.StringIO(), out, err, False, True, True, True)  # a colour terminal
    chat = ChatSession.open(env, TurnOptions.of(model=str(tiny_model), max_tokens=6, seed=3, chat_template=str(r1)),
                            name="think")
    try:
        repl = Repl(chat, term, env)
        repl.safely("hello")
        assert "\x1b[2m" in out.getvalue()  # the whole reply is reasoning: the prompt opened the block
        out.seek(0)
        out.truncate()
        repl.safely("/think hide")
        repl.safely("again")
        assert "\x1b[2m" not in out.getvalue() and len(chat.messages) == 4
        repl.safely("/think on")
        assert "no switch for thinking" in err.getvalue()
    finally:
        chat.close()
    chat = ChatSession.open(env, TurnOptions(model=str(tiny_model), chat_template=str(qwen3)), name="switch")
    try:
        Repl(chat, term, env).safely("/think off")
        assert chat.named.conversation.settings.variables == {"enable_thinking": False}
    finally:
        chat.close()
    record = json.loads((tmp_path / "home" / "data" / "sessions" / "switch.json").read_text())
    assert record["template_variables"] == {"enable_thinking": False}  # the session remembers it


def test_think_sets_a_reasoning_effort_and_budget_that_the_session_keeps(tmp_path, tiny_model):
    from pathlib import Path

    from quipu.app.chat import ChatSession
    from quipu.app.environment import Environment
    from quipu.app.turn_options import TurnOptions

    oss = Path(__file__).parent / "templates" / "openai-gpt-oss-120b.jinja"
    env = Environment.load({"QUIPU_HOME": str(tmp_path / "home")})
    out, err = io.StringIO(), io.StringIO()
    term = Terminal(io.StringIO(), out, err, False, True, True, True)
    chat = ChatSession.open(env, TurnOptions(model=str(tiny_model), max_tokens=4, chat_template=str(oss)), name="oss")
    try:
        repl = Repl(chat, term, env)
        repl.safely("/think high")
        repl.safely("/think budget 64")
        assert chat.reasoning == ("high", 64)
        for bad in ("lots", "²", "9" * 5000):
            repl.safely(f"/think budget {bad}")
        said = err.getvalue().splitlines()[2:]
        assert len(said) == 3 and all("budget takes a number of tokens" in line and len(line) < 200 for line in said)
        assert "unexpected" not in err.getvalue() and chat.reasoning == ("high", 64)
    finally:
        chat.close()
    chat = ChatSession.open(env, TurnOptions(model=str(tiny_model)), name="oss")  # resumed
    try:
        assert chat.reasoning == ("high", 64)
        from quipu.sessions.base import Message

        assert "Reasoning: high" in chat.named.conversation.render([Message("user", "hi")], True).text
    finally:
        chat.close()


@pytest.mark.model
def test_replies_break_between_words_and_nothing_shows_after_ctrl_c(home):
    import re

    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ.update(QUIPU_HOME=str(home), PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm")
    child = pexpect.spawn(sys.executable, ["-m", "quipu", "chat", "-S", "wrap", "-n", "60", "--seed", "2",
                                           "--logit-bias", "0=-inf", "--logit-bias", "2=-inf"],
                          env=environ, encoding="utf-8", dimensions=(30, 40), timeout=120)
    child.expect("›")
    child.send("Describe a busy market in a long paragraph.\r")
    child.expect(r"\x1b\[\?2004l")
    child.expect("›")
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", child.before).replace("\r", "")
    record = json.loads((home / "data" / "sessions" / "wrap.json").read_text())
    reply = record["messages"][-1]["content"]
    lines = [line for line in shown.split("\n") if line.strip()]
    assert all(len(line.rstrip()) <= 40 for line in lines), lines
    assert " ".join(" ".join(lines).split()).find(" ".join(reply.split()[:-1])) >= 0  # every word whole
    # Ctrl-C: the reply stops, and no more of it is printed after the ^C.
    child.send("/set max_tokens 4000\r")
    child.expect("max_tokens = 4000")
    child.expect("›")
    child.send("Now write a very long story about the market.\r")
    child.expect(r"\x1b\[\?2004l")
    child.expect(r"[A-Za-z]{4,}")
    child.sendintr()
    child.expect(r"\[stopped\]")
    after = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", child.before).replace("\r", "")
    tail = after.split("^C", 1)[1] if "^C" in after else after
    assert tail.strip() == "", tail
    child.expect("›")
    child.sendeof()
    child.expect(pexpect.EOF)


def test_new_leaves_no_empty_session_behind(tmp_path, tiny_model):
    """A session comes to be on disk with its first turn: /new from a chat where nothing was said,
    and a /new never talked in, leave nothing; the one talked in is kept."""
    from quipu.app.chat import ChatSession
    from quipu.app.environment import Environment
    from quipu.app.turn_options import TurnOptions

    env = Environment.load({"QUIPU_HOME": str(tmp_path / "home")})
    term = Terminal(io.StringIO(), io.StringIO(), io.StringIO(), False, False, False, False)
    chat = ChatSession.open(env, TurnOptions.of(model=str(tiny_model), max_tokens=3, temperature=0.0))
    try:
        repl = Repl(chat, term, env)
        for line in ("/new", "/new", "hi", "/new"):
            repl.safely(line)
        talked_in = [info for info in chat.sessions()]
    finally:
        chat.close()
    assert [info.turns for info in talked_in] == [1], talked_in


@pytest.mark.parametrize("columns", [120, 80])
def test_help_fits_the_terminal_and_keeps_one_column(home, tiny_model, columns):
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    env.update(QUIPU_HOME=str(home), COLUMNS=str(columns))
    r = subprocess.run([sys.executable, "-m", "quipu", "chat", "-m", str(tiny_model)], input=b"/help\n",
                       capture_output=True, env=env, timeout=300)
    lines = [line for line in r.stderr.decode().splitlines() if line.startswith("  ")]
    assert r.returncode == 0 and len(lines) > len(COMMANDS)
    assert all(len(line) <= columns for line in lines), max(lines, key=len)
    starts = {line.index(c.help.split()[0], len(f"  /{c.name}")) for c in COMMANDS for line in lines
              if line.startswith(f"  /{c.name} ") and len(line.strip()) > len(f"/{c.name} {c.args}".strip())}
    assert len(starts) == 1, starts  # (what each does begins in one column)


def test_a_reply_the_context_cut_goes_on_once_room_is_made(tmp_path, bundled_model):
    """The context fills during a reply; "drop" frees the oldest exchange and the same reply goes
    on from where it was cut, in the context read again."""
    from quipu.app.chat import ChatSession
    from quipu.app.environment import Environment
    from quipu.app.turn_options import TurnOptions

    env = Environment.load({"QUIPU_HOME": str(tmp_path / "home")})
    out, err = io.StringIO(), io.StringIO()
    term = Terminal(io.StringIO(), out, err, False, False, False, False)
    chat = ChatSession.open(env, TurnOptions.of(model=str(bundled_model), ctx=128, temperature=0, max_tokens=3),
                            name="cut")
    try:
        r = Repl(chat, term, env)
        r.safely("hi")
        r.safely("/set max_tokens 300")
        seen: list[str] = []
        original = chat.drop_oldest

        def drop(unsent=None):
            seen.append(chat.messages[-1].content)  # (the reply as the context cut it)
            return original(unsent)

        chat.drop_oldest = drop  # type: ignore[method-assign]
        r.safely("Write a long story about a cat and a dog, with many details.")
        said = err.getvalue()
        assert "the context is full (128 of 128 tokens)" in said and "dropped 2 old messages" in said, said
        assert "or [c]ancel? (a letter, then Enter; Enter alone drops;" in said  # (it is no single-key question)
        assert len(seen) == 1 and [m.role for m in chat.messages if m.role != "system"] == ["user", "assistant"]
        reply = chat.messages[-1].content
        assert reply.startswith(seen[0]) and len(reply) > len(seen[0]), said  # the same reply, gone on
    finally:
        chat.close()


def test_undo_reads_nothing_again_but_after_system_the_conversation_is_read_again(repl):
    """As docs/chat.md says: /undo goes back without reading; /system changes the context's
    beginning, so the reply after it (after an /undo too) reads the conversation again."""
    r, _, _ = repl
    r.safely("hello")
    r.safely("and then")
    first = r.chat.last_stats.prefill_tokens
    r.safely("/undo")
    r.safely("and then")
    assert r.chat.last_stats.cached_tokens > 0 and r.chat.last_stats.prefill_tokens == first
    r.safely("/system be brief")
    r.safely("/undo")
    r.safely("and then")
    stats = r.chat.last_stats
    # (all of it but what comes before the system prompt's text: the template's opening)
    assert stats.cached_tokens < 8 and stats.prefill_tokens == stats.prompt_tokens - stats.cached_tokens > 60


@pytest.mark.parametrize("leave", ["/quit", "/bye", "/exit", "/QUIT"])
def test_quit_and_bye_leave_as_exit_does(repl, leave):
    r, out, err = repl
    r.safely(leave)
    assert r.running is False


def test_show_says_the_model_the_session_and_its_settings(repl):
    r, out, err = repl
    r.safely("hello")
    r.safely("/set temperature 0.5")
    r.safely("/show")
    said = err.getvalue()
    assert "session 'unit' on tiny" in said and "context " in said and " tokens" in said
    assert "temperature" in said and "0.5" in said and r.running


@pytest.mark.model
def test_a_new_session_records_the_model_by_its_name_as_the_first_did(tmp_path):
    from quipu.app.chat import ChatSession
    from quipu.app.environment import Environment
    from quipu.app.turn_options import TurnOptions

    env = Environment.load({"QUIPU_HOME": str(tmp_path / "home")})
    chat = ChatSession.open(env, TurnOptions.of(max_tokens=2, seed=3), name="first")
    try:
        named = chat.model_name
        chat.new_session_with_system()
        assert chat.model_name == named == "SmolLM2-135M-Instruct"  # (not the file's stem)
    finally:
        chat.close()


@pytest.mark.model
def test_a_chat_left_before_anything_was_said_keeps_no_session(home, quipu):
    child = spawn(home)
    child.sendeof()
    child.expect("nothing was said: no session is kept")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert json.loads(quipu("sessions", "list", "--json").stdout) == []


@pytest.mark.parametrize("config, code, words", [
    ("[chat]\nmarkdown = true\n", 0, ""),
    ("markdown = true\n", 2, "'markdown' goes in a table: [chat] then markdown = ... under it"),
    ("[chat]\nmarkdown = \"yes\"\n", 2, "[chat] markdown must be true or false"),
])
def test_the_config_says_whether_the_chat_renders_markdown(home, tiny_model, config, code, words):
    (home / "config").mkdir(exist_ok=True)
    (home / "config" / "config.toml").write_text(config)
    for flags in ((), ("--no-markdown",), ("--markdown",)):
        r = run_chat(home, "-m", tiny_model, "-n", "2", *flags, input=b"hi\n")
        assert r.returncode == code and words in r.stderr.decode(), r.stderr.decode()


def test_run_with_no_prompt_on_a_terminal_opens_a_chat(home, tiny_model):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ.update(QUIPU_HOME=str(home), PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm")
    child = pexpect.spawn(sys.executable, ["-m", "quipu", "run", "-m", str(tiny_model), "-n", "3", "-S", "fromrun"],
                          env=environ, encoding="utf-8", dimensions=(30, 120), timeout=120)
    child.expect("a chat opens")
    child.expect("›")
    child.send("hello\r")
    child.expect(r"\x1b\[\?2004l")  # the prompt has let go of the terminal: the reply follows
    child.expect("›")
    child.sendeof()
    child.expect("saved session 'fromrun'")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    # what a chat does not take is refused as before, in one line
    child = pexpect.spawn(sys.executable, ["-m", "quipu", "run", "-m", str(tiny_model), "--json"], env=environ,
                          encoding="utf-8", dimensions=(30, 120), timeout=120)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 2 and "run opens a chat, which takes no --json" in child.before


def test_a_reply_on_a_terminal_is_marked_and_followed_by_a_gap(tmp_path, tiny_model):
    from quipu.app.chat import ChatSession
    from quipu.app.environment import Environment
    from quipu.app.turn_options import TurnOptions

    env = Environment.load({"QUIPU_HOME": str(tmp_path / "home")})
    out, err = io.StringIO(), io.StringIO()
    chat = ChatSession.open(env, TurnOptions.of(model=str(tiny_model), max_tokens=4, seed=3), name="gap")
    try:
        Repl(chat, Terminal(io.StringIO(), out, err, False, True, False, False), env).safely("hello")
        piped = io.StringIO()
        Repl(chat, Terminal(io.StringIO(), piped, err, False, False, False, False), env).safely("again")
    finally:
        chat.close()
    assert out.getvalue().endswith("\n\n") and not out.getvalue().endswith("\n\n\n")
    assert piped.getvalue().endswith("\n") and not piped.getvalue().endswith("\n\n")  # (a pipe: one reply a line)
    coloured = io.StringIO()  # (on a colour terminal the reply opens with its green mark; a pipe gets the words alone)
    chat = ChatSession.open(env, TurnOptions.of(model=str(tiny_model), max_tokens=4, seed=3), name="gap")
    try:
        Repl(chat, Terminal(io.StringIO(), coloured, err, False, True, True, True), env).safely("once more")
    finally:
        chat.close()
    assert coloured.getvalue().startswith("\x1b[1;32m● \x1b[22;39m") and "●" not in out.getvalue() + piped.getvalue()
    # a reply continued opens with its mark and one space, not two; rendered as Markdown, it has its mark too
    continued, rendered = io.StringIO(), io.StringIO()
    chat = ChatSession.open(env, TurnOptions.of(model=str(tiny_model), max_tokens=4, seed=3), name="gap")
    try:
        Repl(chat, Terminal(io.StringIO(), continued, err, False, True, True, True), env).safely("/continue")
        markdown = Repl(chat, Terminal(io.StringIO(), rendered, err, False, True, True, True), env)
        markdown.markdown = True
        markdown.safely("and more")
    finally:
        chat.close()
    assert continued.getvalue().startswith("\x1b[1;32m● \x1b[22;39m")
    assert not continued.getvalue().startswith("\x1b[1;32m● \x1b[22;39m ")
    assert "●" in rendered.getvalue()


def test_the_recap_of_a_resumed_chat_breaks_lines_between_words(repl, monkeypatch):
    import os
    import shutil

    r, out, err = repl
    words = "river lake mountain valley meadow forest " * 4
    r.safely(words.strip())
    monkeypatch.setattr(shutil, "get_terminal_size", lambda fallback=(80, 24): os.terminal_size((40, 24)))
    err.truncate(0)
    err.seek(0)
    r.recap()
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    assert lines and all(len(line) <= 40 for line in lines), lines
    said = " ".join(line.strip() for line in lines)
    assert "you: " + " ".join(words.split()) in said  # (every word whole)
    assert not any(ch < " " for ch in err.getvalue().replace("\n", ""))  # (the reply's control characters escaped)
