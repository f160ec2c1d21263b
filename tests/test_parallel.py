"""A context several requests share (`quipu serve --parallel N`): each request's history a
sequence of its own, their tokens decoded together. Each answers as it does alone, on a plain
model and on a hybrid one (whose recurrent state goes back to its checkpoints per sequence), and
a sequence's state saved is restored into another, of a context shared as widely."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from quipu.errors import EngineError

from tinymodel import write_tiny_gguf, write_tiny_qwen35

PROMPTS = ["hello the sky is blue", "Paris is the world and", "the world is hello and the sky",
           "blue blue sky of Paris over the world", "hello hello world", "the sky of the world is Paris"]
TEMPLATES = Path(__file__).parent / "templates"


@pytest.fixture(scope="module", params=["plain", "qwen35"])
def model(request, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("parallel")
    if request.param == "plain":
        return write_tiny_gguf(folder / "tiny.gguf")
    return write_tiny_qwen35(folder / "qwen35.gguf")


def _open(model: Path, parallel: int):
    from quipu.engine.llama import LlamaBackend
    from quipu.engine.settings import ContextSettings

    return LlamaBackend(model, ContextSettings(n_ctx=512, n_threads=2, n_seq=parallel))


def _answer(backend, prompt: str, n: int = 20, session=None) -> list[int]:
    from quipu.sessions.inference import InferenceSession
    from quipu.sessions.params import SamplingParams

    session = session or InferenceSession(backend, SamplingParams(seed=1, temperature=0.0))
    tokens = backend.vocab.tokenize(prompt, add_special=True, parse_special=False)
    return session.complete(tokens, n).tokens


def _together(views, work) -> list:
    """`work(view, k)` for each view at once, in threads of their own; what each gave."""
    got: list = [None] * len(views)
    failed: list[BaseException] = []

    def run(k: int) -> None:
        try:
            got[k] = work(views[k], k)
        except BaseException as exc:  # (said by the test, not lost in a thread)
            failed.append(exc)
        finally:
            views[k].done_reading()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(views))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not failed, failed
    return got


def test_requests_decoded_together_answer_as_each_does_alone(model):
    alone = _open(model, 1)
    want = [_answer(alone, p) for p in PROMPTS]
    alone.close()
    first = _open(model, 3)
    views = [first, *first.sequences()]
    try:
        assert [v.n_ctx for v in views] == [512] * 3  # (each its own share: the context holds three)
        got = _together(views, lambda view, k: [_answer(view, p) for p in PROMPTS[k::3]])
        assert first._shared.scheduler.most_together >= 2  # (tokens of several requests in one step)
    finally:
        for v in views[1:]:
            v.close()
        first.close()
    assert [got[k % 3][k // 3] for k in range(len(PROMPTS))] == want


def _two_turns(backend, other=None) -> tuple[list[int], list[int], int, bytes]:
    """A prompt and its answer, then a prompt going on from both: the answers, how much of the
    second prompt the context kept, and the state after it, restored into `other` (if any)."""
    from quipu.sessions.inference import InferenceSession
    from quipu.sessions.params import SamplingParams

    session = InferenceSession(backend, SamplingParams(seed=1, temperature=0.0))
    first = backend.vocab.tokenize(PROMPTS[0] + " " + PROMPTS[1], add_special=True, parse_special=False)
    one = session.complete(first, 16).tokens
    going_on = first + one + backend.vocab.tokenize(" " + PROMPTS[2], add_special=False, parse_special=False)
    two = session.complete(going_on, 16).tokens
    kept = session.stats.cached_tokens
    backend.done_reading()
    state = bytes(backend.memory.snapshot_bytes())
    if other is not None:
        other.memory.restore_bytes(state)
    return one, two, kept, state


def test_a_sequence_goes_on_from_what_it_holds_and_its_state_restores_in_another(model):
    alone = _open(model, 1)
    try:
        want_one, want_two, _, _ = _two_turns(alone)
    finally:
        alone.close()
    first = _open(model, 2)
    views = [first, *first.sequences()]
    try:
        a, b = views
        b_says = _answer(b, PROMPTS[3])  # (another request's cells beside)
        one, two, kept, state = _two_turns(a, b)
        held = a.memory.positions()
        assert b.memory.positions() == held
        restored = bytes(b.memory.snapshot_bytes())
    finally:
        for v in views[1:]:
            v.close()
        first.close()
    # the second turn went on from what the sequence held (a hybrid's: its checkpoint), and both
    # turns answered as on a context of one's own
    assert kept > 0 and (one, two) == (want_one, want_two)
    assert b_says
    # b held a's conversation cell for cell (the states name the sequence they were written from:
    # each read back into another context's second sequence writes the same)
    shared = _open(model, 2)
    views = [shared, *shared.sequences()]
    try:
        third = views[1]
        third.memory.restore_bytes(state)
        from_a = bytes(third.memory.snapshot_bytes())
        third.memory.restore_bytes(restored)
        assert bytes(third.memory.snapshot_bytes()) == from_a and third.memory.positions() == held
        # (a context of one's own has one stream of cells, not two: it refuses the state in one line)
        lone = _open(model, 1)
        try:
            with pytest.raises(EngineError, match="refused"):
                lone.memory.restore_bytes(state)
        finally:
            lone.close()
    finally:
        for v in views[1:]:
            v.close()
        shared.close()


@pytest.mark.parametrize("kind", ["plain", "qwen35"])
def test_four_conversations_at_once_answer_as_each_does_alone_on_a_server(kind, home, tmp_path):
    # `quipu serve --parallel 4`, four clients at once, each a conversation of four turns (two
    # greedy, two drawn with a seed), five times over: each of the 16 answers is the one a server
    # that answers one request at a time gives, to the character, from the first turn on. (Weights
    # of a type whose product llama.cpp computes one dot product a token whatever the step, as the
    # bundled model's Q4_1: the answers do not hang on which steps the four happened to share.)
    from concurrent.futures import ThreadPoolExecutor

    from servers import openai_client, quipu_serve

    if kind == "plain":
        model = write_tiny_gguf(tmp_path / "tiny.gguf", weights="q4_1")
    else:
        model = write_tiny_qwen35(tmp_path / "qwen35.gguf", weights="q4_1",
                                  chat_template=(TEMPLATES / "Qwen3.5-4B.jinja").read_text())
    turns = ["Tell me of the sky.", "And of the world?", "Is Paris blue?", "Say hello again."]

    def converse(url: str, k: int) -> list[str]:
        c = openai_client(url)
        messages: list[dict] = [{"role": "system", "content": f"You are assistant number {k}."}]
        said = []
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            drawn = {"temperature": 0.0} if k % 2 == 0 else {"temperature": 0.9, "seed": 10 + k}
            reply = c.chat.completions.create(model=model.stem, messages=messages, max_tokens=12, **drawn)
            message = reply.choices[0].message
            text = message.content or ""
            said.append((message.model_extra or {}).get("reasoning_content", "") + "|" + text)  # (a thinking model's too)
            messages.append({"role": "assistant", "content": text})
        return said

    with quipu_serve(home, model, "--parallel", "1", tmp_path=tmp_path) as url:
        alone = [converse(url, k) for k in range(4)]
    assert len({tuple(a) for a in alone}) == 4  # (four conversations that differ)
    with quipu_serve(home, model, "--parallel", "4", tmp_path=tmp_path) as url:
        for _ in range(5):
            with ThreadPoolExecutor(4) as pool:
                together = list(pool.map(lambda k: converse(url, k), range(4)))
            assert together == alone


def test_a_token_s_text_read_from_several_threads_at_once_is_its_own(bundled_model):
    # (requests on one model read their tokens' pieces from threads of their own: each thread's
    # piece is the one llama.cpp writes for its token, not another thread's written meanwhile)
    from quipu.engine.model import LlamaModel

    first, second = LlamaModel(bundled_model).acquire(), LlamaModel(bundled_model).acquire()
    try:
        expected = [first.token_bytes(t) for t in range(first.n_vocab)]
        got: dict[int, bytes] = {}

        def read(k: int) -> None:
            for t in range(k, second.n_vocab, 4):
                got[t] = second.token_bytes(t)

        threads = [threading.Thread(target=read, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert [got[t] for t in range(second.n_vocab)] == expected
        assert [second.token_bytes(t) for t in range(second.n_vocab)] == expected  # (and kept so)
    finally:
        first.release()
        second.release()
