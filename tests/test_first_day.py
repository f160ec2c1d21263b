"""What a newcomer meets on a first day, each as a user meets it: escapes in stop strings, tool
calls shown in a pipe, help that shows what it says, a model without a chat template, an
offline pull, short model names, and the small things."""

from __future__ import annotations

import json

import pytest

from quipu.sessions.stops import read_escapes

POEM = "Write a poem of four short lines about the sea."


@pytest.mark.parametrize("typed, read", [
    (r"\n\n", "\n\n"),
    (r"\t|\r", "\t|\r"),
    (r"\\n", "\\n"),  # a backslash, then an n
    (r"\"quoted\" \'too\'", "\"quoted\" 'too'"),
    (r"\x41\u00e9\u4e2d", "A\u00e9\u4e2d"),
    (r"\q stays", r"\q stays"),  # not an escape: as typed, as llama.cpp keeps it
    ("ends with \\", "ends with \\"),
    (r"\ud800", r"\ud800"),  # half a surrogate pair is no character
    (r"\x4", r"\x4"),
    ("plain", "plain"),
])
def test_escapes_are_read_as_llama_cpp_reads_them(typed, read):
    assert read_escapes(typed) == read


def test_stop_at_a_blank_line_as_the_shell_passes_it(quipu, home):
    full = json.loads(quipu("run", "--json", "-t", "0", "-n", "60", POEM).stdout)["text"]
    first_line = full.split("\n")[0]
    assert "\n" in full and first_line.strip(), full
    cut = json.loads(quipu("run", "--json", "-t", "0", "-n", "60", "--stop", r"\n", POEM).stdout)
    assert cut["finish_reason"] == "stop_sequence" and cut["text"] == first_line
    # a backslash kept as one: the reply does not stop at a newline
    literal = json.loads(quipu("run", "--json", "-t", "0", "-n", "60", "--stop", r"\\n", POEM).stdout)
    assert literal["text"] == full
    # the config's stop strings are read the same way, a text or a list
    config = home / "config" / "config.toml"
    config.parent.mkdir(parents=True)
    for value in (r"'\n'", r"['\n', 'never']"):
        config.write_text(f"[generation]\nstop = {value}\n")
        from_config = json.loads(quipu("run", "--json", "-t", "0", "-n", "60", POEM).stdout)
        assert from_config["text"] == first_line, value
    config.write_text("[generation]\nstop = 3\n")
    r = quipu("run", "-n", "2", "hi")
    err = r.stderr.decode()
    assert r.returncode == 2 and "line 2: [generation] stop must be a string or a list of strings" in err


def test_set_stop_in_a_chat_is_read_and_kept_by_the_session(tmp_path, tiny_model):
    import io

    from quipu.app.chat import ChatSession
    from quipu.app.environment import Environment
    from quipu.app.turn_options import TurnOptions
    from quipu.cli.repl import Repl
    from quipu.cli.terminal import Terminal

    env = Environment.load({"QUIPU_HOME": str(tmp_path / "home")})
    out, err = io.StringIO(), io.StringIO()
    term = Terminal(io.StringIO(), out, err, False, False, False, False)
    opts = TurnOptions.of(model=str(tiny_model), max_tokens=8, seed=3)
    chat = ChatSession.open(env, opts, name="stops")
    try:
        repl = Repl(chat, term, env)
        repl.safely(r"/set stop \n\nUser:")
        assert ("stop", ["\n\nUser:"], "set here") in chat.settings()
        repl.safely("hello")
    finally:
        chat.close()
    again = ChatSession.open(env, opts, name="stops")
    try:
        assert ("stop", ["\n\nUser:"], "session") in again.settings()
        Repl(again, term, env).safely("/set stop off")
        assert ("stop", "none", "set here") in again.settings()
    finally:
        again.close()
    assert "Traceback" not in err.getvalue()


