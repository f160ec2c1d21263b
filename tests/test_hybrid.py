"""Hybrid models, whose memory holds a recurrent state that cannot go back a token: tiny random
models of Qwen 3.5's architecture (`qwen35`: Gated DeltaNet layers and M-RoPE attention) and of
LFM2's (short convolutions and attention), each with its family's own chat template. Every turn,
cache hit and rewind works, goes back to a checkpoint of the recurrent state rather than read
again, and goes on as the run that never stopped does."""

from __future__ import annotations

import ctypes
import json
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tinymodel import write_tiny_gemma4, write_tiny_lfm2, write_tiny_qwen35

TEMPLATES = Path(__file__).parent / "templates"
GREEDY = ["-t", "0", "--seed", "3"]
# Long enough that a turn's own markup (a generation prompt of a dozen tokens on the tiny vocabulary)
# is a small part of the prompt.
TURNS = [
    "Tell me of the sky and the world, and of Paris, and of the blue of the sky over the world. " * 4,
    "And is the world blue, as the sky is blue over Paris? Say it again of the world and the sky. " * 3,
    "Then hello to the world and to the sky, and to Paris under the blue sky of the world. " * 3,
]
DOC = " ".join(["The sky is blue and the world is hello; Paris is the sky of the world."] * 30)


