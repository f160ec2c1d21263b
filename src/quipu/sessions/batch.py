"""BatchSession: many prompts decoded side by side on one context, each with its own seed.

On a CPU the model's weights are read from memory once per step whatever the number of
sequences in it, so a step that decodes one token for each of several rows costs little more
than a step for one row. The context holds `n_seq` sequences (`ContextSettings.n_seq`), each
with cells of its own; the scheduler (`engine/scheduler.py`) makes each step one token for each
row being generated, or a starting row's prompt alone (continuous batching): a finished row's
sequence goes to the next row at once.

The beginning every row shares (a system prompt, few-shot examples) is read once, into
sequence 0, and copied to the others; a sequence keeps it when its row ends, for the next row.

Each row has its own sampler chain, penalty window, grammar (the masks of all rows under one
are computed together each step) and draws seeded by (its seed, draw index), as
`InferenceSession` does: a row's answer is its lone run's, whatever the other rows and `n_seq`
(greedy and seeded, to the last bit of the logits on the CPU: the scheduler's steps are made so).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Sequence

from quipu.errors import ContextOverflow, Interrupted
from quipu.sessions.inference import Generation, Stats, common_prefix
from quipu.sessions.stops import ReplyText
from quipu.sessions.params import SamplingParams, draw_seed

from quipu.engine.scheduler import Ask

if TYPE_CHECKING:
    from quipu.engine.constraint import Matcher
    from quipu.engine.llama import LlamaBackend
    from quipu.engine.llama_rows import BatchRows
    from quipu.engine.sampler import SamplerChain

OWN_TOKENS = 2  # each row decodes at least this many of its prompt's tokens itself
# on_row_token(row, token, text): `text` is what may be shown now (stop strings held back).
RowTokenFn = Callable[[int, int, str], None]
# on_row_done(row, generation, stats)
RowDoneFn = Callable[[int, Generation, Stats], None]


@dataclass
class BatchRow:
    """One prompt of a batch, tokenized, with how to answer it."""

    tokens: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 512
    stop: Sequence[str] = ()


class _Slot:
    """A sequence of the context, and the row it answers (`row` -1: none): the tokens it
    decodes next and where, its sampler chain and grammar, its reply and its figures."""

    def __init__(self, seq: int):
        self.seq = seq
        self.row = -1
        self.pending: list[int] = []  # tokens to decode next
        self.pos = 0  # where pending[0] goes
        self._chain: SamplerChain | None = None
        self.matcher: Matcher | None = None  # the grammar's place in this row's reply (None: no grammar)
        self.params = SamplingParams()
        self.draws = 0
        self.max_tokens = 0
        self._reply: ReplyText | None = None
        self.sampled = 0
        self._stats = Stats()
        self._started = self._first_at = self._last_at = 0.0

    def start(self, index: int, row: BatchRow, params: SamplingParams, chain: SamplerChain, matcher: Matcher | None,
              shared: int, reply: ReplyText) -> None:
        """Answers the row `index` from here, the `shared` tokens of its prompt already read."""
        self.row, self.params, self._chain, self.matcher, self._reply = index, params, chain, matcher, reply
        chain.accept(row.tokens)  # the penalty window sees the prompt, as a lone run's does
        self.pending, self.pos = list(row.tokens[shared:]), shared
        self.draws = self.sampled = 0
        self.max_tokens = row.max_tokens
        self._stats = Stats(prompt_tokens=len(row.tokens), cached_tokens=shared)
        self._started = time.perf_counter()

    @property
    def chain(self) -> SamplerChain:
        assert self._chain is not None  # (a row's chain is made as it starts)
        return self._chain

    @property
    def reply(self) -> ReplyText:
        assert self._reply is not None  # (made as the row starts)
        return self._reply

    def ask(self, n_batch: int) -> Ask:
        """What it asks of the next step: its next tokens, up to where a lone run's prefill step
        would end (a multiple of `n_batch`), the logits of its last one where that is all."""
        end = min(len(self.pending), (self.pos // n_batch + 1) * n_batch - self.pos)
        taken, self.pending = self.pending[:end], self.pending[end:]
        at, self.pos = self.pos, self.pos + len(taken)
        last = not self.pending
        return Ask(self.seq, [(t, at + i, last and i == len(taken) - 1) for i, t in enumerate(taken)])

    def sampled_one(self, now: float) -> None:
        """A token was drawn for the row at `now`."""
        self.draws += 1
        self.sampled += 1
        self._last_at = now
        if self.sampled == 1:
            self._first_at = now
            self._stats = replace(self._stats, prefill_s=now - self._started, ttft_s=now - self._started)

    def go_on(self, token: int) -> None:
        """The drawn token is the next to decode."""
        self.pending = [token]

    def stats(self) -> Stats:
        """The row's figures, its reply done."""
        s = self._stats
        return replace(s, completion_tokens=self.sampled, decode_s=self._last_at - self._first_at,
                       prefill_tokens=s.prompt_tokens - s.cached_tokens)

    def free(self) -> None:
        """The row is done (or given up): its chain freed, the sequence free for the next."""
        if self._chain is not None:
            self._chain.free()
            self._chain = None
        self.matcher = None
        self.row = -1
        self.pending = []


