"""The one scheduler of a context that several sequences share: it gathers what each sequence
asks of a step into llama.cpp's batch, decodes it, and tells each where its logits are. A
batch's rows (`sessions/batch.py`, from one thread) and a server's requests (`llama_shared.py`,
a thread each, through the `Stepper` here) both go through it.

How a step is made keeps each sequence's answer its lone run's, bit for bit (measured on the
CPU without flash attention, quipu's choice there, and tested): each sequence has a stream of
the cache of its own (llama.cpp's cache not unified), its cells from the first on as on a
context of its own; a step is either one token for each of any number of sequences, in the
order of their sequences, or one sequence's prompt (several tokens) alone. A prompt decoded
beside others' tokens, or two prompts together, are split by llama.cpp into parts of equal
length per sequence, and a part's arithmetic takes another road: the last bits differ, and a
near tie goes the other way. The oldest ask goes first, so a prompt waits for at most one step.

This holds where llama.cpp's CPU multiplies the weights one dot product a token whatever the
step (on x86: Q4_1, the bundled model's, Q5_1, Q5_K, Q6_K, Q3_K). Other types take a kernel of
their own for several tokens at once, which sums otherwise than a lone token's: llamafile's tiles
for F32, F16, BF16, Q8_0 and Q5_0 at two tokens or more (`sgemm.cpp`), and for weights the CPU
repacked into interleaved blocks (Q4_0, Q4_K, IQ4_NL on AVX2: `repack.cpp`) a kernel for each four
tokens. There a step of several sequences' tokens differs from their lone runs in the last bits
(at three or fewer, `--parallel 3`, a repacked model's does not). Holding every step to one
sequence, or three, would cost most of what a step shared gains (half the speed of a batch of
eight on Gemma 3 270M Q4_K_M, measured): not done; docs/run.md says so.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from quipu.errors import EngineError

if TYPE_CHECKING:
    from quipu.engine.llama_context import NativeContext

# How long a step waits for a sequence of the last step that has not asked for its next yet (its
# thread is between its draw and its next token): long enough to decode it with the others, short
# enough that one that stopped costs little.
GATHER_S = 0.02


@dataclass(eq=False)
class Ask:
    """What one sequence asks of a step: tokens (token, position, wants logits) to decode, or
    `work` to run on the context alone; then where its logits are (`index`), or what went wrong."""

    seq: int
    items: list[tuple[int, int, bool]] = field(default_factory=list)
    work: Callable[[], Any] | None = None
    index: int = -1
    done: bool = False
    result: Any = None
    error: BaseException | None = None

    @property
    def wants_logits(self) -> bool:
        return self.work is not None or any(logits for _, _, logits in self.items)

    @property
    def one_token(self) -> bool:
        return self.work is None and len(self.items) == 1


def next_step(waiting: list[Ask], most: int) -> list[Ask]:
    """Takes the asks of the next step out of `waiting` (oldest first): the oldest, and where it
    is one token, the other one-token asks with it (at most `most` in all), in the order of
    their sequences; a prompt, or work on the context, alone."""
    first = waiting.pop(0)
    if not first.one_token:
        return [first]
    together = [a for a in waiting if a.one_token][:most - 1]
    for a in together:
        waiting.remove(a)
    return sorted([first, *together], key=lambda a: a.seq)


class Scheduler:
    """Decodes the steps of `native`'s sequences (`next_step`'s), from one thread at a time."""

    def __init__(self, native: NativeContext):
        self.native = native
        self.most_together = 0  # the most sequences a step has held

    def step(self, waiting: list[Ask]) -> list[Ask]:
        """Decodes the next step of `waiting` (which loses its asks); returns them, each with its
        logits' index set (its work's result). An error is raised here, the step's asks taken."""
        step = next_step(waiting, self.native.settings.n_batch)
        self.decode(step)
        return step

    def decode(self, step: list[Ask]) -> None:
        native = self.native
        if step[0].work is not None:
            step[0].result = step[0].work()
            return
        n = sum(len(a.items) for a in step)
        if n > native.settings.n_batch:
            raise EngineError(f"a step of {n} tokens is more than the context's batch of {native.settings.n_batch}")
        n = 0
        for a in step:
            for token, pos, logits in a.items:
                native.fill(n, token, pos, a.seq, logits)
                if logits:
                    a.index = n
                n += 1
        native.decode(n)
        self.most_together = max(self.most_together, len(step))


class Stepper:
    """The scheduler of a context whose sequences ask from threads of their own (a server's
    requests): a thread that decodes each step once every sequence has read its logits (a
    step overwrites the last one's) and, for a moment, the sequences of the last step have asked
    again. `lock` is held around every native call: llama.cpp's context is one thread's at a time."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.lock = threading.RLock()
        self._cond = threading.Condition()
        self._asks: list[Ask] = []
        self._readers: set[int] = set()  # sequences whose logits are not read yet
        self._expected: set[int] = set()  # sequences of the last step, not back yet
        self._closed = False
        self._thread: threading.Thread | None = None  # (started by the first ask)

    def ask(self, ask: Ask) -> Ask:
        """Queues `ask` for a step and waits for it; its error raised here."""
        with self._cond:
            if self._closed:
                raise EngineError("the shared context is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="quipu-stepper", daemon=True)
                self._thread.start()
            self._readers.discard(ask.seq)  # (it asks for more: its last logits are done with)
            self._asks.append(ask)
            self._cond.notify_all()
            while not ask.done:
                self._cond.wait()
        if ask.error is not None:
            raise ask.error
        return ask

    def read(self, seq: int) -> None:
        """Sequence `seq`'s logits are read (or will not be): the next step may overwrite them."""
        with self._cond:
            if seq in self._readers:
                self._readers.discard(seq)
                self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._gather():
                    return
                step = next_step(self._asks, self.scheduler.native.settings.n_batch)
            try:
                with self.lock:
                    self.scheduler.decode(step)
            except BaseException as exc:  # (each sequence of the step hears it, in its own thread)
                for a in step:
                    a.error = exc
            with self._cond:
                self._expected = {a.seq for a in step}
                for a in step:
                    if a.error is None and a.wants_logits:
                        self._readers.add(a.seq)
                    a.done = True
                self._cond.notify_all()

    def _gather(self) -> bool:
        """Waits (the condition held) until a step can be made: False once closed."""
        cond = self._cond
        while not self._closed and (not self._asks or self._readers):
            cond.wait()
        if self._closed:
            return False
        deadline = time.monotonic() + GATHER_S
        while self._expected - {a.seq for a in self._asks} and not self._readers:
            left = deadline - time.monotonic()
            if left <= 0 or self._closed:
                break
            cond.wait(left)
        return not self._closed

    def close(self) -> None:
        """Stops the thread; what waits hears that the context is closed."""
        with self._cond:
            self._closed = True
            for a in self._asks:
                a.error, a.done = EngineError("the shared context is closed"), True
            self._asks.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
