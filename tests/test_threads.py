"""The thread count changes no bit: on the CPU a reply after a long prompt, a session resumed with
other threads, a prompt cache read with other threads, a batch's rows, a server's answer, and a
thread count changed between steps give the logits one thread gives (flash attention off there:
with it, ggml sums a long context's attention in one part per thread)."""

from __future__ import annotations

import ctypes
import hashlib
import json
import random

import pytest

pytestmark = pytest.mark.model

WORDS = "the sky river stone light garden city window music paper winter ocean forest market bridge evening".split()


def _long_prompt(n_words: int = 1450, seed: int = 1) -> str:
    """About 1,450 words: some 1,500 tokens of the bundled model, far past the 512 cells from
    which ggml's flash attention splits a step's sums among the threads."""
    draw = random.Random(seed)
    return " ".join(draw.choice(WORDS) for _ in range(n_words))


def _steps(backend, prompt: str, n: int, threads_at=lambda step: None) -> list[str]:
    """The digest of the logits after `prompt` and after each of `n` greedy tokens, the thread
    count set to `threads_at(step)` before each step where it says one."""
    import numpy as np

    from quipu.engine.native import lc

    tokens = backend.vocab.tokenize(prompt, add_special=True, parse_special=False)
    backend.prefill(tokens, 0)
    digests, pos = [], len(tokens)
    for step in range(n):
        logits = ctypes.string_at(lc.llama_get_logits_ith(backend.native.ptr, -1), 4 * backend.n_vocab)
        digests.append(hashlib.sha256(logits).hexdigest())
        threads = threads_at(step)
        if threads is not None:
            lc.llama_set_n_threads(backend.native.ptr, threads, threads)
        backend.decode_one(int(np.frombuffer(logits, dtype=np.float32).argmax()), pos)
        pos += 1
    return digests


def test_one_two_and_three_threads_give_the_same_logits_after_a_long_prompt(make_backend, bundled_model):
    prompt = _long_prompt()
    runs = {}
    for threads in (1, 2, 3):
        backend = make_backend(bundled_model, n_ctx=2048, n_threads=threads)
        assert backend.native.settings.v_trans is True  # (flash attention off: V stored transposed)
        runs[threads] = _steps(backend, prompt, 24)
        backend.close()
    assert runs[1] == runs[2] == runs[3]


def test_a_batch_s_rows_are_the_same_with_one_thread_or_three(quipu, bundled_model, tmp_path):
    """Rows after a long shared document, read and answered with 1 and with 3 threads."""
    document = _long_prompt(500, seed=4)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{document}\n{question}"}) + "\n"
                            for question in ("Which word comes most?", "Name two of its words.")))
    answers = []
    for threads in ("1", "3"):
        r = quipu("run", "-m", bundled_model, "--batch", rows, "--parallel", "2", "--threads", threads, "-t", "1.3",
                  "--seed", "5", "-n", "24", "--no-cache", "--no-log")
        assert r.returncode == 0, r.stderr.decode()[-600:]
        answers.append([json.loads(line)["text"] for line in r.stdout.splitlines()])
    assert answers[0] == answers[1]


def test_a_thread_count_changed_between_steps_changes_no_bit(make_backend, bundled_model):
    prompt = _long_prompt(seed=2)
    steady = _steps(make_backend(bundled_model, n_ctx=2048, n_threads=2), prompt, 16)
    changing = _steps(make_backend(bundled_model, n_ctx=2048, n_threads=2), prompt, 16,
                      threads_at=lambda step: 1 + step % 3)
    assert changing == steady


def test_asked_flash_attention_stays_on(make_backend, tiny_model):
    assert make_backend(tiny_model, flash_attn="on").native.settings.v_trans is False
    assert make_backend(tiny_model, kv_type="q8_0").native.settings.v_trans is False  # (a quantized V needs it)


