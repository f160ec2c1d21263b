"""Every surface that takes input from outside, fuzzed: JSON values as schemas, GBNF grammars
(deep nesting included), chat templates from Jinja's constructs, config files, batch files (and,
in test_remote.py, a server's events). Each surface runs
in a process of its own under a memory limit (tests/fuzz_worker.py): every input ends in a result
or a one-line error of quipu's, never a crash, a traceback or a process that eats the machine.
Seeded, so a failure replays; QUIPU_STRESS=N runs N times as many (167: 10,000 or more a surface)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

STRESS = int(os.environ.get("QUIPU_STRESS", "1"))
MEMORY_LIMIT = 3 << 30


def limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


@pytest.mark.parametrize("surface, count", [("schema", 60), ("gbnf", 60), ("template", 80), ("config", 80),
                                            ("batch", 80)])
def test_no_input_crashes_a_surface(surface, count, tiny_model, tmp_path):
    worker = Path(__file__).with_name("fuzz_worker.py")
    seed = 20261201
    last = tmp_path / "last-input"
    r = subprocess.run([sys.executable, str(worker), surface, str(seed), str(count * STRESS), str(tiny_model)],
                       capture_output=True, timeout=600 * STRESS, preexec_fn=limited,
                       env={**os.environ, "QUIPU_FUZZ_LAST": str(last)})
    said = (r.stdout + r.stderr).decode("utf-8", "replace")
    tried = last.read_text()[:2000] if last.exists() else ""
    assert r.returncode == 0, f"{surface} (seed {seed}) exited {r.returncode} on:\n{tried}\n{said[-4000:]}"
    assert f"ok {surface}" in said
