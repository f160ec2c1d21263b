"""`quipu run --batch`: many prompts side by side, each as a lone run would answer it, in input
order, failing row by row, and never losing a finished row."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from quipu.app.batch import InOrder, RowOutcome, read_rows, row_params
from quipu.errors import QuipuError
from quipu.sessions.batch import BatchRow, BatchSession
from quipu.sessions.inference import InferenceSession
from quipu.sessions.params import SamplingParams

WORDS = "hello world the sky is blue and the sea".split()


def prompt_tokens(backend, i: int) -> list[int]:
    # Rows that share a beginning (read once) and then differ, of different lengths.
    text = "the sky is blue. " * 3 + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(3 + i % 4))
    return backend.vocab.tokenize(text, add_special=True, parse_special=False)


def solo(backend, row: BatchRow):
    session = InferenceSession(backend, row.params)
    return session.complete(row.tokens, row.max_tokens, row.stop)


@pytest.mark.parametrize("n_seq", [2, 3, 8])
def test_each_row_reads_as_a_lone_run_whatever_the_parallelism(make_backend, n_seq):
    lone = make_backend()
    batch_backend = make_backend(n_ctx=256, n_seq=n_seq)
    rows = [BatchRow(prompt_tokens(lone, i), SamplingParams(temperature=0.9, seed=100 + i), 12 + i % 5)
            for i in range(7)]
    done = {}
    streamed = {i: [] for i in range(len(rows))}
    batch = BatchSession(batch_backend)
    batch.run(rows, on_token=lambda r, _t, text: streamed[r].append(text),
              on_done=lambda r, gen, stats: done.__setitem__(r, (gen, stats)))
    assert batch.shared > 0  # the common beginning was read once
    assert sorted(done) == list(range(len(rows)))
    for i, row in enumerate(rows):
        gen, stats = done[i]
        expected = solo(lone, row)
        assert gen.tokens == expected.tokens and gen.text == expected.text
        assert "".join(streamed[i]) == gen.text
        assert stats.completion_tokens == len(gen.tokens) + (gen.finish_reason == "stop")
        assert stats.prompt_tokens == len(row.tokens) and stats.cached_tokens == batch.shared


def test_a_finished_sequence_goes_to_the_next_row(make_backend):
    lone = make_backend()
    batch_backend = make_backend(n_ctx=256, n_seq=2)
    no_end = tuple((t, float("-inf")) for t in range(lone.n_vocab) if lone.vocab.is_eog(t))
    rows = [BatchRow(prompt_tokens(lone, i), SamplingParams(temperature=0, seed=1, logit_bias=no_end),
                     4 + 20 * (i == 0), ("zzz",)) for i in range(5)]
    order = []
    BatchSession(batch_backend).run(rows, on_done=lambda r, gen, stats: order.append((r, gen)))
    # Row 0 is long; rows 1-4 pass through the other sequence meanwhile, each as a lone run.
    assert [r for r, _ in order][-1] == 0
    for r, gen in order:
        assert gen.tokens == solo(lone, rows[r]).tokens and len(gen.tokens) == rows[r].max_tokens


def test_rows_too_long_for_their_share_are_refused(make_backend):
    backend = make_backend(n_ctx=256, n_seq=2)
    batch = BatchSession(backend)
    with pytest.raises(QuipuError):
        batch.run([BatchRow([1] * batch.n_ctx)])


def test_reading_rows():
    plain = read_rows("first question\n\n  \nsecond question\n")
    assert [(r.index, r.prompt) for r in plain] == [(0, "first question"), (1, "second question")]
    rows = read_rows('{"prompt": "a", "id": 7, "seed": 3, "schema": {}}\n'
                     '{"messages": [{"role": "user", "content": "b"}], "stop": ["x"]}\n'
                     'not json\n{"prompt": "c", "colour": 1}\n{"prompt": "d", "messages": []}\n'
                     '{"messages": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]}\n'
                     '{"prompt": "a", "messages": []}\n[1, 2]\n')
    assert rows[0].prompt == "a" and rows[0].id == 7 and rows[0].fields == {"seed": 3, "schema": {}} and rows[0].error is None
    assert rows[1].messages[0].content == "b" and rows[1].fields == {"stop": ["x"]}
    errors = [r.error for r in rows[2:]]
    assert "not a JSON object" in errors[0]
    assert "unknown field 'colour'" in errors[1]
    assert "either prompt or messages" in errors[2]
    assert "last message" in errors[3]
    assert "either prompt or messages" in errors[4]
    assert "not a JSON object" in errors[5]


def test_row_fields_over_the_command_line():
    base = SamplingParams(temperature=0.5, top_k=10)
    params, limit, stop = row_params(base, {"temperature": 0, "seed": 9, "max_tokens": 5, "stop": "."}, None)
    assert (params.temperature, params.top_k, params.seed, limit, stop) == (0.0, 10, 9, 5, (".",))
    params, limit, _ = row_params(base, {}, 42)
    assert params.seed == 42 and limit is None
    assert row_params(base, {}, None)[0].seed is not None  # a seed of its own, reported with the row
    for bad in ({"top_k": "many"}, {"top_k": 1.5}, {"max_tokens": 0}, {"stop": 3}, {"seed": True},
                {"temperature": -1}):
        with pytest.raises(QuipuError):
            row_params(base, bad, None)


def test_outcomes_leave_in_input_order():
    out = []
    writer = InOrder(lambda o: out.append(o.index))
    for i in (2, 0, 3, 1):
        writer.done(RowOutcome(i, None, error="x"))
        if i == 0:
            assert out == [0]
    assert out == [0, 1, 2, 3] and writer.written == 4


def batch(quipu, model, *args, input):
    r = quipu("run", "-m", model, "--batch", "-", *args, input=input)
    lines = [json.loads(line) for line in r.stdout.decode().splitlines()]
    return r, lines


def test_cli_plain_lines_as_lone_runs(quipu, tiny_model):
    questions = ["hello world", "the sky", "is blue", "the sea and the sky"]
    r, lines = batch(quipu, tiny_model, "-n", "8", "--seed", "5", "--parallel", "3", input="\n".join(questions))
    assert r.returncode == 0, r.stderr.decode()
    assert [line["index"] for line in lines] == [0, 1, 2, 3]
    for q, line in zip(questions, lines, strict=False):
        lone = json.loads(quipu("run", "-m", tiny_model, "-n", "8", "--seed", "5", "--json", q).stdout)
        assert line["text"] == lone["text"] and line["seed"] == 5
        assert line["usage"]["completion_tokens"] == lone["usage"]["completion_tokens"]
        assert set(lone) <= set(line)


def test_cli_json_rows_fail_one_by_one(quipu, tiny_model):
    rows = [
        {"id": "a", "prompt": "hello world", "seed": 3, "max_tokens": 4},
        {"id": "b", "prompt": "the sky " * 300},
        {"id": "c", "messages": [{"role": "user", "content": "the sea"}], "temperature": 0},
        {"id": "d", "prompt": "hello", "top_p": 7},
    ]
    text = "\n".join(json.dumps(r) for r in rows) + "\nnot json\n"
    r, lines = batch(quipu, tiny_model, "--ctx", "256", input=text)
    assert r.returncode == 0, r.stderr.decode()
    assert [line.get("id") for line in lines] == ["a", "b", "c", "d", None]
    assert lines[0]["seed"] == 3 and lines[0]["usage"]["completion_tokens"] <= 4
    assert "share of the context is 256" in lines[1]["error"] and "text" not in lines[1]
    lone = json.loads(quipu("run", "-m", tiny_model, "--ctx", "256", "-t", "0", "--json", "the sea").stdout)
    assert lines[2]["text"] == lone["text"]
    assert "must be in (0, 1]" in lines[3]["error"]
    assert lines[4] == {"index": 4, "error": lines[4]["error"]}


def test_cli_rows_keep_their_own_system_prompt(quipu, tiny_model):
    # A row's messages that open with a system prompt, or a row's "system", go before --system;
    # a row with neither takes --system's: each as a lone run with that system prompt answers.
    rows = [
        {"id": "own", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the sea"}]},
        {"id": "field", "prompt": "the sea", "system": "be brief"},
        {"id": "options", "prompt": "the sea"},
    ]
    r, lines = batch(quipu, tiny_model, "-t", "0", "-n", "6", "--system", "talk at length about the sky",
                     input="\n".join(json.dumps(r) for r in rows))
    assert r.returncode == 0, r.stderr.decode()
    for line, system in zip(lines, ["be brief", "be brief", "talk at length about the sky"], strict=True):
        lone = json.loads(quipu("run", "-m", tiny_model, "-t", "0", "-n", "6", "--system", system, "--json",
                                "the sea").stdout)
        assert (line["text"], line["usage"]["prompt_tokens"]) == (lone["text"], lone["usage"]["prompt_tokens"]), line
    assert lines[0]["usage"]["prompt_tokens"] < lines[2]["usage"]["prompt_tokens"]


@pytest.mark.parametrize("args, input, message", [
    (["--batch", "-"], b"\x00\x01binary", "binary"),
    (["--batch", "-", "a prompt"], b"row\n", "give no prompt"),
    (["--parallel", "2", "a prompt"], None, "--parallel goes with --batch"),
    (["--batch", "-", "--parallel", "0"], b"row\n", "--parallel must be more than 0"),
    (["--batch", "-", "--parallel", "1000"], b"row\n", "--parallel must be at most 256"),
    (["--batch", "-", "-S", "work"], b"row\n", "--session cannot be used with --batch"),
    (["--batch", "-", "--show-prompt"], b"row\n", "--show-prompt cannot be used with --batch"),
    (["--batch", "-", "--url", "http://127.0.0.1:9"], b"row\n", "a server (--url, QUIPU_URL or the config's [remote] "
                                                                "url) cannot be used with --batch"),
    (["--batch", "-", "--reasoning-budget", "4", "--messages", "m.json"], b"row\n",
     "--reasoning-budget and --messages cannot be used with --batch"),
    (["--batch", "/nonexistent/rows.jsonl"], None, "cannot read the batch file"),
    (["--batch", "-"], b"\n\n", "no rows"),
    (["--batch", "-", "--tool-choice", "required", "--tools", "/nonexistent.json"], b"row\n",
     "--tools and --tool-choice cannot be used with --batch (each row is answered in one reply"),
    (["--batch", "-", "--functions", "f.py", "--mcp", "m"], b"row\n", "--functions and --mcp cannot be used with"),
    # (what a batch, one JSON line a row, never shows; tools' settings, of tools it has none of:
    # named in the order of the command's help)
    (["--batch", "-", "--stats", "--quiet", "--tools-debug"], b"row\n",
     "--tools-debug, --quiet and --stats cannot be used with --batch"),
    (["--batch", "-", "--yes", "--chain-limit", "3", "--tool-timeout", "5", "--tool-output-max", "9",
      "--mcp-config", "m.json"], b"row\n",
     "--chain-limit, --tool-output-max, --tool-timeout, --mcp-config and --yes cannot be used with --batch"),
])
def test_cli_bad_batches_are_one_line_errors(quipu, tiny_model, args, input, message):
    r = quipu("run", "-m", tiny_model, *args, input=input)
    assert r.returncode == 2
    err = r.stderr.decode()
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_ctrl_c_keeps_every_finished_row(home, bundled_model):
    rows = "".join(f"Write a long story about the number {i}.\n" for i in range(12))
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    proc = subprocess.Popen([sys.executable, "-m", "quipu", "run", "-m", str(bundled_model), "--batch", "-",
                             "--parallel", "2", "-n", "200", "--threads", "2"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**env, "QUIPU_HOME": str(home)})
    proc.stdin.write(rows.encode())
    proc.stdin.close()
    proc.stdin = None
    first = proc.stdout.readline()  # a row is finished and written: now stop
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err.decode()
    lines = [json.loads(line) for line in (first + rest).decode().splitlines()]
    assert 1 <= len(lines) < 12
    assert [line["index"] for line in lines] == list(range(len(lines)))
    assert all(line["text"] and line["finish_reason"] in ("stop", "length") for line in lines)


def _logits(backend, index: int) -> bytes:
    import ctypes

    from quipu.engine.native import lc

    return ctypes.string_at(lc.llama_get_logits_ith(backend.native.ptr, index), 4 * backend.n_vocab)


def _spied(batch: BatchSession, rows) -> dict[tuple[int, ...], bytes]:
    """The logits of every step of the batch's rows, by the history they follow (each sequence's
    tokens so far, its copy of the shared beginning included)."""
    seen: dict[tuple[int, ...], bytes] = {}
    held: dict[int, list[int]] = {}
    step = batch.rows.step

    def spy(waiting):
        asks = step(waiting)
        for a in asks:
            at = a.items[0][1]
            history = held.get(a.seq, list(rows[0].tokens))[:at] + [t for t, _, _ in a.items]
            held[a.seq] = history
            if a.index >= 0:
                seen[tuple(history)] = _logits(batch.backend, a.index)
        return asks

    batch.rows.step = spy
    return seen


@pytest.mark.parametrize("kind", ["plain", "qwen35"])
def test_thirty_two_rows_answer_as_lone_runs_to_the_last_bit_every_time(make_backend, tmp_path, kind):
    # 32 rows of different lengths that share a beginning, half greedy and half drawn with a
    # seed, eight at a time, five times over: each step's logits for a row are its lone run's, bit
    # for bit, whichever rows its steps happened to share, and so is its answer (weights of a type
    # whose product llama.cpp computes one dot product a token whatever the step, as the bundled
    # model's Q4_1: docs/run.md).
    from tinymodel import write_tiny_gguf, write_tiny_qwen35

    model = (write_tiny_gguf(tmp_path / "tiny.gguf", weights="q4_1") if kind == "plain" else
             write_tiny_qwen35(tmp_path / "qwen35.gguf", weights="q4_1"))
    lone = make_backend(model)
    batch = BatchSession(make_backend(model, n_ctx=256, n_seq=8))
    no_end = tuple((t, float("-inf")) for t in range(lone.n_vocab) if lone.vocab.is_eog(t))
    rows = [BatchRow(prompt_tokens(lone, i) + prompt_tokens(lone, i + 3)[: i % 9],
                     SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=40 + i, logit_bias=no_end), 6 + i % 11)
            for i in range(32)]
    want = [solo(lone, row).tokens for row in rows]
    seen = _spied(batch, rows)
    for _ in range(5):
        done: dict = {}
        batch.run(rows, on_done=lambda r, gen, _stats, done=done: done.__setitem__(r, gen.tokens))
        assert batch.shared > 0
        assert [done[i] for i in range(32)] == want
    # Each row read alone, its prompt in one step and its answer a token a step, as a lone run.
    compared = 0
    for row, answer in zip(rows, want, strict=True):
        lone.memory.truncate(0)
        history = list(row.tokens)
        for i, t in enumerate(history):
            lone.native.fill(i, t, i, 0, i == len(history) - 1)
        lone.native.decode(len(history))
        for token in answer[:-1]:
            assert seen[tuple(history)] == _logits(lone, -1)
            compared += 1
            lone.native.fill(0, token, len(history), 0, True)
            lone.native.decode(1)
            history.append(token)
    assert compared == sum(len(a) - 1 for a in want)
