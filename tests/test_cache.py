"""The prompt cache: a run whose prompt begins as an earlier one did restores that beginning;
damage, kills, budgets and concurrency never fail a run or hand llama.cpp a bad state."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from quipu.store.statefile import decode_state

STRESS_RUNS = int(os.environ.get("QUIPU_STRESS", "4"))
SYSTEM = "You are the sky and the world. " + " ".join(f"hello {i} the sky is blue." for i in range(40))
DOC = "\n".join(f"the world is hello number {i} and the sky is blue" for i in range(30))


def entries(home):
    return sorted((home / "cache" / "prompts").glob("*.kv"))


def run(quipu, tiny_model, *args, input=None):
    r = quipu("run", "-m", tiny_model, "--json", "-t", "0", "-n", "8", *args, input=input)
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout), r.stderr.decode()


def test_a_shared_beginning_is_read_once(quipu, tiny_model, home):
    first, _ = run(quipu, tiny_model, "-s", SYSTEM, "hello")
    second, err = run(quipu, tiny_model, "-s", SYSTEM, "the sky")
    fresh, _ = run(quipu, tiny_model, "-s", SYSTEM, "--no-cache", "the sky")
    assert first["usage"]["cached_tokens"] == 0 and err == ""
    assert second["usage"]["cached_tokens"] > 200 and second["timings"]["restore_s"] > 0
    assert fresh["usage"]["cached_tokens"] == 0
    assert second["text"] == fresh["text"]  # restoring changes nothing the model says
    assert len(entries(home)) == 1  # the second prompt added too little to be worth an entry


def test_questions_about_one_piped_document_share_it(quipu, tiny_model):
    from quipu.engine.settings import ContextSettings

    questions = ("hello?", "the sky?", "the world?")
    answers = [run(quipu, tiny_model, question, input=DOC)[0] for question in questions]
    doc_tokens = answers[0]["usage"]["prompt_tokens"] - 20
    assert answers[0]["usage"]["cached_tokens"] == 0
    # All of it that a prefill step holds whole (the rest is read as a run without the cache reads it)
    step = ContextSettings().n_batch
    assert doc_tokens > step
    assert all(a["usage"]["cached_tokens"] >= doc_tokens - step for a in answers[1:])
    fresh = [run(quipu, tiny_model, "--no-cache", question, input=DOC)[0] for question in questions[1:]]
    assert [a["text"] for a in answers[1:]] == [f["text"] for f in fresh]


def test_a_messages_file_that_ends_in_a_reply_is_continued_from_the_cache(quipu, tiny_model, tmp_path):
    # The lookup reads what the continued reply reads: the conversation, then the reply so far.
    path = tmp_path / "m.json"
    path.write_text(json.dumps([{"role": "user", "content": DOC}, {"role": "assistant", "content": "the sky is"}]))
    first, _ = run(quipu, tiny_model, "--messages", path)
    second, _ = run(quipu, tiny_model, "--messages", path)
    fresh, _ = run(quipu, tiny_model, "--messages", path, "--no-cache")
    assert first["usage"]["cached_tokens"] == 0
    assert second["usage"]["cached_tokens"] > second["usage"]["prompt_tokens"] // 2
    assert second["text"] == fresh["text"]


def test_no_cache_neither_reads_nor_writes(quipu, tiny_model, home):
    run(quipu, tiny_model, "-s", SYSTEM, "--no-cache", "hello")
    assert entries(home) == []


def test_a_damaged_entry_is_dropped_and_never_an_error(quipu, tiny_model, home):
    run(quipu, tiny_model, "-s", SYSTEM, "hello")
    [entry] = entries(home)
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0xFF
    entry.write_bytes(bytes(data))
    out, err = run(quipu, tiny_model, "-s", SYSTEM, "the sky")
    assert out["usage"]["cached_tokens"] == 0 and err == ""  # quietly read again
    assert all(decode_state(p.read_bytes()) for p in entries(home))  # and replaced by a good entry
    entry = entries(home)[0]
    entry.write_bytes(entry.read_bytes()[:100])
    out, err = run(quipu, tiny_model, "-s", SYSTEM, "--verbose", "the world")
    assert out["usage"]["cached_tokens"] == 0 and "prompt cache: dropped" in err


def test_the_budget_keeps_the_most_recently_used(quipu, tiny_model, home):
    run(quipu, tiny_model, "-s", SYSTEM, "hello")
    size = entries(home)[0].stat().st_size
    (home / "config").mkdir()
    (home / "config" / "config.toml").write_text(f"[cache]\nmax_bytes = {size + size // 2}\n")
    run(quipu, tiny_model, "-s", "Another system prompt. " + SYSTEM, "hello")
    run(quipu, tiny_model, "-s", "A third one. " + SYSTEM, "hello")
    assert len(entries(home)) == 1
    out, _ = run(quipu, tiny_model, "-s", "A third one. " + SYSTEM, "the sky")
    assert out["usage"]["cached_tokens"] > 200


def test_cache_info_and_clear(quipu, tiny_model, home):
    run(quipu, tiny_model, "-s", SYSTEM, "hello")
    info = json.loads(quipu("cache", "info", "--json").stdout)
    # (the budget: a quarter of the disk's free space, from 2 GiB to 64 GiB, unless the config says)
    free = shutil.disk_usage(home).free
    assert info["entries"] == 1 and info["bytes"] > 0
    assert info["max_bytes"] == max(2 << 30, min(64 << 30, free // 4)) or abs(info["max_bytes"] - free // 4) < 1 << 28
    assert "\n1 entry, " in quipu("cache", "info").stdout.decode()
    cleared = quipu("cache", "clear")
    assert cleared.returncode == 0 and cleared.stderr.decode() == "removed 1 entry\n"
    assert json.loads(quipu("cache", "info", "--json").stdout)["entries"] == 0
    assert quipu("cache", "clear").stderr.decode() == "removed 0 entries\n"


def test_kill_9_while_saving_never_leaves_a_broken_entry(tiny_model, home):
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    env["QUIPU_HOME"] = str(home)
    rng = random.Random(5)
    for i in range(STRESS_RUNS):
        proc = subprocess.Popen([sys.executable, "-m", "quipu", "run", "-m", str(tiny_model), "-n", "4", "-s",
                                 f"{i} {SYSTEM}", "hello"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdout.read()  # the answer is out: the cache is being written now
        time.sleep(rng.uniform(0.0, 0.05))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    killed = entries(home)
    for entry in killed:
        decode_state(entry.read_bytes())  # whole, or not there at all
    out = subprocess.run([sys.executable, "-m", "quipu", "run", "-m", str(tiny_model), "--json", "-n", "2", "-s",
                          f"{STRESS_RUNS} {SYSTEM}", "again"], env=env, capture_output=True)
    assert out.returncode == 0, out.stderr.decode()
    assert not list((home / "cache" / "prompts").glob(".*.tmp-*"))
    assert len(entries(home)) == len(killed) + 1  # (a run that lives writes its entry, beside those)
    for entry in entries(home):
        decode_state(entry.read_bytes())


def test_concurrent_runs_share_the_cache_safely(tiny_model, home):
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    env["QUIPU_HOME"] = str(home)
    procs = [subprocess.Popen([sys.executable, "-m", "quipu", "run", "-m", str(tiny_model), "--json", "-n", "4",
                               "-s", SYSTEM, f"question {i}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in range(4)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e.decode() for _, e in results]
    found = entries(home)
    assert found  # (four runs of one long system prompt: at least one entry of it)
    for entry in found:
        decode_state(entry.read_bytes())


def test_show_prompt_counts_what_the_cache_holds(quipu, tiny_model):
    run(quipu, tiny_model, "-s", SYSTEM, "hello")
    r = quipu("run", "-m", tiny_model, "-s", SYSTEM, "--show-prompt", "--json", "the sky")
    view = json.loads(r.stdout)
    actual, _ = run(quipu, tiny_model, "-s", SYSTEM, "the sky")
    assert view["reused_tokens"] == actual["usage"]["cached_tokens"] > 200
    r = quipu("run", "-m", tiny_model, "-s", SYSTEM, "--show-prompt", "the sky")
    assert f"{view['reused_tokens']} of them in the prompt cache" in r.stderr.decode()
    r = quipu("run", "-m", tiny_model, "-s", SYSTEM, "--show-prompt", "--json", "--no-cache", "the sky")
    assert json.loads(r.stdout)["reused_tokens"] == 0


def test_a_new_session_starts_from_the_cache(quipu, tiny_model):
    run(quipu, tiny_model, "-s", SYSTEM, "hello")
    new, _ = run(quipu, tiny_model, "-s", SYSTEM, "-S", "fresh", "the sky")
    again, _ = run(quipu, tiny_model, "-S", "fresh", "and the world")
    uncached, _ = run(quipu, tiny_model, "-s", SYSTEM, "-S", "other", "--no-cache", "the sky")
    assert new["usage"]["cached_tokens"] > 200 and uncached["usage"]["cached_tokens"] == 0
    assert new["text"] == uncached["text"]
    assert again["usage"]["cached_tokens"] >= new["usage"]["prompt_tokens"]  # the session's own state


def test_a_new_chat_starts_from_the_cache(quipu, tiny_model):
    run(quipu, tiny_model, "-s", SYSTEM, "hello")
    r = quipu("chat", "-m", tiny_model, "-s", SYSTEM, "-S", "talk", "-t", "0", "-n", "8", input="the sky\n/stats\n")
    assert r.returncode == 0, r.stderr.decode()
    solo, _ = run(quipu, tiny_model, "-s", SYSTEM, "--no-cache", "the sky")
    assert solo["text"] in r.stdout.decode()
    assert re.search(r"\b([2-9]\d\d|\d{4,}) reused", r.stdout.decode() + r.stderr.decode())


def test_an_entry_whose_tokens_are_not_token_ids_is_dropped(quipu, tiny_model, home):
    from quipu.store.statefile import encode_state

    run(quipu, tiny_model, "-s", SYSTEM, "hello")
    [entry] = entries(home)
    blob = decode_state(entry.read_bytes())
    entry.write_bytes(encode_state({**blob.meta, "tokens": [str(t) for t in blob.meta["tokens"]]}, blob.state))
    out, err = run(quipu, tiny_model, "-s", SYSTEM, "--verbose", "the sky")
    assert out["usage"]["cached_tokens"] == 0 and "not token ids" in err


@pytest.mark.model
def test_a_cached_beginning_changes_no_word_on_the_bundled_model(quipu, bundled_model):
    """With flash attention on, llama.cpp computes a token in a step of a few tokens by another
    road than in a step of many: restored to anywhere, the last tokens of the beginning would be
    read in a small step where a run without the cache read them in a large one. Restored to
    where a step starts, the answer is the uncached run's, word for word."""
    system = " ".join(f"Fact {i}: the river {i} runs past mill {i * 7} and under bridge {i * 3}." for i in range(30))
    hot = ["-t", "1.0", "--seed", "3", "-n", "48", "-s", system]
    first = json.loads(quipu("run", "-m", bundled_model, "--json", *hot, "Name a river.").stdout)
    for question in ("Name a mill.", "Which bridge is the oldest?"):
        cached = json.loads(quipu("run", "-m", bundled_model, "--json", *hot, question).stdout)
        fresh = json.loads(quipu("run", "-m", bundled_model, "--json", "--no-cache", *hot, question).stdout)
        assert first["usage"]["cached_tokens"] == 0 and cached["usage"]["cached_tokens"] > 0
        assert cached["text"] == fresh["text"]