@pytest.fixture(scope="module", params=["qwen35", "lfm2"])
def hybrid(request, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hybrid")
    if request.param == "qwen35":  # (its template leaves a past reply's reasoning out of the next prompt)
        return write_tiny_qwen35(folder / "qwen35.gguf", chat_template=(TEMPLATES / "Qwen3.5-4B.jinja").read_text())
    return write_tiny_lfm2(folder / "lfm2.gguf", chat_template=(TEMPLATES / "LFM2.5-Instruct.jinja").read_text())


def _logits(backend) -> bytes:
    from quipu.engine.native import lc

    return ctypes.string_at(lc.llama_get_logits_ith(backend.native.ptr, -1), 4 * backend.n_vocab)


def _session(backend):
    from quipu.sessions.inference import InferenceSession
    from quipu.sessions.params import SamplingParams

    return InferenceSession(backend, SamplingParams(seed=4, temperature=1.0))


def _json(result) -> dict:
    assert result.returncode == 0, result.stderr.decode()[-1500:]
    return json.loads(result.stdout)


def _tokens(home: Path, name: str) -> list[int]:
    return json.loads((home / "data" / "sessions" / f"{name}.json").read_text())["tokens"]


def test_the_tiny_models_are_hybrid_and_their_next_token_depends_on_the_whole_history(make_backend, hybrid):
    backend = make_backend(hybrid, n_ctx=1024)
    assert backend.memory.recurrent and backend.memory.shift_refused() == "a recurrent or hybrid model's memory"
    tail = backend.vocab.tokenize(" and so the sky is blue over the world", add_special=False, parse_special=False)
    nexts = set()
    for head in ("hello Paris", "the world is blue", "a sky of the world", "Paris, hello"):
        backend.memory.truncate(0)
        backend.prefill(backend.vocab.tokenize(head, add_special=False, parse_special=False) + tail, 0)
        logits = _logits(backend)
        nexts.add(max(range(backend.n_vocab), key=lambda t: struct.unpack_from("<f", logits, 4 * t)[0]))
    # (histories that differ only in their first words give different next tokens: an equality
    # below proves something, the whole history counts)
    assert len(nexts) >= 2


def test_a_rewind_goes_back_to_a_checkpoint_and_on_as_a_fresh_read_bit_for_bit(make_backend, hybrid):
    backend = make_backend(hybrid, n_ctx=1024)
    first = backend.vocab.tokenize("hello, the sky is blue over the world and Paris", add_special=False, parse_special=False)
    second = backend.vocab.tokenize(" and the world is hello", add_special=False, parse_special=False)
    other = backend.vocab.tokenize(" so Paris is the sky", add_special=False, parse_special=False)
    mark = len(first)

    rewound = _session(backend)
    rewound.set_context(first + second, marks=[mark])
    for _ in range(6):
        rewound.infer_next_token()
    assert backend.memory.rewinds_to(mark + 3) == mark  # (the recurrent state cannot stop anywhere else)
    rewound.set_context(first + second[:3] + other)  # (parts from the history 3 tokens past the mark)
    assert rewound.stats.cached_tokens == mark and "checkpoint at token" in rewound.went_back

    fresh = _session(make_backend(hybrid, n_ctx=1024))
    fresh.set_context(first)
    fresh.set_context(first + second[:3] + other)
    assert _logits(rewound.backend) == _logits(fresh.backend)
    whole = _session(make_backend(hybrid, n_ctx=1024))
    whole.set_context(first + second[:3] + other)  # (read in one step: the same bits here too)
    assert _logits(whole.backend) == _logits(fresh.backend)
    fresh.draws = rewound.draws  # (the same draws of the seed from here)
    onwards = [rewound.infer_next_token() for _ in range(12)]
    assert onwards == [fresh.infer_next_token() for _ in range(12)]

    # No checkpoint at or before the point: the context is read again from the start, no error.
    rewound.set_context(first[:4])
    assert rewound.stats.cached_tokens == 0 and "read again" in rewound.went_back
    assert rewound.backend.memory.positions() == rewound.n_decoded == 4


def test_a_snapshot_carries_its_checkpoints_and_a_restored_context_rewinds_as_the_one_that_made_it(
        make_backend, hybrid):
    from quipu.sessions.inference import InferenceSession

    backend = make_backend(hybrid, n_ctx=1024)
    prompt = backend.vocab.tokenize("hello, the sky is blue over the world and Paris", add_special=False,
                              parse_special=False)
    made = _session(backend)
    made.set_context(prompt + prompt[:5], marks=[len(prompt), len(prompt) + 5])
    for _ in range(4):
        made.infer_next_token()
    snap = made.snapshot()
    restored = InferenceSession.from_snapshot(make_backend(hybrid, n_ctx=1024), snap)
    # (the one where the prompt ends serves this process's rewinds alone: a snapshot carries the other)
    assert [c.n for c in backend.memory.checkpoints] == [len(prompt), len(prompt) + 5]
    assert [c.n for c in restored.backend.memory.checkpoints] == [len(prompt)]
    for session in (made, restored):
        session.set_context(prompt + prompt[:2])
        assert session.stats.cached_tokens == len(prompt)
    assert _logits(made.backend) == _logits(restored.backend)


def test_the_checkpoints_held_in_memory_keep_within_the_memory_the_machine_has_free(make_backend, hybrid, monkeypatch):
    # Six marks on one prompt: a context keeps a checkpoint at each (up to eight) where memory is
    # plentiful, and two, the last ones, where a quarter of what is free holds fewer.
    import quipu.engine.llama_memory as memory
    from quipu.engine.native import lc

    prompt = _backend_tokens(make_backend(hybrid, n_ctx=1024), "the sky is blue over the world and Paris " * 6)
    marks = list(range(8, len(prompt), 8))[:6]
    roomy = make_backend(hybrid, n_ctx=1024)
    _session(roomy).set_context(prompt, marks=marks)
    assert [c.n for c in roomy.memory.checkpoints] == marks
    state = len(roomy.native.seq_state(0, lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY))
    monkeypatch.setattr(memory, "host_available", lambda: 4 * state)  # (a quarter of it: one state)
    tight = make_backend(hybrid, n_ctx=1024)
    _session(tight).set_context(prompt, marks=marks)
    assert [c.n for c in tight.memory.checkpoints] == marks[-2:]


def _backend_tokens(backend, text: str) -> list[int]:
    return backend.vocab.tokenize(text, add_special=False, parse_special=False)


def test_three_turns_of_a_session_each_restore_what_they_share_and_go_on_as_one_process(quipu, hybrid, home):
    prompts, said = [], []
    for i, text in enumerate(TURNS):
        r = quipu("run", "-m", hybrid, "-S", "split", "-n", "10", *GREEDY, "--json", "--verbose", text)
        data = _json(r)
        said.append(r.stderr.decode())
        if i:  # (what the last prompt shares with this one is restored, not read again)
            assert data["usage"]["cached_tokens"] >= 0.9 * prompts[-1], (data["usage"], prompts)
        prompts.append(data["usage"]["prompt_tokens"])
    # The later turns wrote what they added (their cells, the recurrent state where the next turn
    # goes back to) as pieces of the state log, not the whole state again.
    assert (home / "data" / "sessions" / "split.kvlog").exists()
    assert not any("saved whole" in s for s in said[1:]), [line for s in said for line in s.splitlines() if "whole" in line]
    one = quipu("chat", "-m", hybrid, "-S", "whole", "-n", "10", *GREEDY, input="\n".join(TURNS) + "\n")
    assert one.returncode == 0, one.stderr.decode()[-800:]
    assert _tokens(home, "split") == _tokens(home, "whole")


def test_a_recurrent_model_s_session_keeps_its_state_apart_and_goes_on_as_one_process(quipu, home, tmp_path):
    # Mamba: a recurrent state and no attention cells at all. Its snapshot is the cells' (none),
    # its state in the two files beside it; three turns, a process each, give one chat's tokens.
    from tinymodel import write_tiny_mamba

    model = write_tiny_mamba(tmp_path / "mamba.gguf", chat_template=(TEMPLATES / "LFM2.5-Instruct.jinja").read_text())
    for i, text in enumerate(TURNS):
        data = _json(quipu("run", "-m", model, "-S", "split", "-n", "10", *GREEDY, "--json", text))
        assert (data["usage"]["cached_tokens"] > 0) == (i > 0)
    sessions = home / "data" / "sessions"
    assert sorted(p.name for p in sessions.glob("split.kv*")) == ["split.kv", "split.kvr0", "split.kvr1"]
    assert (sessions / "split.kv").stat().st_size < (sessions / "split.kvr0").stat().st_size // 4
    one = quipu("chat", "-m", model, "-S", "whole", "-n", "10", *GREEDY, input="\n".join(TURNS) + "\n")
    assert one.returncode == 0, one.stderr.decode()[-800:]
    assert _tokens(home, "split") == _tokens(home, "whole")


def test_a_turn_restored_equals_the_same_turn_read_again_from_the_transcript(quipu, hybrid, home):
    for text in TURNS[:2]:
        _json(quipu("run", "-m", hybrid, "-S", "kept", "-n", "10", *GREEDY, "--json", text))
    assert quipu("sessions", "fork", "kept", "reread").returncode == 0
    sessions = home / "data" / "sessions"
    for state in sessions.glob("reread.kv*"):
        state.unlink()  # (no snapshot: the context is read again from the transcript)
    kept = _json(quipu("run", "-m", hybrid, "-S", "kept", "-n", "10", *GREEDY, "--json", TURNS[2]))
    reread = quipu("run", "-m", hybrid, "-S", "reread", "-n", "10", *GREEDY, "--json", TURNS[2])
    assert kept["usage"]["cached_tokens"] > 0 and _json(reread)["usage"]["cached_tokens"] == 0
    assert _tokens(home, "kept") == _tokens(home, "reread")


def test_questions_about_a_piped_document_restore_it_and_answer_as_an_uncached_run(quipu, hybrid, tmp_path):
    questions = ["Which is blue?", "And the world?", "Where is Paris?"]
    for i, question in enumerate(questions):
        cached = _json(quipu("run", "-m", hybrid, "-n", "8", *GREEDY, "--json", question, input=DOC))
        fresh = _json(quipu("run", "-m", hybrid, "-n", "8", *GREEDY, "--json", "--no-cache", question, input=DOC))
        if i == 0:
            assert cached["usage"]["cached_tokens"] == 0
        else:  # (the document, up to where the question begins: all but the question and the markup after it)
            assert cached["usage"]["cached_tokens"] >= cached["usage"]["prompt_tokens"] - 30 > 600, cached["usage"]
        assert fresh["usage"]["cached_tokens"] == 0
        assert (cached["text"], cached.get("reasoning")) == (fresh["text"], fresh.get("reasoning"))


def test_a_prompt_cache_entry_carries_two_checkpoints_and_its_budget_counts_them(quipu, hybrid, home):
    # A system prompt, a piped document and a question: three places a later prompt may part
    # (the system prompt's end, the document's, the question's), of which an entry keeps the
    # last two; its file, which the cache's budget counts, is its state and those two.
    from quipu.engine.checkpoints import unpack
    from quipu.store.statefile import read_state

    system = "You answer of the sky and the world. " * 6
    asked = _json(quipu("run", "-m", hybrid, "-n", "8", *GREEDY, "--json", "--system", system, "Which is blue?",
                        input=DOC))
    [entry] = (home / "cache" / "prompts").glob("*.kv")
    blob = read_state(entry)
    held, state = unpack(blob.state)
    assert len(held) == 2 and all(c.n < asked["usage"]["prompt_tokens"] for c in held)
    assert blob.meta["stops"] == [c.n for c in held] + [blob.meta["n_tokens"]]
    info = json.loads(quipu("cache", "info", "--json").stdout)
    assert info["bytes"] == entry.stat().st_size > len(state) + sum(len(c.state) for c in held)
    # Another question on the document restores it (to where the question begins).
    other = _json(quipu("run", "-m", hybrid, "-n", "8", *GREEDY, "--json", "--system", system, "And the world?",
                        input=DOC))
    assert other["usage"]["cached_tokens"] >= other["usage"]["prompt_tokens"] - 30


def test_undo_retry_and_a_cut_reply_continued_stay_exact(quipu, hybrid, home):
    # /undo: as if the undone exchange never was. /retry (greedy): the same reply again.
    said = quipu("chat", "-m", hybrid, "-S", "undone", "-n", "10", *GREEDY,
                 input="\n".join([TURNS[0], TURNS[1], "/undo", TURNS[2], "/retry"]) + "\n")
    assert said.returncode == 0 and "error" not in said.stderr.decode(), said.stderr.decode()[-800:]
    never = quipu("chat", "-m", hybrid, "-S", "never", "-n", "10", *GREEDY, input="\n".join([TURNS[0], TURNS[2]]) + "\n")
    assert never.returncode == 0
    assert _tokens(home, "undone") == _tokens(home, "never")

    # A reply cut short (perhaps inside a character) and continued: the reply one run gives.
    _json(quipu("run", "-m", hybrid, "-S", "cut", "-n", "5", *GREEDY, "--json", TURNS[0]))
    more = _json(quipu("run", "-m", hybrid, "-S", "cut", "--continue", "-n", "9", *GREEDY, "--json"))
    whole = _json(quipu("run", "-m", hybrid, "-S", "uncut", "-n", "14", *GREEDY, "--json", TURNS[0]))
    assert more["usage"]["cached_tokens"] > 0
    assert _tokens(home, "cut") == _tokens(home, "uncut"), (more, whole)


def test_show_prompt_counts_only_what_a_checkpoint_gives_back(quipu, hybrid, home):
    _json(quipu("run", "-m", hybrid, "-S", "shown", "-n", "10", *GREEDY, "--json", TURNS[0]))
    view = _json(quipu("run", "-m", hybrid, "-S", "shown", "--show-prompt", "--json", TURNS[1]))
    turn = _json(quipu("run", "-m", hybrid, "-S", "shown", "-n", "10", *GREEDY, "--json", TURNS[1]))
    # (a reply's last token is held but not yet read, and counts as held: the view may say one more)
    assert view["reused_tokens"] - turn["usage"]["cached_tokens"] in (0, 1) and turn["usage"]["cached_tokens"] > 0


def test_a_batch_s_rows_answer_as_lone_runs_when_a_sequence_answers_several(quipu, hybrid, tmp_path):
    rows = tmp_path / "rows.txt"
    lines = [f"the sky is blue and the world is hello, tell me of Paris {i}" for i in range(5)]
    rows.write_text("\n".join(lines) + "\n")
    r = quipu("run", "-m", hybrid, "--batch", rows, "--parallel", "2", "-n", "6", "-t", "0.8", "--seed", "2")
    assert r.returncode == 0, r.stderr.decode()[-800:]
    answers = [json.loads(line) for line in r.stdout.decode().splitlines()]
    assert answers[0]["usage"]["cached_tokens"] > 0  # (the rows' shared beginning, read once)
    for line, answer in zip(lines, sorted(answers, key=lambda a: a["index"]), strict=True):
        lone = _json(quipu("run", "-m", hybrid, "-n", "6", "-t", "0.8", "--seed", "2", "--no-cache", "--json", line))
        assert (answer["text"], answer.get("reasoning")) == (lone["text"], lone.get("reasoning"))


def _slots(home: Path, name: str) -> list[tuple[int, Path]]:
    """A session's recurrent state files, (the tokens each holds the state after, its path), oldest first."""
    from quipu.store.statefile import read_meta

    found = [(read_meta(p)["n"], p) for p in (home / "data" / "sessions").glob(f"{name}.kvr*")]
    return sorted(found)


def test_a_damaged_recurrent_state_is_never_handed_to_llama_cpp_and_costs_a_read(quipu, hybrid, home):
    for text in TURNS[:2]:
        _json(quipu("run", "-m", hybrid, "-S", "hurt", "-n", "10", *GREEDY, "--json", text))
    assert quipu("sessions", "fork", "hurt", "whole").returncode == 0
    (_, before), (_, last) = _slots(home, "hurt")
    data = bytearray(last.read_bytes())
    data[len(data) // 2] ^= 0xFF  # (inside the state: the checksum refuses the file before llama.cpp sees it)
    last.write_bytes(bytes(data))
    hurt = quipu("run", "-m", hybrid, "-S", "hurt", "-n", "10", *GREEDY, "--json", "--verbose", TURNS[2])
    whole = _json(quipu("run", "-m", hybrid, "-S", "whole", "-n", "10", *GREEDY, "--json", TURNS[2]))
    # The state before it (where the last turn's prompt began) is set instead, and the last turn
    # read again with the new one: what the session says is the undamaged one's.
    assert 0 < _json(hurt)["usage"]["cached_tokens"] < whole["usage"]["cached_tokens"]
    assert _tokens(home, "hurt") == _tokens(home, "whole")
    # Both damaged (cut short): the whole context is read again from the transcript, and it says so.
    for path in (before, last):
        path.write_bytes(path.read_bytes()[:-40])
    again = quipu("run", "-m", hybrid, "-S", "hurt", "-n", "10", *GREEDY, "--json", TURNS[0])
    assert _json(again)["usage"]["cached_tokens"] == 0 and "re-reading" in again.stderr.decode()
    # Gone (removed by hand): the same, and said so.
    for _, path in _slots(home, "hurt"):
        path.unlink()
    gone = quipu("run", "-m", hybrid, "-S", "hurt", "-n", "10", *GREEDY, "--json", TURNS[1])
    assert _json(gone)["usage"]["cached_tokens"] == 0
    assert "its recurrent state was not saved; re-reading its context" in gone.stderr.decode()


def test_a_recurrent_state_that_lies_about_where_it_ends_is_not_trusted(quipu, hybrid, home):
    # A recurrent state file with a valid checksum that says it ends elsewhere than its state
    # does (its tokens' digest made to match): set, the state does not end there, and the
    # context is read again rather than trusted (llama.cpp itself would take it).
    from quipu.store.chain import tokens_digest
    from quipu.store.statefile import encode_state, read_state

    _json(quipu("run", "-m", hybrid, "-S", "lied", "-n", "10", *GREEDY, "--json", TURNS[0]))
    assert quipu("sessions", "fork", "lied", "honest").returncode == 0
    tokens = _tokens(home, "lied")
    for shift in (-3, 3):
        [(n, path)] = _slots(home, "lied")
        blob = read_state(path)
        meta = {**blob.meta, "n": n + shift, "at": blob.meta["at"] + shift,
                "tokens_sha256": tokens_digest(tokens[:n + shift])}
        path.write_bytes(encode_state(meta, blob.state))
        lied = quipu("run", "-m", hybrid, "-S", "lied", "-n", "10", *GREEDY, "--json", "--show-prompt", TURNS[1])
        assert _json(lied)["reused_tokens"] == 0, shift
        path.write_bytes(encode_state(blob.meta, blob.state))
    path.write_bytes(encode_state({**blob.meta, "n": n - 3, "at": blob.meta["at"] - 3,
                                   "tokens_sha256": tokens_digest(tokens[:n - 3])}, blob.state))
    honest = quipu("run", "-m", hybrid, "-S", "honest", "-n", "10", *GREEDY, "--json", TURNS[1])
    lied = quipu("run", "-m", hybrid, "-S", "lied", "-n", "10", *GREEDY, "--json", TURNS[1])
    assert _json(lied)["usage"]["cached_tokens"] == 0 and _json(honest)["usage"]["cached_tokens"] > 0
    assert "re-reading" in lied.stderr.decode()
    assert _tokens(home, "lied") == _tokens(home, "honest")


def test_a_long_session_keeps_two_recurrent_states_and_a_turn_writes_one(quipu, hybrid, home, make_backend):
    # 14 turns, a process each: the files hold the cells once and two recurrent states (where the
    # last save ended, where the last prompt began); a turn writes one state beside its cells
    # (what the recurrent state files and the cells' files grew by, a file written again whole
    # counted whole).
    from quipu.engine.native import lc

    sessions = home / "data" / "sessions"

    def files() -> dict[str, tuple[int, int, int]]:
        return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_size) for p in sessions.glob("long.kv*")}

    written = {"cells": 0, "states": 0}
    turns = 14
    for turn in range(turns):
        before = files() if sessions.exists() else {}
        _json(quipu("run", "-m", hybrid, "-S", "long", "-n", "6", *GREEDY, "--json", f"Is the sky blue, {turn}?"))
        for file, (ino, mtime, size) in files().items():
            old = before.get(file)
            grew = size if old is None or old[0] != ino else size - old[2] if mtime != old[1] else 0
            written["states" if ".kvr" in file else "cells"] += grew
    backend = make_backend(hybrid, n_ctx=4096)
    held = _tokens(home, "long")
    backend.prefill(held, 0)
    state = len(backend.native.seq_state(0, lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY))
    cells = len(backend.memory.state_since(0))
    assert sorted(p.name for p in sessions.glob("long.kv*")) == ["long.kv", "long.kvlog", "long.kvr0", "long.kvr1"]
    assert written["states"] <= turns * (state + 1024)  # (one a turn, and its file's head)
    # The cells, each written with its turn, and again where the file is put together whole.
    assert written["cells"] <= 3 * cells, (written, cells)
    on_disk = sum(p.stat().st_size for p in sessions.glob("long.kv*"))
    assert on_disk <= 2 * cells + 2 * (state + 1024), (on_disk, cells, state)
    listed = json.loads(quipu("sessions", "list", "--json").stdout)
    [row] = [s for s in listed if s["name"] == "long"]
    assert row["size_bytes"] >= on_disk
    # `doctor -m` says what the two take (the state's blocks, without llama.cpp's few bytes of header).
    said = json.loads(quipu("doctor", "-m", hybrid, "--json").stdout)["model"]["recurrent_state"]
    assert said["saved"] == 2 and 2 * (state - 512) < said["saved_bytes"] <= 2 * state


