"""Each option is described once (`quipu/options.py`): every place that takes an option reads the
registry, so an option's name, type and bounds are the same wherever it is given."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

import quipu
from quipu.options import OPTIONS, ROLE, ROW, SAMPLING, SETTABLE

pytestmark = pytest.mark.quick  # (the quick set: `python -m pytest -m quick`)

SOURCE = Path(quipu.__file__).parent


def test_a_sampling_parameter_is_named_by_the_registry_the_sampler_settings_and_the_sampler_alone():
    # Adding one touches these three files (and the docs): every other list is derived. (The
    # temperature and the penalty's window are read elsewhere too, for what they mean beyond the
    # chain: llama.cpp's `-t` habit, the window replayed after a rewind.)
    allowed = {"options.py", "engine/base.py", "engine/sampler.py"}
    for name in ("top_p", "min_p", "repeat_penalty"):
        naming = {str(p.relative_to(SOURCE)) for p in SOURCE.rglob("*.py")
                  if re.search(rf"\b{name}\b", p.read_text())}
        assert naming <= allowed, (name, sorted(naming - allowed))


def test_the_registry_s_sampling_parameters_are_the_sampler_s():
    from quipu.engine.base import SamplerSettings
    from quipu.sessions.params import SamplingParams

    numbers = {f.name for f in dataclasses.fields(SamplerSettings) if f.type in ("int", "float")}
    assert set(SAMPLING) == numbers | {"seed"}
    assert SAMPLING["seed"] is int and {f.name for f in dataclasses.fields(SamplingParams)} >= set(SAMPLING)
    # each has bounds, which its default keeps to
    defaults = SamplingParams()
    for name in SAMPLING:
        bounds = OPTIONS[name].bounds
        assert bounds is not None and (name == "seed" or bounds.holds(getattr(defaults, name))), name


@pytest.mark.parametrize("name, bad", [("min_p", 1.5), ("top_p", 0), ("temperature", -1), ("top_k", -2)])
def test_a_value_out_of_bounds_is_refused_in_the_same_words_wherever_it_is_given(quipu, home, tiny_model, name,
                                                                                  bad):
    rule = f"{name.replace('_', '-')} {OPTIONS[name].bounds.rule}"
    flag = OPTIONS[name].flags[0]
    # the command line
    r = quipu("run", "-m", tiny_model, flag, str(bad), "hi")
    assert r.returncode == 2 and rule in r.stderr.decode() and r.stderr.decode().count("\n") == 1
    # a batch's row: that row is an error, the others are answered
    rows = json.dumps({"prompt": "a", name: bad}) + "\n" + json.dumps({"prompt": "b"}) + "\n"
    r = quipu("run", "-m", tiny_model, "-n", "2", "--batch", "-", input=rows)
    out = [json.loads(line) for line in r.stdout.decode().splitlines()]
    assert r.returncode == 0 and rule in out[0]["error"] and "text" in out[1]
    # a role
    r = quipu("roles", "add", "r", "--set", f"{name}={bad}")
    if r.returncode == 0:  # (a role's values are checked when it is used)
        r = quipu("run", "-m", tiny_model, "-R", "r", "hi")
    assert r.returncode == 2 and rule in r.stderr.decode()
    # the config
    (home / "config").mkdir(exist_ok=True)
    (home / "config" / "config.toml").write_text(f"[generation]\n{name} = {bad}\n")
    r = quipu("run", "-m", tiny_model, "hi")
    assert r.returncode == 2 and rule in r.stderr.decode()


def test_every_settable_option_is_set_in_a_chat_and_kept_by_its_session(home, tiny_model):
    from quipu.app.chat import ChatSession
    from quipu.app.environment import Environment
    from quipu.app.turn_options import TurnOptions

    env = Environment.load({"QUIPU_HOME": str(home)})
    values = {"temperature": "0.5", "top_k": "7", "top_p": "0.9", "min_p": "0.1", "repeat_penalty": "1.2",
              "repeat_last_n": "16", "presence_penalty": "0.5", "frequency_penalty": "0.25", "seed": "11",
              "max_tokens": "5", "stop": "END"}
    assert set(values) == set(SETTABLE)  # (a new settable option needs a value here)
    chat = ChatSession.open(env, TurnOptions.of(model=str(tiny_model)), name="set")
    try:
        for key, value in values.items():
            chat.set_option(key, value)
        chat.send("hi")
    finally:
        chat.close()
    chat = ChatSession.open(env, TurnOptions.of(model=str(tiny_model)), name="set")  # resumed
    try:
        shown = {key: value for key, value, _ in chat.settings()}
    finally:
        chat.close()
    assert shown == {**{k: SETTABLE[k](v) for k, v in values.items() if k != "stop"}, "stop": ["END"]}


def test_a_role_and_a_batch_row_take_what_the_registry_says(quipu, tiny_model):
    # every option a role may hold is accepted by `roles add`, by its type; a key that is none is refused
    examples = {str: "x", int: "3", float: "0.5", bool: "true", tuple: "x"}
    for name, kind in ROLE.items():
        r = quipu("roles", "add", f"r-{name}".replace("_", "-"), "--set", f"{name}={examples[kind]}")
        assert r.returncode == 0, (name, r.stderr.decode())
    r = quipu("roles", "add", "nope", "--set", "repeat_last_n=3")  # (the config's and /set's, not a role's)
    assert r.returncode == 2 and "unknown key 'repeat_last_n'" in r.stderr.decode()
    # a batch row's fields are the registry's, and say so when one is not
    r = quipu("run", "-m", tiny_model, "-n", "1", "--batch", "-", input=json.dumps({"prompt": "a", "colour": 1}))
    error = json.loads(r.stdout)["error"]
    assert all(name in error for name in ROW)
