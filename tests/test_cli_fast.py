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

pytestmark = pytest.mark.quick  # (the quick set: `python -m pytest -m quick`)

STRESS = int(os.environ.get("QUIPU_STRESS", "1"))

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


def test_every_parameter_of_run_and_chat_is_declared_once():
    # Each command is built from its table; each parameter is an option of the turn (a field of
    # TurnOptions of the same name, a sampling parameter, or settled into one: --url into the
    # server) or one of the command's own, so an option added to the registry needs nothing else.
    import dataclasses
    import inspect

    from quipu.app.turn_options import TurnOptions
    from quipu.cli import chat as chat_command
    from quipu.options import SAMPLING

    fields = {f.name for f in dataclasses.fields(TurnOptions)} | set(SAMPLING)
    commands = {c.name: c.callback for c in build_app().registered_commands}
    for name, module in (("run", run_command), ("chat", chat_command)):
        assert list(inspect.signature(commands[name]).parameters) == ["context", *module.PARAMS]
        for param in module.PARAMS:
            assert (param in fields or param == "url") != (param in module.OWN), (name, param)
    # --url is settled into the server the turn goes to.
    from quipu.app.environment import Environment
    from quipu.paths import dirs

    env = Environment(dirs({"QUIPU_HOME": "/nonexistent/quipu-home"}), {})
    settled = spec.turn_options({"url": "http://127.0.0.1:9/v1", "model": "m"}, env).server
    assert settled is not None and settled.url.startswith("http://127.0.0.1:9") and settled.model == "m"
    assert spec.turn_options({"model": "m"}, env).server is None


def test_the_options_table_holds_every_option_of_run_and_chat_and_each_is_asked_by_its_own_field():
    # One table says, for every option of the two commands, the feature a mode or a host may
    # refuse: a new option that is not in it fails here, and each entry read from the options
    # is asked by a value of its own field alone (a value set there, nothing else).
    import dataclasses

    from quipu.app.modes import BATCH, CHAT, FROM_MESSAGES, ONE_SHOT, RAW, SESSION, asked_of
    from quipu.app.turn_options import TurnOptions
    from quipu.cli import chat as chat_command
    from quipu.options import OPTIONS, SAMPLING, group
    from quipu.options import FEATURES

    # (and `quipu serve`'s own, the group "serve": its command declares them from the table too)
    served = {name for name, option in group("serve").items() if option.flags}
    import inspect

    from quipu.cli import serve as serve_command

    assert served <= set(inspect.signature(serve_command.serve).parameters)
    # (and `quipu launch`'s own, the group "launch")
    from quipu.cli import launch as launch_command

    launched = {name for name, option in group("launch").items() if option.flags}
    assert launched <= set(inspect.signature(launch_command.launch).parameters)
    spelled = {name for name, option in OPTIONS.items() if option.flags} | {"prompt"}
    assert spelled == set(run_command.PARAMS) | set(chat_command.PARAMS) | served | launched
    features = {o.feature for o in OPTIONS.values()} - {None}
    refused = set().union(*(m.refuses for m in (ONE_SHOT, FROM_MESSAGES, SESSION, CHAT, RAW, BATCH)))
    # each mode refuses options of the table, and each feature is refused by a mode or a host
    assert refused <= features and features <= refused | set(FEATURES)
    fields = {f.name: f for f in dataclasses.fields(TurnOptions)}
    # a value of each field's type (0 is a value, never "not given"; --no-think is given too)
    values = {"tuple": ("x",), "bool | None": False, "bool": True, "int": 0, "float": 0.5, "str": "x"}
    assert TurnOptions().given == frozenset() and asked_of(TurnOptions().given) == {}
    for name, option in OPTIONS.items():
        own = name in run_command.OWN or name in chat_command.OWN or name in group("serve") or name in group("launch")
        field = option.held_as
        # a command's own option is no field of the options (the command names it when given);
        # a sampling parameter is held by name among the sampling parameters given
        assert (field not in fields and name not in SAMPLING) == own, name
        if name in SAMPLING:
            assert TurnOptions.of({name: 1}).given == {name} and asked_of({name}) == {}, name
        if own or option.feature is None:
            continue
        kind = next((t for t in values if str(fields[field].type).startswith(t)), None)
        value = ("x=1",) if field == "logit_bias" else values[kind] if kind is not None else object()
        opts = dataclasses.replace(TurnOptions(), **{field: value})
        assert opts.given == {field} and asked_of(opts.given) == {option.feature: [option.spelled]}, name
    # a command's own options are refused by the table's words too: --stats in a batch
    assert asked_of(TurnOptions().given, own=("stats", "show")) == {"shown": ["--stats"], "show_prompt": ["--show-prompt"]}


def option_words(name: str, option: spec.Opt, draw) -> list[str]:
    """One option as a person may write it, with a plain value of its type."""
    from hypothesis import strategies as st

    on, _, off = draw(st.sampled_from(option.decls)).partition("/")
    if option.type is bool:
        return [draw(st.sampled_from([on, off])) if off else on]
    if option.type is int:
        value = str(draw(st.integers(min_value=0, max_value=10**12)))
    elif option.type is float:
        value = draw(st.sampled_from(["0", "0.5", "1", ".25", "2.5e-1", "1e3", "7."]))
    else:
        value = draw(st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=12)
                     .filter(lambda t: not t.startswith("-")))
    if on.startswith("--") and draw(st.booleans()):
        return [f"{on}={value}"]
    return [on, value]


def test_generated_command_lines_read_alike_both_ways(monkeypatch, home):
    # Any plain command line built from the table: the fast parser reads it, and to what Typer reads.
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    options = [(n, o) for n, o in run_command.PARAMS.items() if isinstance(o, spec.Opt)]

    @st.composite
    def command_lines(draw):
        words = []
        for name, option in draw(st.lists(st.sampled_from(options), max_size=8)):
            words += option_words(name, option, draw)
        if draw(st.booleans()):
            prompt = draw(st.text(min_size=1, max_size=20).filter(lambda t: not t.startswith("-")))
            words.insert(draw(st.integers(0, len(words))) if not words else 0, prompt)
        return words

    @settings(max_examples=150 * STRESS, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(command_lines())
    def check(argv):
        fast = spec.parse(run_command.PARAMS, argv)
        assert fast is not None, argv
        slow = typer_reading(argv, monkeypatch, home)
        assert {k: list(v) if isinstance(v, tuple) else v for k, v in slow.items()} == fast, argv

    check()


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
         "httpx", "huggingface_hub", "tqdm", "quipu.app.roles"]  # (roles: read only for --role)


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


def test_random_command_lines_end_in_an_exit_code_never_a_traceback(tiny_model, tmp_path, home):
    # Any words, options and values, to any command: each ends in 0, 1, 2 or 130 and no traceback,
    # before a model is loaded; in a process of its own under a memory limit (tests/fuzz_worker.py).
    from limits import run_fuzz

    run_fuzz("cli", 150, tiny_model, tmp_path, {"QUIPU_HOME": str(home)})
