"""Every surface that takes input from outside, fuzzed: JSON values as schemas, GBNF grammars
(deep nesting included), chat templates from Jinja's constructs, config files, batch files, tool
files, message files, functions files made from generated signatures, MCP servers that answer with
generated JSON-RPC, a Hub that answers with generated listings (in pages too) and headers, media
headers whose fields are drawn across their range (decoded by llama.cpp where quipu lets them
through), projector files with parts left out and keys of other types, rows of the log of answers another
tool wrote (columns added, values of other shapes) and ids past what SQLite holds, role files
(what `roles add` writes read back value for value; one written by hand, broken, still removed),
integers from every source that reach C (never wrapped), input lines split at `\n` only (and, in
test_remote.py, a server's events). Each surface runs
in a process of its own under a memory limit (tests/fuzz_worker.py): every input ends in a result
or a one-line error of quipu's, never a crash, a traceback or a process that eats the machine.
Seeded, so a failure replays; QUIPU_STRESS=N runs N times as many (167: 10,000 or more a surface)."""

from __future__ import annotations

import pytest

from limits import run_fuzz


@pytest.mark.parametrize("surface, count", [("schema", 60), ("gbnf", 60), ("template", 80), ("config", 80),
                                            ("batch", 80), ("tools", 80), ("messages", 80), ("functions", 12),
                                            ("mcp", 8), ("hub", 60), ("media", 60), ("projector", 6),
                                            ("log", 40), ("roles", 60), ("ints", 80), ("lines", 80)])
def test_no_input_crashes_a_surface(surface, count, tiny_model, tmp_path):
    assert f"ok {surface}" in run_fuzz(surface, count, tiny_model, tmp_path)
