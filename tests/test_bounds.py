"""Inputs that once crashed quipu, filled its memory or ended in a traceback: each now a one-line
error with its exit code. A case that could eat memory runs in a subprocess under a memory limit,
so that a regression fails the test and not the machine."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys

import pytest

from limits import memory_limited

def run_limited(home, *args, stdin=subprocess.DEVNULL, timeout=120):
    """`quipu ARGS` under the memory limit; `stdin` a file, or bytes to pipe in."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ["QUIPU_HOME"] = str(home)
    piped = {"input": stdin} if isinstance(stdin, bytes) else {"stdin": stdin}
    return subprocess.run([sys.executable, "-m", "quipu", *map(str, args)], capture_output=True, env=environ,
                          timeout=timeout, preexec_fn=memory_limited, **piped)


def one_line(r) -> str:
    err = r.stderr.decode()
    assert "Traceback" not in err and r.returncode not in (-signal.SIGSEGV, -signal.SIGKILL, 139), err[-2000:]
    return err


def test_a_chat_fed_endless_zeros_stops_with_one_line(home, tiny_model):
    with open("/dev/zero", "rb") as zeros:
        r = run_limited(home, "chat", "-m", tiny_model, "-S", "zero", stdin=zeros)
    err = one_line(r)
    assert r.returncode == 2 and "standard input is binary data" in err
    assert not (home / "data" / "sessions" / "zero.lock").exists()  # a session never made leaves no lock


def test_a_piped_line_too_long_for_any_context_is_skipped_and_the_chat_goes_on(home, tiny_model):
    data = b"x" * (5 << 20) + b"\nhello\n"
    r = run_limited(home, "chat", "-m", tiny_model, "-n", "2", "-S", "long", stdin=data)
    err = one_line(r)
    assert r.returncode == 0 and "longer than 4 MB; it was skipped" in err
    from quipu.store.store import SessionStore

    messages = SessionStore(home / "data" / "sessions").load_transcript("long").messages
    assert [m["content"] for m in messages if m["role"] == "user"] == ["hello"]


@pytest.mark.parametrize("kind, text, words", [
    ("grammar", "root ::= " + "(" * 100_000 + '"a"' + ")" * 100_000, "nest deeper than 2000 levels"),
    ("schema", "[" * 5000 + "]" * 5000, "nests deeper than 100 levels"),
    ("schema", '{"$ref": "#/nope"}', "$ref at / points to #/nope, which the schema does not have"),
    ("schema", '{"type": "string", "pattern": "(("}', "(pattern at /): regex parse error: unclosed group"),
    ("schema", '{"type": "nosuch"}', "the schema's type at / is 'nosuch'"),
])
def test_grammars_and_schemas_that_crashed_the_parser(home, tiny_model, tmp_path, kind, text, words):
    path = tmp_path / f"input.{kind}"
    path.write_text(text)
    r = run_limited(home, "run", "-m", tiny_model, f"--{kind}", path if kind == "grammar" else f"@{path}", "-n", "2", "hi")
    err = one_line(r)
    assert r.returncode == 2 and words in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("template, words", [
    ('{{ "x" * 10000000000 }}', "makes a value longer than"),
    ("{% for i in range(10**12) %}x{% endfor %}", "a count or size past"),
    # One step of Python's own string code, which no deadline interrupts; some folded while the
    # template compiles, before it renders.
    ('{{ "x" | center(2000000000) }}', "a count or size past"),
    ('{{ "x".ljust(10**9) }}', "a count or size past"),
    ('{{ "%1000000000d" % 1 }}', "formats a field wider than"),
    ('{{ "%*d" % (10**9, 1) }}', "a count or size past"),
    ('{{ "{:>1000000000}".format(1) }}', "formats a field wider than"),
    ('{{ "%1000000000d" | format(1) }}', "formats a field wider than"),
    ('{{ "{:{w}}".format(1, w=10**9) }}', "a count or size past"),
    ('{% set s = "x" * 1000000 %}{{ s | replace("x", s) }}', "makes a value longer than"),
    ('{% set s = "x" * 1000000 %}{{ s.replace("x", s) }}', "makes a value longer than"),
    ('{{ "a" | indent(1000000000) }}', "a count or size past"),
    ("{{ 1/0 }}", "division by zero"),
    ("{{ 2**100000000 }}", "a power too large"),
    ('{% for i in range(100000) %}{% for j in range(100) %}abcdef{% endfor %}{% endfor %}', "output is longer than"),
])
def test_a_template_cannot_fill_the_memory_or_end_in_a_traceback(home, tiny_model, tmp_path, template, words):
    path = tmp_path / "t.jinja"
    path.write_text(template)
    r = run_limited(home, "run", "-m", tiny_model, "--chat-template", path, "-n", "2", "hi")
    err = one_line(r)
    assert r.returncode == 1 and words in err, err