def test_help_shows_every_option_s_text_as_written():
    """No help text is read as markup (`[mcp.NAME]` stays), in any command."""
    import click
    import typer
    from typer.testing import CliRunner

    from quipu.cli import build_app

    app = build_app()
    root = typer.main.get_command(app)
    runner = CliRunner()
    seen = 0

    def visit(command: click.Command, path: list[str]) -> None:
        nonlocal seen
        shown = "".join(runner.invoke(app, [*path, "--help"], terminal_width=100).output.split())  # (wrapped anywhere)
        texts = [command.help or ""] if path else []
        texts += [p.help for p in command.params if getattr(p, "help", None)]  # type: ignore[attr-defined]
        for text in texts:
            assert "".join(text.split()) in shown, (path, text)
            seen += 1
        for name, sub in getattr(command, "commands", {}).items():
            visit(sub, [*path, name])

    visit(root, [])
    assert seen > 100
    assert "[mcp.NAME]" in runner.invoke(app, ["run", "--help"]).output


WEATHER = '''
from typing import Literal


def get_weather(city: Literal["Paris", "Rome"]) -> dict:
    """The weather in a city, today."""
    return {"city": city, "temperature": 21}
'''


def test_tool_calls_show_on_stderr_in_a_pipe_and_quiet_hides_them(quipu, tiny_model, tmp_path):
    from pathlib import Path

    fns = tmp_path / "fns.py"
    fns.write_text(WEATHER)
    template = Path(__file__).parent / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
    args = ("run", "-m", tiny_model, "--chat-template", template, "--functions", fns, "--tool-choice", "get_weather",
            "--yes", "-t", "1.0", "--seed", "3", "-n", "200", "Weather?")
    shown = quipu(*args)
    err = shown.stderr.decode()
    assert shown.returncode == 0, err
    assert '→ get_weather({"city": "' in err and '"temperature": 21' in err and "\x1b[" not in err  # no colour in a pipe
    assert "get_weather" not in shown.stdout.decode()
    quiet = quipu(*args, "--quiet")
    assert quiet.returncode == 0 and "get_weather" not in quiet.stderr.decode()
    assert quiet.stdout == shown.stdout


def test_a_model_without_a_chat_template_is_said_once_and_listed_as_base(quipu, home, tmp_path):
    from tinymodel import write_tiny_gguf

    models = home / "data" / "models"
    models.mkdir(parents=True)
    base = write_tiny_gguf(models / "base.gguf", chat_template=None)
    r = quipu("run", "-m", base, "-n", "2", "hi")
    err = r.stderr.decode()
    assert r.returncode == 0 and err.count("this model has no chat template") == 1, err
    assert "--raw" in err and "--chat-template FILE" in err
    for quiet in (("--raw",), ("--chat-template", tmp_path / "t.jinja")):
        (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m.content }}\n{% endfor %}")
        r = quipu("run", "-m", base, "-n", "2", *quiet, "hi")
        assert r.returncode == 0 and "no chat template" not in r.stderr.decode(), quiet
    chat = quipu("chat", "-m", base, "-n", "2", input="hi\nagain\n")
    assert chat.returncode == 0 and chat.stderr.decode().count("this model has no chat template") == 1, chat.stderr
    listed = {m["name"]: m for m in json.loads(quipu("models", "list", "--json").stdout)}
    assert listed["base"]["base"] is True and any(m["base"] is False for m in listed.values())  # the bundled one
    table = quipu("models", "list").stdout.decode().splitlines()
    assert any(line.startswith("base ") and " base " in line for line in table), table