def test_show_prompt_s_count_follows_the_prompt_on_one_stream(home, tiny_model):
    # `quipu run --show-prompt ... 2>&1 | less`: the prompt, then its count on a line of its own.
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ["QUIPU_HOME"] = str(home)
    for args in (["--raw", "x"], ["-s", SYSTEM, "the sky"]):
        r = subprocess.run([sys.executable, "-m", "quipu", "run", "-m", str(tiny_model), "--show-prompt", *args],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=environ,
                           timeout=300)
        lines = r.stdout.decode().splitlines()
        assert r.returncode == 0 and re.fullmatch(r"\d+ tokens?, 0 of them in the prompt cache", lines[-1]), lines
        assert not any("of them" in line for line in lines[:-1]), lines


def test_a_prompt_that_goes_on_from_a_cached_one_writes_only_what_it_added(quipu, tiny_model, home):
    from quipu.store.statefile import read_meta

    # a conversation that grows a turn at a time (an agent's, sent whole each time): each entry
    # holds the cells its prompt added to the last, and the longest restores through them all
    grown = [DOC * 3 + "\n" + "\n".join(f"turn {k}: the sky is hello {k}" for k in range(turns * 30))
             for turns in range(1, 4)]
    outs = [run(quipu, tiny_model, "--raw", "--ctx", "8192", input=text)[0] for text in grown]
    assert outs[1]["usage"]["cached_tokens"] > 0 and outs[2]["usage"]["cached_tokens"] > outs[1]["usage"]["cached_tokens"]
    metas = {p: read_meta(p) for p in entries(home)}
    [first] = [p for p, m in metas.items() if "parent" not in m]
    later = sorted((p for p, m in metas.items() if "parent" in m), key=lambda p: metas[p]["n_tokens"])
    assert len(later) == 2 and metas[later[0]]["parent"] == first.name and metas[later[1]]["parent"] == later[0].name
    for p in later:  # (what each adds: far less than the whole it restores)
        added = metas[p]["n_tokens"] - metas[p]["start"]
        assert p.stat().st_size < first.stat().st_size * 2 * added / metas[first]["n_tokens"] + 100_000
    again, _ = run(quipu, tiny_model, "--raw", "--ctx", "8192", input=grown[2] + "\nand more")
    fresh, _ = run(quipu, tiny_model, "--raw", "--ctx", "8192", "--no-cache", input=grown[2] + "\nand more")
    assert again["usage"]["cached_tokens"] > outs[2]["usage"]["cached_tokens"] and again["text"] == fresh["text"]
    # an entry whose chain lost a link is dropped, quietly, and the prompt read again
    first.unlink()
    out, err = run(quipu, tiny_model, "--raw", "--ctx", "8192", "--verbose", input=grown[2] + "\nand more")
    assert out["text"] == fresh["text"] and "prompt cache: dropped" in err