def test_batch_rows_with_numbers_that_are_no_numbers_fail_alone(quipu, tiny_model, tmp_path):
    import json

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "hi", "top_k": NaN}\n{"prompt": "yo", "temperature": 1e400}\n{"prompt": "ok"}\n')
    r = quipu("run", "-m", tiny_model, "--batch", rows, "-n", "2")
    out = [json.loads(line) for line in r.stdout.decode().splitlines()]
    assert r.returncode == 0 and "Traceback" not in r.stderr.decode()
    assert "top_k must be an integer" in out[0]["error"] and "temperature must be a finite number" in out[1]["error"]
    assert "text" in out[2]


def test_a_failed_run_on_a_new_session_leaves_no_lock_file(quipu, tiny_model, home):
    r = quipu("run", "-m", tiny_model, "--ctx", "64", "-S", "never", "x " * 400)
    assert r.returncode == 2
    assert not list((home / "data" / "sessions").glob("never.*"))


def test_an_answer_to_the_full_context_question_is_never_a_message(monkeypatch, tmp_path):
    # What is typed when the chat asks "[d]rop, [n]ew or [c]ancel?" is taken as an answer only if
    # it is one; anything else is asked again, and said not to have been sent.
    import prompt_toolkit

    from quipu.cli.repl import Repl
    from quipu.cli.terminal import Terminal

    answers = iter(["tell me about rivers", "", "d"])
    monkeypatch.setattr(prompt_toolkit, "prompt", lambda question: next(answers))
    err = io.StringIO()
    repl = Repl(None, Terminal(io.StringIO(), io.StringIO(), err, True, True, True, False), None)
    assert repl.ask("[d]rop, [n]ew or [c]ancel? ", default="d") == "d"  # "" takes the default
    assert "what you typed was not sent" in err.getvalue()
    answers = iter(["what?", "c"])
    assert repl.ask("? ", default="d") == "c"


