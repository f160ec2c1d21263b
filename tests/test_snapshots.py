"""Exact snapshots on the tiny generated model: resume continues token for token."""

from __future__ import annotations

import pytest

from quipu.errors import SnapshotError
from quipu.sessions.conversation import Conversation
from quipu.sessions.inference import InferenceSession, Snapshot
from quipu.sessions.params import SamplingParams
from quipu.store.statefile import decode_state, encode_state

pytestmark = pytest.mark.quick  # (the quick set: `python -m pytest -m quick`)

HOT = SamplingParams(temperature=1.2, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.3, seed=21)


def through_disk(snap: Snapshot) -> Snapshot:
    """A snapshot as a new process would see it: only what the state file carries."""
    blob = decode_state(encode_state({"tokens": snap.tokens}, snap.state))
    return Snapshot(list(blob.meta["tokens"]), snap.n_decoded, snap.draws, SamplingParams.from_dict(snap.params.to_dict()),
                    dict(snap.context), blob.state)


def long_run(make_backend, prompt, n):
    """A seed whose uninterrupted run is not cut short by an end-of-generation token."""
    for seed in range(100, 120):
        params = HOT.replace(seed=seed)
        full = InferenceSession(make_backend(), params).complete(prompt, n)
        if full.finish_reason == "length":
            return params, full
    pytest.fail("no seed ran to the length limit")


def test_generate_64_equals_32_saved_resumed_32(make_backend):
    prompt = make_backend().vocab.tokenize("the sky is blue and", add_special=True, parse_special=False)
    params, full = long_run(make_backend, prompt, 64)

    first = InferenceSession(make_backend(), params)
    a = first.complete(prompt, 32)
    snap = through_disk(first.snapshot())
    first.backend.close()
    resumed = InferenceSession.from_snapshot(make_backend(), snap)
    b = resumed.infer(32)
    assert a.tokens + b.tokens == full.tokens
    assert resumed.rebuilt_tokens == 0 and resumed.stats.restore_s > 0  # restored, not re-read


def test_chat_turns_resume_exactly(make_backend):
    def fresh():
        return Conversation.start(InferenceSession(make_backend(), HOT), system="be kind")

    whole = fresh()
    r1 = whole.send("hello", max_tokens=12)
    r2 = whole.send("the sky", max_tokens=12)

    conv = fresh()
    s1 = conv.send("hello", max_tokens=12)
    snap = through_disk(conv.session.snapshot())
    resumed = Conversation(InferenceSession.from_snapshot(make_backend(), snap), conv.template, conv.messages)
    s2 = resumed.send("the sky", max_tokens=12)
    assert (s1.tokens, s2.tokens) == (r1.tokens, r2.tokens)
    assert resumed.session.stats.cached_tokens == snap.n_decoded


def test_resume_without_state_bytes_rebuilds_the_same_context(make_backend):
    session = InferenceSession(make_backend(), HOT)
    session.complete(make_backend().vocab.tokenize("hello world", add_special=True, parse_special=False), 16)
    snap = session.snapshot(with_state=False)
    rebuilt = InferenceSession.from_snapshot(make_backend(), snap)
    assert rebuilt.tokens == session.tokens
    assert rebuilt.backend.memory.positions() == rebuilt.n_decoded == session.n_decoded
    assert rebuilt.rebuilt_tokens == session.n_decoded  # re-read, as there were no state bytes
    assert rebuilt.infer(8).tokens == session.infer(8).tokens


def test_state_from_other_context_settings_is_not_used(make_backend):
    session = InferenceSession(make_backend(n_ctx=512), HOT)
    session.complete(make_backend().vocab.tokenize("hello", add_special=True, parse_special=False), 8)
    snap = session.snapshot()
    other = InferenceSession.from_snapshot(make_backend(n_ctx=256), snap)
    assert other.tokens == session.tokens and other.n_decoded == session.n_decoded
    assert other.rebuilt_tokens == session.n_decoded  # the bytes were not handed to llama.cpp
    same = InferenceSession.from_snapshot(make_backend(n_ctx=512), snap)
    assert same.rebuilt_tokens == 0
    assert other.infer(8).tokens == same.infer(8).tokens == session.infer(8).tokens


def test_fork_is_independent(make_backend):
    session = InferenceSession(make_backend(), HOT)
    session.complete(make_backend().vocab.tokenize("hello world", add_special=True, parse_special=False), 8)
    before = list(session.tokens)
    twin = session.fork()
    a = session.infer(8)
    assert twin.tokens == before
    b = twin.infer(8)
    assert a.tokens == b.tokens  # same seed, same draw index, same context
    twin.rewind(3)
    assert session.tokens[:len(before)] == before and twin.backend is not session.backend
    twin.backend.close()


def test_rewind_restores_the_exact_earlier_context(make_backend):
    session = InferenceSession(make_backend(), HOT)
    prompt = make_backend().vocab.tokenize("hello world", add_special=True, parse_special=False)
    session.complete(prompt, 4)
    mark, draws = len(session.tokens), session.draws
    first = session.infer(12)
    session.rewind(mark)
    session.draws = draws
    again = session.infer(12)
    assert again.tokens == first.tokens


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) // 2],
        lambda b: b[:10],
        lambda b: b"",
        lambda b: b"\x00" * len(b),
        lambda b: b[:40] + bytes([b[40] ^ 0xFF]) + b[41:],
        lambda b: b[:-1] + bytes([b[-1] ^ 1]),
        lambda b: b[:8] + b"\x09\x00\x00\x00" + b[12:],
        lambda b: b[:12] + b"\xff\xff\xff\x7f" + b[16:],
        lambda b: b + b"extra",
    ],
)
def test_damaged_state_files_are_refused_before_llama_cpp_sees_them(damage):
    data = encode_state({"n": 1}, bytes(range(256)) * 40)
    with pytest.raises(SnapshotError):
        decode_state(damage(data))
