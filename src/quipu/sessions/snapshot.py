"""A session's exact state, as saved and restored (`InferenceSession.snapshot` and
`InferenceSession.from_snapshot`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from quipu.sessions.params import SamplingParams


@dataclass
class Snapshot:
    """Everything needed to continue a session exactly: the token history (the last sampled
    token undecoded), the draw count, the parameters, and the KV bytes of the decoded part."""

    tokens: list[int]
    n_decoded: int
    draws: int
    params: SamplingParams
    context: dict[str, Any]
    state: bytes | memoryview | None = None
    # Pieces of state saved after `state`, (the position each replaces the cells from, its
    # bytes: see `Memory.state_since`), and how many tokens the state and pieces hold
    # when that is fewer than `n_decoded` (a turn whose state was not written: read again).
    pieces: Sequence[Any] = ()
    state_decoded: int | None = None
    # A recurrent memory's states, kept apart from its cells (`Memory.recurrent_at`), oldest first:
    # the last is where the restored context ends (`state_decoded`), the others its checkpoints.
    recurrent: Sequence[Any] = ()