def test_ctrl_backslash_in_a_chat_stops_a_reply_and_the_chat_goes_on(home):
    import pexpect
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ.update(QUIPU_HOME=str(home), PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm")
    child = pexpect.spawn(sys.executable, ["-m", "quipu", "chat", "-S", "quit", "-n", "4000",
                                           "--logit-bias", "0=-inf", "--logit-bias", "2=-inf"],
                          env=environ, encoding="utf-8", dimensions=(30, 120), timeout=120)
    child.expect("›")
    child.send("Write a very long story.\r")
    child.expect(r"\x1b\[\?2004l")
    child.expect(r"[A-Za-z]{4,}")
    child.send("\x1c")  # Ctrl-\
    child.expect(r"\[stopped\]")
    child.expect("›")
    child.send("\x1c")  # at the prompt: nothing
    child.send("/exit\r")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0 and child.signalstatus is None


def test_a_template_loop_that_writes_nothing_is_bounded_too(home, tiny_model, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    r = run_limited(home, "run", "-m", tiny_model, "--chat-template", path, "-n", "2", "hi", timeout=60)
    assert r.returncode == 1 and "loops count more than 1,000,000 numbers" in one_line(r)


def test_llama_cpp_s_own_grammars_still_pass_the_checks(tiny_model):
    # The checks made before llama.cpp's parser (depth, rules used but never defined) refuse none
    # of the grammars llama.cpp ships; those still parse there (llama-server) and in quipu's engine.
    from bench.llamacpp import build_root

    from quipu.engine.constraint import Matcher
    from quipu.engine.grammar import Grammar, check_grammar_depth
    from quipu.engine.model import LlamaModel
    from quipu.engine.native import lc

    files = sorted((build_root() / "llama.cpp" / "grammars").glob("*.gbnf"))
    if not files:
        pytest.skip("llama.cpp's sources are unpacked by `python -m bench.llamacpp llama-server`")
    model = LlamaModel(tiny_model)
    for path in files:
        text = path.read_text()
        check_grammar_depth(text)
        sampler = lc.llama_sampler_init_grammar(model.vocab, text.encode(), b"root")
        assert sampler, path.name
        lc.llama_sampler_free(sampler)
        Matcher(model, Grammar("gbnf", text)).fill()


@pytest.mark.parametrize("gbnf, words", [
    ('item ::= root\nitem ::= ""', "no 'root' rule"),
    ('root ::= item "x"', "rule 'item' is used but never defined (line 1)"),
    ('root   ::=   "a" | b-c\n# a comment naming nosuch\nb-c ::= [a-z] "nosuch"', None),
])
def test_rules_used_but_never_defined_are_refused_before_the_parser(gbnf, words):
    from quipu.engine.grammar import check_grammar_depth
    from quipu.errors import InvalidParameter

    if words is None:
        check_grammar_depth(gbnf)
    else:
        with pytest.raises(InvalidParameter, match=re.escape(words)):
            check_grammar_depth(gbnf)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_told_to_end_mid_reply_a_run_and_a_chat_save_what_came(home, signum):
    from quipu.store.store import SessionStore

    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ["QUIPU_HOME"] = str(home)
    never_ends = ["-n", "3000", "--logit-bias", "0=-inf", "--logit-bias", "2=-inf"]
    store = SessionStore(home / "data" / "sessions")
    for name, command, given in (("run", ["run", "-S", "ends-run", *never_ends, "Tell a long story."], None),
                                 ("chat", ["chat", "-S", "ends-chat", *never_ends], b"Tell a long story.\nMore.\n")):
        proc = subprocess.Popen([sys.executable, "-m", "quipu", *command], env=environ, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.PIPE if given else subprocess.DEVNULL)
        if given:
            proc.stdin.write(given)
            proc.stdin.close()
        assert proc.stdout.read(1)  # the reply streams, with thousands of tokens to go
        proc.send_signal(signum)
        proc.stdout.read()  # to its end: the reply stops at the next token
        err = proc.stderr.read()
        proc.wait(120)
        assert proc.returncode in (0, 130), err.decode()
        assert b"Traceback" not in err
        messages = store.load_transcript(f"ends-{name}").messages
        assert [m["role"] for m in messages] == ["user", "assistant"] and messages[1]["content"], name


def test_a_template_that_takes_forever_is_stopped(home, tiny_model, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text('{% set s = "x" * 1000000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}')
    r = run_limited(home, "run", "-m", tiny_model, "--chat-template", path, "-n", "2", "hi", timeout=120)
    assert r.returncode == 1 and "took longer than 5 s to render" in one_line(r)


@pytest.mark.parametrize("siblings, performance, expected", [
    ({0: "0,4", 1: "1,5", 2: "2,6", 3: "3,7", 4: "0,4", 5: "1,5", 6: "2,6", 7: "3,7"}, None, 4),  # (hyperthreads)
    ({c: str(c) for c in range(8)}, None, 8),
    ({c: str(c) for c in range(8)}, "0-3", 4),  # (a hybrid chip: its performance cores alone)
    ({0: "0-1", 1: "0-1", 2: "2", 3: "3", 4: "4", 5: "5", 6: "6", 7: "7"}, "0-1", 1),
    ({}, None, 8),  # (no topology to read: every CPU)
])
def test_the_default_threads_are_one_a_physical_performance_core(tmp_path, monkeypatch, siblings, performance,
                                                                  expected):
    import os

    from quipu.engine.settings import default_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    for cpu, listed in siblings.items():
        topology = tmp_path / "system" / "cpu" / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(listed + "\n")
    if performance is not None:
        (tmp_path / "cpu_core").mkdir()
        (tmp_path / "cpu_core" / "cpus").write_text(performance + "\n")
    assert default_threads(str(tmp_path)) == expected