def test_undo_and_retry_of_the_last_turn_after_a_resume_go_back_to_a_kept_state(hybrid, tmp_path):
    # The last turn undone, or its reply made again, in a new process: the context goes back to a
    # state the files kept (where the last prompt began; where its reply began, or the end the
    # next turn goes back to), reading again no more than the chat that never stopped, and it
    # says what that chat says.
    from quipu.app.chat import ChatSession
    from quipu.app.environment import Environment
    from quipu.app.turn_options import TurnOptions

    def chat(home: str):
        env = Environment.load({"QUIPU_HOME": str(tmp_path / home)})
        return ChatSession.open(env, TurnOptions.of(model=str(hybrid), max_tokens=10, seed=3, temperature=0.0),
                                name="c")

    def read(answer) -> int:  # (the prompt's tokens read, not restored)
        return answer.stats.prompt_tokens - answer.stats.cached_tokens

    kept = chat("kept")
    try:
        kept.send(TURNS[0])
        last = kept.send(TURNS[1])
        retried_there = kept.retry()
        assert kept.undo()
        undone_there = kept.send(TURNS[2])
    finally:
        kept.close()
    saved = chat("saved")
    try:
        saved.send(TURNS[0])
        saved.send(TURNS[1])
    finally:
        saved.close()
    shutil.copytree(tmp_path / "saved", tmp_path / "again")
    resumed = chat("saved")
    try:
        retried = resumed.retry()
    finally:
        resumed.close()
    again = chat("again")
    try:
        assert again.undo()
        undone = again.send(TURNS[2])
    finally:
        again.close()
    assert (retried.text, undone.text) == (retried_there.text, undone_there.text) and retried.text == last.text
    assert retried.stats.cached_tokens > 0 and read(retried) <= read(retried_there) + 16, (retried.stats, retried_there.stats)
    assert undone.stats.cached_tokens > 0 and read(undone) <= read(undone_there) + 16, (undone.stats, undone_there.stats)


