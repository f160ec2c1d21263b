"""One context shared by several requests (`quipu serve --parallel N`): each request's history is
a sequence of its own, and what they decode is decoded together, one llama.cpp batch a step.

On a CPU (and a GPU) a step that decodes a token for each of several sequences costs little
more than a step for one: the model's weights are read once. Each request runs on a backend of
its own (`LlamaBackend.sequences`), whose parts speak to a `SequenceContext`: it answers for
the request's sequence, and hands each decode to the shared context's stepper, a thread that
gathers what every sequence has asked for (a token each for those generating, or one prompt's
step) into one batch and decodes it. A sequence's logits stay where that step left them until
its sampler has read them: the next step waits for every reader (`logits_read`).

Each sequence has a stream of the cache of its own (llama.cpp's cache not unified), its cells
from the first on as on a context of its own, so its attention adds its terms in the same order
(a unified cache lays a sequence's cells among the others', and the answers drifted by the last
bits even one request at a time); a step's tokens go in the order of their sequences, which
llama.cpp's split of a step across streams needs. A prompt's step is decoded alone: a token
decoded beside a prompt's step takes another road in llama.cpp's kernels. So a request answers
as on a context of its own (greedy answers tested equal at eight at once); a token decoded
beside others' after a long history (512 cells) is not split among the threads as a lone one
is, and may differ in its last bits. A sequence's state names its context's streams: it is
restored only into a context shared as widely (`ContextSettings.state_key`), and has no second
sequence to write a piece of it through (`partial_state`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ContextManager, TypeVar

from quipu.engine.llama_context import NativeContext
from quipu.errors import EngineError

if TYPE_CHECKING:
    from quipu.engine.model import LlamaModel
    from quipu.engine.settings import ContextSettings

T = TypeVar("T")
# How long a step waits for a sequence of the last step that has not asked for its next yet (its
# thread is between its draw and its next token): long enough to decode it with the others, short
# enough that one that stopped costs little.
GATHER_S = 0.02


@dataclass(eq=False)
class _Ask:
    """What one sequence asks of a step: tokens (token, position, wants logits) to decode, or
    `work` to run on the context alone; then where its logits are, or what went wrong."""

    seq: int
    items: list[tuple[int, int, bool]] = field(default_factory=list)
    work: Callable[[], Any] | None = None
    wants_logits: bool = False
    done: bool = False
    index: int = -1
    result: Any = None
    error: BaseException | None = None


class SharedContext:
    """The context `parallel` requests share (`context.parallel`), on `model`, and its stepper."""

    def __init__(self, model: LlamaModel, context: ContextSettings):
        self.native = NativeContext(model, context)
        self.parallel = self.native.settings.parallel
        self.lock = threading.RLock()  # around every native call: llama.cpp's context is one thread's at a time
        self._cond = threading.Condition()
        self._asks: list[_Ask] = []
        self._readers: set[int] = set()  # sequences whose logits are not read yet
        self._expected: set[int] = set()  # sequences of the last step, not back yet
        self._closed = False
        self.most_together = 0  # the most sequences a step has held
        self._thread = threading.Thread(target=self._run, name="quipu-stepper", daemon=True)
        self._thread.start()

    @property
    def sequences(self) -> list[int]:
        """The requests' sequences: 0, 1, ..."""
        return list(range(self.parallel))

    def read(self, seq: int) -> None:
        """Sequence `seq`'s logits are read (or will not be): the next step may overwrite them."""
        with self._cond:
            if seq in self._readers:
                self._readers.discard(seq)
                self._cond.notify_all()

    # ---- the stepper --------------------------------------------------------------------

    def ask(self, ask: _Ask) -> _Ask:
        """Queues `ask` for a step and waits for it; its error raised here."""
        with self._cond:
            if self._closed:
                raise EngineError("the shared context is closed")
            self._readers.discard(ask.seq)  # (it asks for more: its last logits are done with)
            self._asks.append(ask)
            self._cond.notify_all()
            while not ask.done:
                self._cond.wait()
        if ask.error is not None:
            raise ask.error
        return ask

    def _run(self) -> None:
        while True:
            with self._cond:
                step = self._gather()
                if step is None:
                    return
            self._decode(step)
            with self._cond:
                self._expected = {a.seq for a in step}
                for a in step:
                    if a.error is None and a.wants_logits:
                        self._readers.add(a.seq)
                    a.done = True
                self._cond.notify_all()

    def _gather(self) -> list[_Ask] | None:
        """The asks of the next step (the condition held), once every sequence has read its
        logits (and, for a moment, the sequences of the last step have asked again): the first
        asked, and where it is a token, the other sequences' tokens with it, in the order of
        their sequences. A prompt's step is decoded alone, as is work on the context alone:
        llama.cpp's kernels take another road for a step of many tokens (flash attention's
        tiles), and a token decoded beside a prompt would drift from the one a lone run draws."""
        cond = self._cond
        while not self._closed and (not self._asks or self._readers):
            cond.wait()
        if self._closed:
            return None
        deadline = time.monotonic() + GATHER_S
        while self._expected - {a.seq for a in self._asks} and not self._readers:
            left = deadline - time.monotonic()
            if left <= 0 or self._closed:
                break
            cond.wait(left)
        first = self._asks.pop(0)
        if first.work is not None or len(first.items) > 1:
            return [first]
        tokens = [a for a in self._asks if a.work is None and len(a.items) == 1][:self.native.settings.n_batch - 1]
        for a in tokens:
            self._asks.remove(a)
        return sorted([first] + tokens, key=lambda a: a.seq)

    def _decode(self, step: list[_Ask]) -> None:
        native = self.native
        try:
            with self.lock:
                if step[0].work is not None:
                    step[0].result = step[0].work()
                    return
                n = 0
                for a in step:
                    for token, pos, logits in a.items:
                        native.fill(n, token, pos, a.seq, logits)
                        if logits:
                            a.index = n
                        n += 1
                native.decode(n)
            self.most_together = max(self.most_together, len(step))
        except BaseException as exc:  # (each sequence of the step hears it, in its own thread)
            for a in step:
                a.error = exc

    def close(self) -> None:
        """Stops the stepper (what waits hears that the context is closed) and frees the context."""
        with self._cond:
            self._closed = True
            for a in self._asks:
                a.error, a.done = EngineError("the shared context is closed"), True
            self._asks.clear()
            self._cond.notify_all()
        self._thread.join()
        self.native.close()