def test_an_offline_pull_is_one_line_at_its_first_try(quipu, tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on: the Hub is not there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HUB_CACHE": str(tmp_path / "hf"), "HF_TOKEN": ""}
    for args in (("models", "pull", "some/Model-GGUF"), ("run", "-m", "hf:some/Model-GGUF", "hi")):
        r = quipu(*args, env=env)
        err = r.stderr.decode()
        assert r.returncode == 1 and len(err.strip().splitlines()) == 1, err  # no retries, no lines of the client's
        assert f"cannot reach the Hub at http://127.0.0.1:{port}" in err and "Retry" not in err


def test_the_resume_recap_breaks_between_words():
    from quipu.cli.repl import between_words

    long = "word " * 60 + "end"
    cut = between_words(long, 200)
    assert len(cut) <= 202 and cut.endswith("word …") and "wor …" not in cut
    assert between_words("short", 200) == "short"
    assert between_words("x" * 300, 200) == "x" * 199 + " …"  # one word longer than the line


def test_a_resumed_chat_recaps_whole_words(quipu, tiny_model, home):
    import os
    import sys

    import pexpect

    words = " ".join(f"word{i}" for i in range(80))
    assert quipu("run", "-m", tiny_model, "-S", "long", "-n", "2", words).returncode == 0
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ.update(QUIPU_HOME=str(home), PROMPT_TOOLKIT_NO_CPR="1")
    child = pexpect.spawn(sys.executable, ["-m", "quipu", "chat", "-S", "long", "-m", str(tiny_model)], env=environ,
                          encoding="utf-8", dimensions=(30, 400), timeout=60)
    child.expect(r"you: (.*?) …")
    said = child.match.group(1)
    child.expect("›")
    child.sendeof()
    child.expect(pexpect.EOF)
    assert said.split()[-1] in words.split() and len(said) <= 200, said


def test_text_typed_during_a_reply_waits_for_the_next_prompt(home, tiny_model, tmp_path):
    """Typed while a call runs (a function that waits for the test to say go): not drawn into
    the reply, but in the next prompt's line."""
    import os
    import sys
    from pathlib import Path

    import pexpect

    go = tmp_path / "go"
    fns = tmp_path / "fns.py"
    fns.write_text(f'''
import os
import time
from typing import Literal


def wait_here(place: Literal["here"]) -> str:
    """Waits to be told to go on."""
    deadline = time.monotonic() + 60
    while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:
        time.sleep(0.01)
    return "went on"
''')
    template = Path(__file__).parent / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ.update(QUIPU_HOME=str(home), PROMPT_TOOLKIT_NO_CPR="1")
    child = pexpect.spawn(sys.executable, ["-m", "quipu", "chat", "-m", str(tiny_model), "--chat-template", str(template),
                                           "--functions", str(fns), "--tool-choice", "wait_here", "--yes", "-n", "400",
                                           "--seed", "3"], env=environ, encoding="utf-8", dimensions=(30, 200),
                          timeout=60)
    child.expect("›")
    child.send("hello\r")
    child.expect("wait_here\\(")  # the call runs, and waits
    child.send("typed ahead")
    go.write_text("")
    child.expect("went on")
    above = child.before
    child.expect("›")
    above += child.before
    assert "typed ahead" not in above  # not in the reply, nor anywhere above the prompt
    child.expect("typed ahead")  # but in the prompt's line, to be sent or edited
    child.terminate(force=True)  # (leaving a chat is tested elsewhere; here a key could race its redraw)


@pytest.mark.parametrize("command", [[], ["cache"], ["config"]])  # (`quipu sessions` and `quipu models` list them)
def test_a_bare_command_prints_its_help_as_help_does(quipu, command):
    """The first thing a newcomer types: the help, laid out as --help lays it out, and no error."""
    bare, helped = quipu(*command), quipu(*command, "--help")
    assert bare.returncode == 0 and bare.stderr == b"", bare.stderr.decode()
    assert bare.stdout == helped.stdout
    text = bare.stdout.decode()
    assert text.startswith(f"Usage: quipu {' '.join(command)}".rstrip() + " ") and "\nCommands:\n" in text


@pytest.mark.parametrize("args, said", [
    (["run", "-c", "2048", "hi"], "no option -c here: the context size is --ctx, and llm's -c (go on with the last "
                                  "answer) is -F"),
    (["logs", "-c"], "no option -c here: llm's -c (go on with the last answer) is `quipu run -F`"),
    (["run", "-o", "temperature", "0", "hi"], "no option -o here: llm's -o NAME VALUE is an option of its own here: "
                                               "-t 0 for the temperature"),
    (["logs", "--temp", "0"], "No such option: --temp"),  # (logs takes no temperature: no hint names one)
    (["run", "--continue", "more"], "--continue cannot be used with a one-shot run (-S NAME goes on with a session; "
                                    "-F, with the last answer)"),
    (["run", "-p", "hi"], 'no option -p here: the prompt is the argument itself: quipu run "..."'),
    (["run", "--temp", "0", "hi"], "no option --temp here: the temperature is --temperature (-t)"),
    (["chat", "--n-gpu-layers", "9"], "no option --n-gpu-layers here: the layers on the GPU are --gpu-layers (-ngl)"),
    (["run", "gemma3:1b", "hi"], "'gemma3:1b' is a model, and a prompt follows: the model goes with -m "
                                 '(quipu run -m gemma3:1b "...")'),
    (["run", "my.gguf", "hi"], "'my.gguf' is a model, and a prompt follows"),
])
def test_other_tools_habits_are_answered_with_quipus_word(quipu, args, said):
    r = quipu(*args)
    err = r.stderr.decode()
    assert r.returncode == 2 and err.startswith(f"quipu: error: {said}") and len(err.splitlines()) == 1, err


def test_a_schema_given_as_a_file_name_says_to_put_an_at_before_it(quipu, home, tmp_path):
    (tmp_path / "person.json").write_text('{"type": "object"}')
    r = quipu("run", "--schema", tmp_path / "person.json", "hi")
    err = r.stderr.decode().strip()
    assert r.returncode == 2 and err == (f"quipu: error: --schema takes the schema's JSON, or @FILE for a file's: "
                                         f"'{tmp_path / 'person.json'}' is a file, so give --schema "
                                         f"@{tmp_path / 'person.json'}"), err
    assert quipu("run", "--schema", f"@{tmp_path / 'person.json'}", "-n", "4", "hi").returncode == 0


def test_t_8_as_llama_cpp_s_threads_is_said_to_be_a_temperature_here(quipu, tiny_model):
    r = quipu("run", "-m", tiny_model, "-t", "8", "-n", "2", "hi")
    assert r.returncode == 0 and r.stderr.decode().strip() == (
        "quipu: warning: -t 8 is the temperature here, which makes near-random text; the threads are --threads")
    assert quipu("run", "-m", tiny_model, "-t", "0.7", "-n", "2", "hi").stderr == b""


def test_chat_s_help_names_no_option_chat_does_not_have(quipu):
    text = quipu("chat", "--help").stdout.decode()
    assert "--json" not in text and "--seed" in text


def test_the_first_model_s_size_in_the_readme_is_the_one_pull_lists(quipu):
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    said = re.search(r"by a short name \(about ([0-9.]+ [KMG]B)", readme)
    listed = next(line for line in quipu("models", "pull", "--list").stdout.decode().splitlines()
                  if line.startswith("gemma3:1b "))
    shown = re.search(r"about ([0-9.]+) ([KMG]B)", listed)
    assert said and shown and said.group(1) == f"{round(float(shown.group(1)))} {shown.group(2)}", (said, listed)


@pytest.mark.parametrize("command, usage", [
    (["sessions", "show"], "Usage: quipu sessions show [OPTIONS] NAME"),
    (["sessions", "rm"], "Usage: quipu sessions rm [OPTIONS] NAMES..."),
    (["sessions", "rename"], "Usage: quipu sessions rename [OPTIONS] OLD NEW"),
    (["models", "info"], "Usage: quipu models info [OPTIONS] [MODEL]"),
    (["embed"], "Usage: quipu embed [OPTIONS] [TEXTS]..."),
])
def test_usage_lines_name_arguments_as_unix_usage_does(quipu, command, usage):
    assert quipu(*command, "--help").stdout.decode().splitlines()[0] == usage


def test_a_ctx_past_the_training_length_is_said_once(quipu, tiny_model):
    r = quipu("run", "-m", tiny_model, "--ctx", "4096", "-n", "2", "hi")
    assert r.returncode == 0 and r.stderr.decode().strip() == (
        "quipu: warning: --ctx 4096 is past the 2048 tokens this model was trained on; "
        "past them its replies may come apart")
    assert quipu("run", "-m", tiny_model, "--ctx", "2048", "-n", "2", "hi").stderr == b""


def test_no_help_says_a_default_twice():
    import typer.main

    from quipu.cli import build_app

    def commands(group, path):
        yield path, group
        for name, sub in getattr(group, "commands", {}).items():
            yield from commands(sub, path + [name])

    root = typer.main.get_command(build_app())
    for path, command in commands(root, []):
        for param in command.params:
            text = getattr(param, "help", None) or ""
            shows_default = getattr(param, "show_default", None) is not False and param.default not in (None, False)
            assert not ("(default" in text and shows_default and not param.is_flag), (path, param.name, text)


def test_a_first_argument_that_is_no_command_is_run_s_prompt(quipu, tiny_model):
    as_run = quipu("run", "-m", tiny_model, "-t", "0", "-n", "4", "What is a river?")
    bare = quipu("What is a river?", "-m", tiny_model, "-t", "0", "-n", "4")
    assert bare.returncode == 0 and bare.stdout == as_run.stdout and bare.stdout.strip()
    typo = quipu("sesions")
    assert typo.returncode == 2 and "Did you mean 'sessions'?" in typo.stderr.decode()
    helped = quipu("help")
    assert helped.returncode == 0 and helped.stdout.decode().startswith("Usage: quipu ")


def test_the_commands_quipu_knows_by_name_are_those_it_has():
    import typer.main

    from quipu.cli import COMMANDS, build_app

    assert sorted(typer.main.get_command(build_app()).commands) == sorted(COMMANDS)


@pytest.mark.parametrize("args, said", [
    (["run", "-m", "llama3.2", "hi"], "'llama3.2' names no size: llama3.2:1b or llama3.2:3b (-m llama3.2:1b pulls it "
                                      "on first use)"),
    (["models", "pull", "llama3.2"], "'llama3.2' names no size: llama3.2:1b or llama3.2:3b (quipu models pull "
                                     "llama3.2:1b)"),
])
def test_ollama_s_bare_name_is_answered_with_its_sizes(quipu, args, said):
    r = quipu(*args)
    err = r.stderr.decode()
    assert r.returncode == 2 and err == f"quipu: error: {said}\n", err


@pytest.mark.parametrize("group", [[], ["sessions"], ["logs"], ["roles"], ["models"], ["config"], ["cache"]])
def test_each_command_is_listed_in_words_that_are_not_cut(quipu, group):
    r = quipu(*group, "--help", env={"COLUMNS": "80"})
    listed = r.stdout.decode().split("\nCommands:\n", 1)[1].splitlines()
    assert listed and not [line for line in listed if line.rstrip().endswith("...")], listed
    assert all(len(line) <= 80 for line in listed), listed


@pytest.mark.parametrize("steps, slowed", [
    ([0.01] * 20 + [0.2] * 40, True),  # (fast, then ten times slower: a busy machine)
    ([0.02] * 200, False),  # (steady)
    ([0.01] * 20 + [0.02] * 40, False),  # (slower, but not by as much as says something took the cores)
    ([0.01] * 20 + [0.2] * 5, False),  # (too short to say)
])
@pytest.mark.parametrize("threads", [None, 1, 4])
def test_a_reply_that_slows_down_says_what_to_try(steps, slowed, threads):
    # (the pace of a reply's pieces, on a clock the test gives: what is said of it)
    from quipu.cli.stream import Pace

    now = [0.0]
    pace = Pace(clock=lambda: now[0], threads=threads)
    for step in steps:
        now[0] += step
        pace.took()
    said = pace.slowed()
    assert (said is not None) == slowed
    if said is not None and threads is None:  # (quipu chose the threads: nothing to try)
        assert "--threads" not in said and "fewer threads as the load comes" in said
    elif said is not None and threads == 1:
        assert said.endswith("its one thread waits for")
    elif said is not None:
        assert f"its {threads} threads" in said and "--threads 1, 2" in said


@pytest.mark.parametrize("command", ["run", "chat"])
def test_a_long_help_lists_its_options_in_sections_by_kind(quipu, command):
    text = quipu(command, "--help", env={"COLUMNS": "100"}).stdout.decode()
    titles = [line for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    # (what a user types most first: the model, the system prompt, the session, the length, the temperature)
    assert titles[:3] == ["Arguments:", "Most used:", "Options:"] if command == "run" else \
        titles[:2] == ["Most used:", "Options:"]
    most = text.split("Most used:")[1].split("\n\n")[0]
    assert all(flag in most for flag in ("-m, --model", "-s, --system", "-S, --session", "-t, --temperature"))
    assert {"Sampling, context and placement:", "Template, reasoning and structured output:", "Tools:",
            "The log of answers:"} <= set(titles)
    sampling = text.split("Sampling, context and placement:")[1].split("\n\n")[0]
    assert "--top-k" in sampling and "--ctx" in sampling and "--gpu-layers" in sampling


@pytest.mark.parametrize("args", [["--version"], ["sessions", "list"], ["logs", "path"], ["run", "-n", "2", "hi"]])
def test_a_closed_standard_output_is_one_line_not_a_traceback(home, args):
    import os
    import subprocess
    import sys

    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ["QUIPU_HOME"] = str(home)
    r = subprocess.run([sys.executable, "-m", "quipu", *args], stderr=subprocess.PIPE, env=environ, timeout=120,
                       preexec_fn=lambda: os.close(1))  # (as a shell's >&- starts it)
    err = r.stderr.decode()
    assert r.returncode == 2 and err == ("quipu: error: standard output is closed; send it somewhere (> /dev/null "
                                         "drops it)\n"), err


@pytest.mark.parametrize("verb, says", [
    ("list", None), ("ls", None), ("ps", "another tool's command"), ("stop", "another tool's command"),
    ("rm", "quipu models rm NAME"), ("create", "quipu models add FILE"), ("push", "pushes nowhere"),
    ("cp", "quipu sessions fork"), ("keys", "QUIPU_API_KEY"),
])
def test_another_tool_s_verb_is_no_question_for_the_model(quipu, home, tiny_model, verb, says):
    # (Ollama's and llm's verbs: run as quipu's command that does it, or said in one line, never asked)
    r = quipu(verb, env={"QUIPU_MODEL": str(tiny_model)})
    out, err = r.stdout.decode(), r.stderr.decode()
    if says is None:  # (`quipu models list`)
        assert r.returncode == 0 and "name" in out.splitlines()[0] and "tiny" not in err, err
    else:
        assert r.returncode == 2 and err.count("\n") == 1 and says in err and out == "", err


def test_ollama_s_model_then_prompt_is_answered_with_the_command_that_does_it(quipu, home, tiny_model):
    # (`ollama run llama3.2 "hi"`'s habit: a model's name first, the prompt after)
    for model in ("llama3.2", "gemma3:1b", str(tiny_model)):
        r = quipu(model, "hi there")
        err = r.stderr.decode()
        assert r.returncode == 2 and err.count("\n") == 1 and f'quipu run -m {model} "hi there"' in err, err
    # a prompt of words is still a prompt, and a first word that names no model too
    r = quipu("why", "is", "the", "sky", "blue", env={"QUIPU_MODEL": str(tiny_model)})
    assert "quipu run -m" not in r.stderr.decode()


def test_sessions_and_models_alone_list_them_as_logs_does(quipu, home):
    models = quipu("models")
    assert models.returncode == 0 and models.stdout.decode().split()[0] == "name", models.stderr.decode()
    sessions = quipu("sessions")
    assert sessions.returncode == 0 and "no sessions yet" in (sessions.stdout + sessions.stderr).decode()
    assert "Usage" not in (models.stdout + sessions.stdout).decode()


def test_llama_cpp_s_sys_is_the_system_prompt_and_llm_s_chat_continue_is_said(quipu, home, tiny_model):
    shown = quipu("run", "-m", tiny_model, "-sys", "Be brief.", "--show-prompt", "Hi")
    assert shown.returncode == 0 and "system\nBe brief.<|im_end|>" in shown.stdout.decode()
    r = quipu("chat", "--continue")
    assert r.returncode == 2 and "--resume (-r)" in r.stderr.decode() and r.stderr.decode().count("\n") == 1


def test_pull_and_show_are_quipu_s_models_commands(quipu, home, tiny_model):
    shown = quipu("show", tiny_model)
    assert shown.returncode == 0 and "arch" in shown.stdout.decode().lower()
    r = quipu("pull")  # (the same refusal as `quipu models pull` without a model)
    assert r.returncode == 2 and "name a model to pull" in r.stderr.decode()


def test_other_chats_slash_commands_are_known(quipu, home, tiny_model):
    lines = ["/?", "Hi.", "/clear", "/context", "/set parameter temperature 0", "/set system Be brief.", "/set", "/bye"]
    r = quipu("chat", "-m", tiny_model, "-n", "3", input=("\n".join(lines) + "\n").encode())
    err = r.stderr.decode()
    assert r.returncode == 0 and "unknown command" not in err, err
    assert "/help" in err and "the conversation was forgotten" in err and "temperature = 0.0" in err, err
    assert "system prompt set" in err
    import re

    rows = [line for line in err.splitlines() if re.match(r"  [a-z_]+ +\S+ +(default|set here|command line)", line)]
    assert any(re.fullmatch(r"  temperature +0\.0 +set here", row) for row in rows), rows
    assert len({len(row) - len(row[2:].split(" ", 1)[1].lstrip()) for row in rows}) == 1, rows  # (one column)