def test_a_batch_session_s_next_batch_goes_back_to_its_own_shared_beginning(make_backend, hybrid):
    # A sequence that answered a row goes back to the rows' shared beginning's recurrent state:
    # that of this batch, not of one before it on the same context.
    from quipu.sessions.batch import BatchRow, BatchSession
    from quipu.sessions.inference import InferenceSession
    from quipu.sessions.params import SamplingParams

    lone = make_backend(hybrid, n_ctx=1024)
    batch = BatchSession(make_backend(hybrid, n_ctx=512, n_seq=2))
    for opening in ("the sky is blue over the world. ", "Paris, hello: the world and the sky. "):
        rows = [BatchRow(lone.vocab.tokenize(opening * 3 + f"tell me of {word}", add_special=False, parse_special=False),
                         SamplingParams(temperature=0.9, seed=7 + i), 8)
                for i, word in enumerate(["Paris", "the sky", "the world", "hello", "blue"])]
        done: dict = {}
        batch.run(rows, on_done=lambda r, gen, _stats, done=done: done.__setitem__(r, gen))
        assert batch.shared > 0
        for i, row in enumerate(rows):
            alone = InferenceSession(lone, row.params).complete(row.tokens, row.max_tokens)
            assert done[i].tokens == alone.tokens, i


