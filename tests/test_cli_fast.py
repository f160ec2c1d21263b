"""`quipu run` without Typer: a plain command line is read from the same declarations, to the
same values, and a run imports none of the heavy modules it does not use."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from quipu.cli import build_app, spec
from quipu.cli import run as run_command

# Command lines as people write them, and edge cases of the forms the fast parser accepts.
PLAIN = [
    ["hello"],
    [],
    ["-t", "0", "-n", "16", "Why is the sky blue?"],
    ["--temperature=0.7", "--top-k", "5", "--top-p", ".9", "--min-p", "0", "x"],
    ["x", "--seed", "42", "--repeat-penalty", "1.1e0"],
    ["--stop", "a", "--stop=b", "--stop", "", "x"],
    ["--logit-bias", "15=-inf", "--logit-bias", "7=2", "x"],
    ["--think", "x"], ["--no-think", "x"], ["--think", "--no-think", "x"],
    ["--raw", "--json", "--stats", "--verbose", "--no-cache", "x"],
    ["-S", "work", "--continue"],
    ["-m", "some.gguf", "-s", "be brief", "--ctx", "256", "--threads", "1", "--kv-type", "q8_0", "x"],
    ["--schema", '{"type": "object"}', "--grammar", "g.gbnf", "--chat-template", "t.jinja", "x"],
    ["--show-prompt", "x"],
    ["-n", "1", "-n", "2", "x"],
    ["-"],
    ["--seed", "+7", "x"],
]
# Forms the fast parser leaves to Typer (help, errors, conversions it does not do itself).
FOR_TYPER = [
    ["--help"], ["-h"], ["x", "y"], ["--", "-x"], ["-t", "abc", "x"], ["-t", "inf", "x"], ["-n3", "x"],
    ["--raw=1", "x"], ["--nope", "x"], ["-t", "-1", "x"], ["--seed"], ["-n", "1.5", "x"], ["-s=x", "y"],
]


def typer_reading(argv: list[str], monkeypatch, home) -> dict:
    seen = {}

    def record(env, **given):
        seen.update(given)
        return 0

    monkeypatch.setenv("QUIPU_HOME", str(home))
    monkeypatch.setattr(run_command, "run", record)
    build_app()(args=["run", *argv], prog_name="quipu", standalone_mode=False)
    return seen


@pytest.mark.parametrize("argv", PLAIN, ids=lambda a: " ".join(a) or "(nothing)")
def test_plain_command_lines_read_as_typer_reads_them(argv, monkeypatch, home):
    fast = spec.parse(run_command.PARAMS, argv)
    assert fast is not None
    slow = typer_reading(argv, monkeypatch, home)
    assert {k: list(v) if isinstance(v, tuple) else v for k, v in slow.items()} == fast


@pytest.mark.parametrize("argv", FOR_TYPER, ids=" ".join)
def test_anything_unusual_is_left_to_typer(argv):
    assert spec.parse(run_command.PARAMS, argv) is None


def test_every_parameter_of_run_is_declared_once():
    import inspect

    command = build_app().registered_commands[0].callback
    names = list(inspect.signature(command).parameters)
    assert names == ["context", *run_command.PARAMS]
    assert list(inspect.signature(run_command.run).parameters) == ["env", *run_command.PARAMS]


@pytest.mark.parametrize("argv, code, message", [
    (["-t", "abc", "x"], 2, "--temperature"),
    (["--nope", "x"], 2, "No such option"),
    (["x", "y"], 2, "unexpected extra argument"),
])
def test_typer_still_answers_what_the_fast_path_leaves(quipu, tiny_model, argv, code, message):
    r = quipu("run", "-m", tiny_model, *argv)
    assert r.returncode == code
    assert message.lower() in r.stderr.decode().lower()
    assert b"Traceback" not in r.stderr


HEAVY = ["typer", "pydantic", "rich", "numpy", "llama_cpp.llama", "llama_cpp.llama_chat_format", "prompt_toolkit",
         "httpx"]


def test_a_plain_run_imports_nothing_it_does_not_use(tiny_model, home):
    probe = (
        "import sys, json\n"
        "from quipu.cli import main\n"
        "try:\n"
        f"    main(['run', '-m', {str(tiny_model)!r}, '-t', '0', '-n', '4', '--threads', '1', 'hello'])\n"
        "except SystemExit as exc:\n"
        "    code = exc.code\n"
        f"loaded = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "import llama_cpp\n"  # and the whole package is still there for whoever asks for it
        "sys.stderr.write(json.dumps([code, loaded, llama_cpp.Llama.__name__, llama_cpp.__version__]))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, env={**env, "QUIPU_HOME": str(home)},
                       stdin=subprocess.DEVNULL, timeout=120)
    code, loaded, llama, version = json.loads(r.stderr.decode().splitlines()[-1])
    assert code == 0 and r.stdout
    assert loaded == []
    assert llama == "Llama" and version