def test_a_session_resumed_with_other_threads_goes_on_as_the_one_that_kept_them(quipu, bundled_model):
    """A session's first turn with two threads, its second with two or with one: the same reply,
    drawn hot (a draw that any difference of the logits would turn elsewhere sooner or later)."""
    first = _long_prompt(seed=3) + "\nWhat is this text about?"
    replies = {}
    for name, threads in (("kept", "2"), ("changed", "1")):
        r = quipu("run", "-m", bundled_model, "-S", name, "--threads", "2", "--seed", "4", "-n", "24", first)
        assert r.returncode == 0, r.stderr.decode()[-600:]
        r = quipu("run", "-m", bundled_model, "-S", name, "--threads", threads, "--seed", "4", "-n", "64",
                  "-t", "1.3", "--json", "And in one word?")
        assert r.returncode == 0, r.stderr.decode()[-600:]
        out = json.loads(r.stdout)
        assert out["usage"]["cached_tokens"] > 1000  # (resumed, not read again)
        replies[name] = out["text"]
    assert replies["changed"] == replies["kept"]


def test_a_prompt_cache_written_with_two_threads_and_read_with_one_answers_as_a_run_without_it(quipu, bundled_model):
    """A piped document read with two threads into the prompt cache, then another question on it
    with one thread: the cache's cells are restored, and the hot draw that follows is the one a
    run with two threads and no cache draws."""
    document = _long_prompt(seed=5)
    common = ("run", "-m", bundled_model, "--seed", "4", "-n", "32", "-t", "1.3", "--json", "--no-log")
    r = quipu(*common, "--threads", "2", "Which word comes first?", input=document)
    assert r.returncode == 0, r.stderr.decode()[-600:]
    answers = {}
    for name, extra in (("cached", ("--threads", "1")), ("alone", ("--threads", "2", "--no-cache"))):
        r = quipu(*common, *extra, "Which word comes last?", input=document)
        assert r.returncode == 0, r.stderr.decode()[-600:]
        out = json.loads(r.stdout)
        assert (out["usage"]["cached_tokens"] > 1000) == (name == "cached")
        answers[name] = out["text"]
    assert answers["cached"] == answers["alone"]


def test_a_server_s_answer_is_the_same_with_one_thread_or_three(bundled_model, tmp_path):
    """The same request after a long message, to `quipu serve --threads 1` and `--threads 3`."""
    from servers import openai_client, quipu_serve

    message = _long_prompt(seed=6) + "\nWhat is this text about?"
    answers = []
    for threads in (1, 3):
        with quipu_serve(tmp_path / f"home{threads}", bundled_model, "--threads", threads, tmp_path=tmp_path) as url:
            client = openai_client(url)
            reply = client.chat.completions.create(model=client.models.list().data[0].id, seed=4, temperature=1.3,
                                                   max_tokens=32, messages=[{"role": "user", "content": message}])
            assert reply.usage.prompt_tokens > 1000
            answers.append(reply.choices[0].message.content)
    assert answers[0] == answers[1]


def _simulate(pace, steps: int, start: int, most: int = 4, free=None) -> list[int]:
    """The thread count of each of `steps` one-token steps a tuner chose, where a step with `k`
    threads at step `i` takes `pace(i, k)` seconds."""
    from quipu.engine.threads import ThreadTuner

    tuner = ThreadTuner(start, most, lambda count: None, free=free)
    used = []
    for i in range(steps):
        used.append(tuner.current)
        tuner.took(1, pace(i, tuner.current))
    return used


@pytest.mark.quick
def test_on_a_busy_machine_the_tuner_finds_the_faster_count_and_seldom_tries_the_slow_one():
    # (two cores, a busy program on one: a second thread waits for it, ten times slower)
    used = _simulate(lambda i, k: 0.018 if k == 1 else 0.17, 2000, start=2, most=2)
    assert used[20:].count(2) < 0.02 * len(used[20:])
    time_taken = sum(0.018 if k == 1 else 0.17 for k in used)
    assert 2000 * 0.018 / time_taken >= 0.8  # (against the best fixed count)


