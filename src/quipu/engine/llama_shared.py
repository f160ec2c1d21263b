"""One context shared by several requests (`quipu serve --parallel N`): each request's history is
a sequence of its own, and what they decode is decoded together, one llama.cpp batch a step.

On a CPU (and a GPU) a step that decodes a token for each of several sequences costs little
more than a step for one: the model's weights are read once. Each request runs on a backend of
its own (`LlamaBackend.sequences`), whose parts speak to a `SequenceContext`: it answers for
the request's sequence, and hands each decode to the shared context's stepper
(`scheduler.Stepper`), which makes the steps as a batch's rows are made, so that a request
answers as on a context of its own. A sequence's logits stay where that step left them until
its sampler has read them: the next step waits for every reader (`logits_read`). A sequence's
state names its context's streams: it is restored only into a context shared as widely
(`ContextSettings.state_key`), and has no second sequence to write a piece of it through
(`partial_state`).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, ContextManager, TypeVar

from quipu.engine.llama_context import NativeContext
from quipu.engine.scheduler import Ask, Scheduler, Stepper
from quipu.errors import EngineError

if TYPE_CHECKING:
    from quipu.engine.model import LlamaModel
    from quipu.engine.settings import ContextSettings

T = TypeVar("T")


class SharedContext:
    """The context `n_seq` requests share (`context.n_seq`), on `model`, and its stepper."""

    def __init__(self, model: LlamaModel, context: ContextSettings):
        self.native = NativeContext(model, context)
        self.scheduler = Scheduler(self.native)  # (a batch's rows use it from their one thread)
        self.stepper = Stepper(self.scheduler)  # (requests, from threads of their own)

    @property
    def sequences(self) -> list[int]:
        """The requests' sequences: 0, 1, ..."""
        return list(range(self.native.settings.n_seq))

    @property
    def lock(self) -> threading.RLock:
        return self.stepper.lock

    def close(self) -> None:
        """Stops the stepper (what waits hears that the context is closed) and frees the context."""
        self.stepper.close()
        self.native.close()


class SequenceContext(NativeContext):
    """One sequence of a shared context, as the backend's parts see a context of their own: its
    sequence 0 is this one's (`own`), and its decodes go to the stepper."""

    def __init__(self, shared: SharedContext, seq: int):  # (built on what the shared context opened: no context of its own)
        self.opened = shared.native.opened
        self.shared = shared
        self.own = seq
        self.tuner = None  # (its decodes are the shared context's, timed there)
        self.logits_index = -1
        self._items: list[tuple[int, int, bool]] = []

    @property
    def threads(self) -> int:
        return self.shared.native.threads

    def _seq(self, seq: int) -> int:
        if seq == 0:
            return self.own
        raise EngineError("a shared context's sequence has no second sequence to write a piece of its state through")

    def fill(self, i: int, token: int, pos: int, seq: int, logits: bool) -> None:
        del self._items[i:]
        self._items.append((token, pos, logits))

    def decode(self, n: int) -> None:
        items, self._items = self._items[:n], []
        asked = self.shared.stepper.ask(Ask(self.own, items))
        self.logits_index = asked.index

    def alone(self, work: Callable[[], T]) -> T:
        asked = self.shared.stepper.ask(Ask(self.own, work=work))
        self.logits_index = -1  # (the helper's decode: its last output)
        result: T = asked.result
        return result

    def logits_read(self) -> None:
        self.shared.stepper.read(self.own)

    def held(self) -> ContextManager[Any]:
        return self.shared.lock

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        with self.shared.lock:
            return super().seq_rm(self._seq(seq), p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        with self.shared.lock:
            super().seq_cp(self._seq(src), self._seq(dst), p0, p1)

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        with self.shared.lock:
            super().seq_add(self._seq(seq), p0, p1, delta)

    def seq_pos_max(self, seq: int) -> int:
        with self.shared.lock:
            return super().seq_pos_max(self._seq(seq))

    def seq_pos_min(self, seq: int) -> int:
        with self.shared.lock:
            return super().seq_pos_min(self._seq(seq))

    def clear(self) -> None:
        """This sequence's cells alone."""
        with self.shared.lock:
            super().seq_rm(self.own, -1, -1)

    def seq_state(self, seq: int, flags: int = 0) -> memoryview:
        with self.shared.lock:
            return super().seq_state(self._seq(seq), flags)

    def set_seq_state(self, data: bytes | memoryview, seq: int, what: str, flags: int = 0) -> None:
        with self.shared.lock:
            super().set_seq_state(data, self._seq(seq), what, flags)

    def close(self) -> None:
        """The sequence's request is done: what it has not read is not waited for."""
        self.logits_read()
