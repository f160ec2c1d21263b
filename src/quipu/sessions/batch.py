"""BatchSession: many prompts decoded side by side on one context, each with its own seed.

On a CPU the model's weights are read from memory once per step whatever the number of
sequences in it, so a step that decodes one token for each of several rows costs little more
than a step for one row. The context holds `n_seq` sequences (`ContextSettings.n_seq`), each
with its own share of the cells; every step decodes one token for each row being generated
and, with what room is left in the batch, the prompts of rows starting (continuous batching):
a finished row's sequence goes to the next row at once.

The beginning every row shares (a system prompt, few-shot examples) is read once, into
sequence 0, and copied to the others; a sequence keeps it when its row ends, for the next row.

Each row has its own sampler chain, penalty window, grammar (the masks of all rows under one
are computed together each step) and draws seeded by (its seed, draw index), as
`InferenceSession` does: a row's text does not depend on the other rows or on `n_seq`, up
to the floating-point differences of batched arithmetic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Sequence

from quipu.errors import ContextOverflow, Interrupted
from quipu.sessions.inference import Generation, Stats, common_prefix
from quipu.sessions.stops import ReplyText
from quipu.sessions.params import SamplingParams, draw_seed

if TYPE_CHECKING:
    from quipu.engine.constraint import Matcher
    from quipu.engine.llama import LlamaBackend
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

    def take(self, budget: int) -> list[int]:
        """The next of its tokens to decode (at most `budget`), from `pos`, which moves past them."""
        taken = self.pending[:budget]
        del self.pending[:len(taken)]
        self.pos += len(taken)
        return taken

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
        self.backend = backend
        self.n_seq = backend.context.n_seq
        self.n_ctx_seq = backend.n_ctx_seq
        self.shared = 0  # tokens of the beginning every row shares, read once

    def room(self) -> int:
        """The longest prompt a row may have: its sequence's share, less a cell for the reply."""
        return self.n_ctx_seq - 1

    def run(self, rows: Sequence[BatchRow], on_token: RowTokenFn | None = None, on_done: RowDoneFn | None = None,
            should_stop: Callable[[], bool] | None = None) -> None:
        """Generates a reply for every row, in any order; `on_done` gets each as it finishes.
        Stops between steps when `should_stop()` says so (rows not finished are not reported)."""
        for i, row in enumerate(rows):
            if not row.tokens:
                raise ValueError(f"row {i} has no prompt tokens")
            if len(row.tokens) > self.room():
                raise ContextOverflow(len(row.tokens), self.n_ctx_seq)
        if not rows:
            return
        backend = self.backend
        backend.truncate(0)
        self.shared = self._shared_beginning(rows)
        slots = [_Slot(seq) for seq in range(self.n_seq)]
        queue = list(range(len(rows)))
        if self.shared:
            self._read_shared(rows[0].tokens[: self.shared], should_stop)
        try:
            while True:
                for slot in slots:
                    if slot.row < 0 and queue:
                        self._start(slot, queue.pop(0), rows)
                active = [s for s in slots if s.row >= 0]
                if not active:
                    break
                if should_stop is not None and should_stop():
                    raise Interrupted("stopped")
                wanting = self._step(active)
                tokens = self.backend.sample_rows([(slot.chain, slot.matcher,
                                                    draw_seed(slot.params.draw_base, slot.draws), index)
                                                   for slot, index in wanting])
                now = time.perf_counter()
                for (slot, _), token in zip(wanting, tokens, strict=False):
                    self._took(slot, token, now, on_token, on_done)
        finally:
            for slot in slots:
                slot.free()

    # ---- steps ----------------------------------------------------------------------------

    def _shared_beginning(self, rows: Sequence[BatchRow]) -> int:
        """The beginning all rows share, short of each row's last two tokens: a row's first
        logits come from a decode of its own, and llama.cpp computes a decode of one token by
        another road than a decode of several (the last bits differ), while a lone run reads its
        whole prompt at once."""
        if len(rows) < 2 or self.n_seq < 2:
            return 0
        shared = min(len(r.tokens) for r in rows) - OWN_TOKENS
        first = rows[0].tokens
        for row in rows[1:]:
            shared = min(shared, common_prefix(first, row.tokens))
            if shared == 0:
                break
        return max(shared, 0)

    def _read_shared(self, tokens: list[int], should_stop: Callable[[], bool] | None) -> None:
        n_batch = self.backend.context.n_batch
        for at in range(0, len(tokens), n_batch):
            chunk = tokens[at : at + n_batch]
            self.backend.decode_batch([(t, at + i, 0, False) for i, t in enumerate(chunk)])
            if should_stop is not None and should_stop():
                raise Interrupted("stopped")
        for seq in range(1, self.n_seq):
            self.backend.seq_copy(0, seq)

    def _start(self, slot: _Slot, row_index: int, rows: Sequence[BatchRow]) -> None:
        row = rows[row_index]
        params = row.params.resolved()
        self.backend.seq_keep(slot.seq, self.shared)  # what the last row left, past the shared part
        chain = self.backend.row_sampler(params)
        try:
            matcher = self.backend.row_matcher(params)
        except BaseException:
            chain.free()  # (the slot never held it)
            raise
        slot.start(row_index, row, params, chain, matcher, self.shared, ReplyText(self.backend.token_bytes, b"", row.stop))

    def _step(self, active: list[_Slot]) -> list[tuple[_Slot, int]]:
        """One decode: a token for every row generating, then prompt tokens while there is room.
        Returns the slots whose logits are ready, with their index in the batch."""
        budget = self.backend.context.n_batch
        items: list[tuple[int, int, int, bool]] = []
        wanting: list[tuple[_Slot, int]] = []
        generating = [s for s in active if s.sampled]
        reading = [s for s in active if not s.sampled]
        for slot in generating + reading:
            if budget == 0:
                break
            at = slot.pos
            take = slot.take(budget)
            last = not slot.pending
            for i, tok in enumerate(take):
                items.append((tok, at + i, slot.seq, last and i == len(take) - 1))
            if last:
                wanting.append((slot, len(items) - 1))
            budget -= len(take)
        self.backend.decode_batch(items)
        return wanting

    def _took(self, slot: _Slot, token: int, now: float, on_token: RowTokenFn | None,
              on_done: RowDoneFn | None) -> None:
        slot.sampled_one(now)
        finish = None
        reply = slot.reply
        if self.backend.is_eog(token):
            finish = "stop"
        else:
            text = reply.push(token)
            if on_token is not None and (text or self.backend.is_control(token)):
                on_token(slot.row, token, text)  # (a control token's too: markup a reader may need)
            if reply.stopped:
                finish = "stop_sequence"
            elif slot.sampled >= slot.max_tokens:
                finish = "length"
            elif slot.pos + 1 >= self.n_ctx_seq:
                finish = "context_full"
            else:
                slot.go_on(token)
        if finish is None:
            return
        tail, finish = reply.end(finish)
        if tail and on_token is not None:
            on_token(slot.row, -1, tail)
        stats = slot.stats()
        gen = Generation(reply.text, reply.tokens, finish, stopped_by=reply.matched)
        row = slot.row
        slot.free()
        if on_done is not None:
            on_done(row, gen, stats)