def test_plain_questions_about_a_piped_document_restore_it_too(quipu, hybrid):
    # `--raw`: no template, the blank line before the question is where the document ends.
    for i, question in enumerate(["Which is blue?", "And the world?", "Where is Paris?"]):
        cached = _json(quipu("run", "-m", hybrid, "--raw", "-n", "8", *GREEDY, "--json", question, input=DOC))
        fresh = _json(quipu("run", "-m", hybrid, "--raw", "-n", "8", *GREEDY, "--json", "--no-cache", question,
                            input=DOC))
        if i:
            assert cached["usage"]["cached_tokens"] >= cached["usage"]["prompt_tokens"] - 10 > 600, cached["usage"]
        assert cached["text"] == fresh["text"]


def test_the_fit_counts_a_recurrent_state_in_a_hybrid_s_recurrent_blocks_not_a_cache_a_token(make_backend, hybrid):
    from quipu.engine.native import lc
    from quipu.engine.placement import layer_sizes, read_table, recurrent_blocks

    info = read_table(hybrid)
    small, large = layer_sizes(info, 1024, "f16"), layer_sizes(info, 4096, "f16")
    per_block, blocks = recurrent_blocks(info)
    assert any(blocks) and not all(blocks)
    for a, b, recurrent in zip(small.caches, large.caches, blocks, strict=True):
        if recurrent:  # (the state of the context's two sequences, whatever its length)
            assert a == b == 2 * per_block
        else:
            assert b == 4 * a > 0
    # What llama.cpp keeps of a sequence's recurrent state: those blocks' bytes (and a header).
    backend = make_backend(hybrid, n_ctx=1024)
    backend.prefill(backend.vocab.tokenize("hello the sky is blue", add_special=False, parse_special=False), 0)
    kept = len(backend.native.seq_state(0, lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY))
    assert per_block * sum(blocks) < kept < per_block * sum(blocks) + 512