@pytest.mark.quick
def test_on_a_core_shared_in_turns_uneven_steps_do_not_send_the_tuner_trying():
    # (two cores, two busy programs: one thread gets its core in turns, its steps uneven, from 10
    # to 40 ms; two threads wait for each other's turns, 50 to 120 ms)
    draw = random.Random(7)
    pace = lambda i, k: draw.uniform(0.01, 0.04) if k == 1 else draw.uniform(0.05, 0.12)  # noqa: E731
    used = _simulate(pace, 2000, start=1, most=2)
    spent = sum(0.025 if k == 1 else 0.085 for k in used)  # (each count's mean step)
    assert 2000 * 0.025 / spent >= 0.9 and used[20:].count(2) < 0.03 * len(used[20:])


@pytest.mark.quick
def test_the_tuner_tries_no_more_threads_than_the_cores_other_programs_leave_free():
    # (two cores, both held by other programs: a step of two threads waits seconds at its barriers)
    free = [1]
    used = _simulate(lambda i, k: 0.02 if k == 1 else 3.0, 1000, start=1, most=2, free=lambda: free[0])
    assert used.count(2) == 0
    free[0] = 2  # (they went: two threads are worth a try, and taken where faster)
    used = _simulate(lambda i, k: 0.02 / k, 1000, start=1, most=2, free=lambda: free[0])
    assert used[-1] == 2 and used.count(2) > 0.95 * len(used)


@pytest.mark.quick
def test_on_an_idle_machine_the_tuner_keeps_every_core():
    pace = lambda i, k: 0.04 / k + 0.002  # noqa: E731
    used = _simulate(pace, 2000, start=4, most=4)
    assert used[-1] == 4 and used.count(4) > 0.95 * len(used)
    assert 2000 * pace(0, 4) / sum(pace(0, k) for k in used) >= 0.97


@pytest.mark.quick
def test_the_tuner_follows_a_load_that_comes_and_goes():
    busy = lambda i: 500 <= i < 1500  # noqa: E731
    pace = lambda i, k: (0.018 if k == 1 else 0.17) if busy(i) else 0.01 / k + 0.004  # noqa: E731
    used = _simulate(pace, 2000, start=2, most=2)
    assert used[600:1500].count(1) > 0.95 * 900
    assert used[1600:].count(2) > 0.9 * 400


@pytest.mark.quick
def test_the_free_cores_start_from_what_other_programs_run():
    from quipu.engine.threads import free_cores, running_elsewhere

    assert free_cores(8, 8, running=lambda: 3) == 5
    assert free_cores(8, 8, running=lambda: 20) == 1
    assert free_cores(4, 8, running=lambda: 0) == 4
    assert free_cores(4, 8, running=lambda: None) == 4
    here = running_elsewhere()
    assert here is None or here >= 0


def test_threads_quipu_chooses_follow_the_machine_and_asked_ones_stay(make_backend, tiny_model):
    chosen = make_backend(tiny_model)  # (make_backend asks for 2 threads unless told)
    assert chosen.native.tuner is None
    free = make_backend(tiny_model, n_threads=0)
    assert free.native.tuner is not None and free.native.settings.n_threads == 0
    on = make_backend(tiny_model, n_threads=0, flash_attn="on")
    assert on.native.tuner is None  # (flash attention on: the sums follow the thread count, which stays)


def test_the_layout_is_known_after_another_library_took_llama_cpp_s_log(make_backend, tiny_model):
    import llama_cpp

    assert make_backend(tiny_model).native.settings.v_trans is True
    llama_cpp.Llama(str(tiny_model), vocab_only=True, verbose=False)  # (its own log callback, set as it loads)
    assert make_backend(tiny_model).native.settings.v_trans is True