class SequenceContext(NativeContext):
    """One sequence of a shared context, as the backend's parts see a context of their own: its
    sequence 0 is this one's (`own`), and its decodes go to the stepper."""

    def __init__(self, shared: SharedContext, seq: int):  # (NativeContext's own is not run: the context is shared's)
        native = shared.native
        self.shared = shared
        self.own = seq
        self.model, self.ptr, self.mem = native.model, native.ptr, native.mem
        self.settings, self.n_ctx, self.n_ctx_seq = native.settings, native.n_ctx, native.n_ctx_seq
        self.ring, self.recurrent = native.ring, native.recurrent
        self.threads, self.tuner = native.threads, None  # (its decodes are the shared context's, timed there)
        self.logits_index = -1
        self._items: list[tuple[int, int, bool]] = []

    def _seq(self, seq: int) -> int:
        if seq == 0:
            return self.own
        raise EngineError("a shared context's sequence has no second sequence to write a piece of its state through")

    def fill(self, i: int, token: int, pos: int, seq: int, logits: bool) -> None:
        del self._items[i:]
        self._items.append((token, pos, logits))

    def decode(self, n: int) -> None:
        items, self._items = self._items[:n], []
        asked = self.shared.ask(_Ask(self.own, items, wants_logits=any(x[2] for x in items)))
        self.logits_index = asked.index

    def alone(self, work: Callable[[], T]) -> T:
        asked = self.shared.ask(_Ask(self.own, work=work, wants_logits=True))
        self.logits_index = -1  # (the helper's decode: its last output)
        result: T = asked.result
        return result

    def logits_read(self) -> None:
        self.shared.read(self.own)

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