def test_the_fit_counts_no_cache_for_layers_that_read_another_s(tmp_path):
    from quipu.engine.placement import layer_sizes, read_table

    caches = layer_sizes(read_table(write_tiny_gemma4(tmp_path / "gemma4.gguf", shared_kv_layers=2)), 1024, "f16").caches
    assert all(caches[:-2]) and caches[-2:] == (0, 0)


def _header_only(path: Path, arch: str, values: dict) -> Path:
    """A GGUF file of a model's header alone (what doctor -m and the fit read of it: no tensor)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in values.items():
        name = f"{arch}.{key}"
        if isinstance(value, list):
            writer.add_array(name, value)
        else:
            writer.add_uint32(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch, values, recurrent, attention", [
    # RWKV-7: a state in every block (two token shifts and the wkv state), no attention cache at all
    ("rwkv7", {"block_count": 4, "embedding_length": 64, "wkv.head_size": 16, "token_shift_count": 2,
               "attention.head_count": 0}, [True] * 4, [False] * 4),
    # Falcon-H1: a state and an attention cache in every block
    ("falcon-h1", {"block_count": 3, "embedding_length": 64, "attention.head_count": 4, "attention.head_count_kv": 2,
                   "ssm.conv_kernel": 4, "ssm.inner_size": 128, "ssm.state_size": 16, "ssm.group_count": 1},
     [True] * 3, [True] * 3),
    # Nemotron-H: Mamba blocks keep a state, attention blocks a cache, the feed-forward blocks nothing
    ("nemotron_h", {"block_count": 4, "embedding_length": 64, "attention.head_count": 4,
                    "attention.head_count_kv": [0, 2, 0, 0], "feed_forward_length": [0, 0, 256, 0],
                    "ssm.conv_kernel": 4, "ssm.inner_size": 128, "ssm.state_size": 16, "ssm.group_count": 1},
     [True, False, False, True], [False, True, False, False]),
])
def test_other_recurrent_families_count_their_states_and_caches_where_they_are(tmp_path, arch, values, recurrent,
                                                                              attention):
    from quipu.engine.placement import RECURRENT_SEQS, layer_sizes, read_table, recurrent_blocks

    info = read_table(_header_only(tmp_path / f"{arch}.gguf", arch, values))
    state, blocks = recurrent_blocks(info)
    assert blocks == recurrent
    if arch == "rwkv7":
        assert state == 4 * (2 * 64 + 64 * 16)
    small, large = layer_sizes(info, 1024, "f16").caches, layer_sizes(info, 8192, "f16").caches
    kept = RECURRENT_SEQS * state  # (a state a sequence, whatever the context's length)
    for i, (r, a) in enumerate(zip(recurrent, attention, strict=True)):
        cache = (small[i] - (kept if r else 0), large[i] - (kept if r else 0))  # (the attention cache's share)
        assert cache == ((0, 0) if not a else (cache[0], 8 * cache[0])) and (not a or cache[0] > 0), (i, small, large)


def test_plamo2_decodes_one_sequence_at_a_time_where_more_are_asked_and_says_so(quipu, home, tmp_path):
    """llama.cpp's PLaMo-2 graph misplaces the states of several sequences decoded in one step (two
    answer wrongly, three abort the process): a batch and a server asked for several run one at a
    time, answer as lone runs, and say so in one line."""
    import httpx

    from servers import quipu_serve
    from tinymodel import write_tiny_plamo2

    model = write_tiny_plamo2(tmp_path / "plamo2.gguf")
    rows = ["hello world", "the sky is", "Paris is the", "blue and the"]
    r = quipu("run", "-m", model, "--raw", "-n", "6", "-t", "0", "--batch", "-", "--parallel", "3",
              input="\n".join(rows))
    assert r.returncode == 0, r.stderr[-800:]
    assert [json.loads(line)["index"] for line in r.stdout.splitlines()] == [0, 1, 2, 3]
    said = [line for line in r.stderr.decode().splitlines() if "at a time" in line]
    assert said == ["quipu: warning: llama.cpp decodes one sequence at a time on plamo2 models: "
                    "--parallel 3 runs as 1"]
    lone = [quipu("run", "-m", model, "--raw", "-n", "6", "-t", "0", "--json", row) for row in rows]
    assert [json.loads(line)["text"] for line in r.stdout.splitlines()] == [_json(a)["text"] for a in lone]

    with quipu_serve(home, model, "--parallel", "4", tmp_path=tmp_path) as url:
        def ask(prompt: str) -> httpx.Response:
            return httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0},
                              timeout=120)

        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, rows))
    assert [a.json()["choices"][0]["text"] for a in answers] == [_json(a)["text"] for a in lone]
    log = next(tmp_path.glob("serve-*.log")).read_text()
    assert "--parallel 4 runs as 1" in log


def test_a_served_conversation_of_a_hybrid_goes_on_after_a_restart_from_its_kept_state(home, hybrid, tmp_path):
    # `quipu serve --parallel 2`, the Responses API keeping the conversation (a session of its
    # own, on a context of its own beside the shared one): its second turn restores what the first
    # kept, and after a restart the third goes on from the kept state and says what a server that
    # never stopped says.
    openai = pytest.importorskip("openai")
    from servers import quipu_serve

    def respond(url: str, **asked):
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        return c.responses.create(model="", max_output_tokens=10, temperature=0, **asked)

    with quipu_serve(home, hybrid, "--parallel", "2", tmp_path=tmp_path) as url:
        one = respond(url, input=TURNS[0])
        two = respond(url, input=TURNS[1], previous_response_id=one.id)
    # (the first turn's state restored by the second: both on a context of the conversation's own)
    assert two.usage.input_tokens_details.cached_tokens >= 0.8 * one.usage.total_tokens, two.usage
    with quipu_serve(home, hybrid, "--parallel", "2", tmp_path=tmp_path) as url:
        three = respond(url, input=TURNS[2], previous_response_id=two.id)
    assert three.usage.input_tokens_details.cached_tokens >= 0.8 * two.usage.total_tokens, three.usage
    with quipu_serve(tmp_path / "through", hybrid, "--parallel", "2", tmp_path=tmp_path) as url:  # (no restart)
        said = [respond(url, input=TURNS[0])]
        for turn in TURNS[1:]:
            said.append(respond(url, input=turn, previous_response_id=said[-1].id))
    assert [r.output_text for r in said] == [one.output_text, two.output_text, three.output_text]