class BatchSession:
    """Runs rows to replies on a backend opened with several sequences."""

    def __init__(self, backend: LlamaBackend):
        if backend.rows is None:
            raise ValueError("a batch runs on a context's first backend, not on one of its sequences'")
        self.backend = backend
        self.rows: BatchRows = backend.rows
        self.n_seq = self.rows.n_seq
        self.n_ctx = backend.n_ctx  # each sequence's cells
        self.shared = 0  # tokens of the beginning every row shares, read once

    def room(self) -> int:
        """The longest prompt a row may have: its sequence's cells, less one for the reply."""
        return self.n_ctx - 1

    def run(self, rows: Sequence[BatchRow], on_token: RowTokenFn | None = None, on_done: RowDoneFn | None = None,
            should_stop: Callable[[], bool] | None = None) -> None:
        """Generates a reply for every row, in any order; `on_done` gets each as it finishes.
        Stops between steps when `should_stop()` says so (rows not finished are not reported)."""
        for i, row in enumerate(rows):
            if not row.tokens:
                raise ValueError(f"row {i} has no prompt tokens")
            if len(row.tokens) > self.room():
                raise ContextOverflow(len(row.tokens), self.n_ctx)
        if not rows:
            return
        self.rows.begin()
        self.shared = self._shared_beginning(rows)
        slots = [_Slot(seq) for seq in range(self.n_seq)]
        queue = list(range(len(rows)))
        waiting: list[Ask] = []  # what the rows ask of the steps to come, oldest first
        n_batch = self.rows.n_batch
        if self.shared:
            self._read_shared(rows[0].tokens[: self.shared], should_stop)
        try:
            while True:
                for slot in slots:
                    if slot.row < 0 and queue:
                        self._start(slot, queue.pop(0), rows)
                        waiting.append(slot.ask(n_batch))
                if not waiting:
                    break
                if should_stop is not None and should_stop():
                    raise Interrupted("stopped")
                step = self.rows.step(waiting)
                wanting = [(slots[a.seq], a.index) for a in step if a.index >= 0]
                for a in step:
                    if a.index < 0:  # (a part of a prompt: its next)
                        waiting.append(slots[a.seq].ask(n_batch))
                tokens = self.rows.sample_rows([(slot.chain, slot.matcher,
                                                 draw_seed(slot.params.draw_base, slot.draws), index)
                                                for slot, index in wanting])
                now = time.perf_counter()
                for (slot, _), token in zip(wanting, tokens, strict=False):
                    if self._took(slot, token, now, on_token, on_done):
                        waiting.append(slot.ask(n_batch))
        finally:
            for slot in slots:
                slot.free()

    # ---- steps ----------------------------------------------------------------------------

    def _shared_beginning(self, rows: Sequence[BatchRow]) -> int:
        """The beginning all rows share, short of each row's last two tokens (a row's first
        logits come from a step of its own), a multiple of four tokens: weights the CPU repacked
        are multiplied by one kernel for a step's tokens in fours and another for the rest
        (`engine/scheduler.py`), and a token is computed as in a lone run's one step where the
        shared beginning's step and the row's leave it in the same place of four."""
        if len(rows) < 2 or self.n_seq < 2:
            return 0
        shared = min(len(r.tokens) for r in rows) - OWN_TOKENS
        first = rows[0].tokens
        for row in rows[1:]:
            shared = min(shared, common_prefix(first, row.tokens))
            if shared == 0:
                break
        return max(shared - shared % 4, 0)

    def _read_shared(self, tokens: list[int], should_stop: Callable[[], bool] | None) -> None:
        n_batch = self.rows.n_batch
        for at in range(0, len(tokens), n_batch):
            self.rows.step([Ask(0, [(t, at + i, False) for i, t in enumerate(tokens[at : at + n_batch])])])
            if should_stop is not None and should_stop():
                raise Interrupted("stopped")
        for seq in range(1, self.n_seq):
            self.rows.seq_copy(0, seq)

    def _start(self, slot: _Slot, row_index: int, rows: Sequence[BatchRow]) -> None:
        row = rows[row_index]
        params = row.params.resolved()
        self.rows.seq_keep(slot.seq, self.shared)  # what the last row left, past the shared part
        chain = self.rows.row_sampler(params)
        try:
            matcher = self.rows.row_matcher(params)
        except BaseException:
            chain.free()  # (the slot never held it)
            raise
        slot.start(row_index, row, params, chain, matcher, self.shared, ReplyText(self.backend.vocab.token_bytes, b"", row.stop))

    def _took(self, slot: _Slot, token: int, now: float, on_token: RowTokenFn | None,
              on_done: RowDoneFn | None) -> bool:
        """The row's drawn token: True where the row goes on (the token its next to decode)."""
        slot.sampled_one(now)
        finish = None
        reply = slot.reply
        if self.backend.vocab.is_eog(token):
            finish = "stop"
        else:
            text = reply.push(token)
            if on_token is not None and (text or self.backend.vocab.is_control(token)):
                on_token(slot.row, token, text)  # (a control token's too: markup a reader may need)
            if reply.stopped:
                finish = "stop_sequence"
            elif slot.sampled >= slot.max_tokens:
                finish = "length"
            elif slot.pos + 1 >= self.n_ctx:
                finish = "context_full"
            else:
                slot.go_on(token)
        if finish is None:
            return True
        tail, finish = reply.end(finish)
        if tail and on_token is not None:
            on_token(slot.row, -1, tail)
        stats = slot.stats()
        gen = Generation(reply.text, reply.tokens, finish, stopped_by=reply.matched)
        row = slot.row
        slot.free()
        if on_done is not None:
            on_done(row, gen, stats)
        return False
