"""Private by default: every file and folder quipu writes for a user's conversations, cache and
history is the user's alone (0600 files, 0700 folders) under any umask; an old wide one is narrowed
when quipu next writes it; a wide folder is said; a config that others can read and that holds a
token is warned of; an export goes where the user sends it."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hub_server import start_hub

pytestmark = pytest.mark.quick  # (the quick set: `python -m pytest -m quick`)


def quipu_with_umask(home: Path, umask: int, *args, env=None, input=None):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ.update(QUIPU_HOME=str(home), **(env or {}))
    return subprocess.run([sys.executable, "-m", "quipu", *map(str, args)], env=environ, capture_output=True,
                          input=input, stdin=None if input is not None else subprocess.DEVNULL,
                          preexec_fn=lambda: os.umask(umask), timeout=300)


def modes(home: Path) -> dict[str, int]:
    """Every file and folder under quipu's data, cache and state folders, with its mode."""
    out = {}
    for top in ("data", "cache", "state"):
        root = home / top
        if not root.exists():
            continue
        for path in [root, *root.rglob("*")]:
            if path.is_symlink():
                continue
            out[str(path.relative_to(home))] = stat.S_IMODE(path.stat().st_mode)
    return out


def not_private(home: Path) -> dict[str, str]:
    return {p: oct(m) for p, m in modes(home).items()
            if m != (0o700 if (home / p).is_dir() else 0o600)}


@pytest.mark.parametrize("umask", [0o022, 0o000, 0o277])  # (the last takes even the owner's write away)
def test_everything_quipu_writes_is_the_user_s_alone(tiny_model, tmp_path, home, umask):
    doc = " ".join(["The river runs past the old mill and under the stone bridge."] * 12)
    for args in (["run", "-m", tiny_model, "-S", "s", "-n", "4", doc],       # a session: transcript, state, lock
                 ["run", "-S", "s", "-n", "4", "and again"],                  # its state log
                 ["run", "-m", tiny_model, "-n", "2", doc],                   # the prompt cache
                 ["sessions", "fork", "s", "f"], ["sessions", "rename", "f", "g"],
                 ["models", "add", tiny_model, "--name", "t"]):
        r = quipu_with_umask(home, umask, *args)
        assert r.returncode == 0, (args, r.stderr.decode())
    r = quipu_with_umask(home, umask, "chat", "-S", "c", "-m", tiny_model, "-n", "4", input=b"hello\n")
    assert r.returncode == 0, r.stderr.decode()
    written = modes(home)
    assert any(p.endswith("s.kvlog") for p in written) and any(p.startswith("cache/prompts/") for p in written)
    assert any(p.endswith("g.json") for p in written)
    assert not_private(home) == {}


def test_the_chat_history_is_private(tiny_model, home):
    import pexpect
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ.update(QUIPU_HOME=str(home), PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm")
    child = pexpect.spawn("/bin/sh", ["-c", f"umask 000; exec {sys.executable} -m quipu chat -S h -m {tiny_model} -n 4"],
                          env=environ, encoding="utf-8", dimensions=(30, 120), timeout=120)
    child.expect("›")
    child.send("a secret question\r")
    child.expect("›")
    child.send("/exit\r")
    child.expect(pexpect.EOF)
    history = home / "state" / "chat_history"
    assert "a secret question" in history.read_text()
    assert stat.S_IMODE(history.stat().st_mode) == 0o600
    assert stat.S_IMODE(history.parent.stat().st_mode) == 0o700


def test_a_pull_s_records_are_private(tiny_model, tmp_path, home):
    hub = start_hub({"tiny/Tiny-GGUF": {"tiny-Q4_K_M.gguf": Path(tiny_model).read_bytes(),
                                        "tokenizer_config.json": json.dumps({"chat_template": "{{ messages }}"}).encode()}})
    try:
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": ""}
        r = quipu_with_umask(home, 0o000, "models", "pull", "tiny/Tiny-GGUF", env=env)
        assert r.returncode == 0, r.stderr.decode()
    finally:
        hub.shutdown()
        hub.server_close()
    assert any(p.endswith("pulled.json") for p in modes(home)) and any(p.endswith(".jinja") for p in modes(home))
    assert not_private(home) == {}


def test_old_wide_files_are_narrowed_on_their_next_write_and_a_wide_folder_is_said(tiny_model, home):
    r = quipu_with_umask(home, 0o022, "run", "-m", tiny_model, "-S", "s", "-n", "4", "hi")
    assert r.returncode == 0
    # as an older quipu left them: readable by all
    for path in [home / "data", home / "data" / "sessions", *(home / "data" / "sessions").iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    listed = quipu_with_umask(home, 0o022, "sessions", "list")
    assert "data/sessions can be read by other accounts" in listed.stderr.decode()
    r = quipu_with_umask(home, 0o022, "run", "-S", "s", "-n", "4", "again")
    assert r.returncode == 0
    assert not_private(home) == {}
    assert "can be read" not in quipu_with_umask(home, 0o022, "sessions", "list").stderr.decode()


def test_a_config_that_others_can_read_and_holds_a_token_is_warned_of(tiny_model, home):
    config = home / "config" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text('[mcp.gh]\ncommand = "gh-mcp"\nenv = { GITHUB_TOKEN = "ghp_x" }\n')
    config.chmod(0o644)
    r = quipu_with_umask(home, 0o022, "run", "-m", tiny_model, "-n", "2", "hi")
    assert r.returncode == 0 and "holds a token or key and other accounts can read it" in r.stderr.decode()
    assert stat.S_IMODE(config.stat().st_mode) == 0o644  # the user's file, left as they made it
    config.chmod(0o600)
    assert "holds a token" not in quipu_with_umask(home, 0o022, "run", "-m", tiny_model, "-n", "2", "hi").stderr.decode()


def test_an_export_goes_where_the_user_sends_it(tiny_model, tmp_path, home):
    assert quipu_with_umask(home, 0o022, "run", "-m", tiny_model, "-S", "s", "-n", "4", "hi").returncode == 0
    out = tmp_path / "export.md"
    r = subprocess.run(f"umask 022; {sys.executable} -m quipu sessions export s > {out}", shell=True,
                       env={**os.environ, "QUIPU_HOME": str(home)}, capture_output=True)
    assert r.returncode == 0 and out.read_text()
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
