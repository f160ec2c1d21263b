"""InferenceSession: feeds prompts, infers tokens, keeps stats. One context, one token history.

What a reply may be held to is `params.py`'s to say (grammars, biases, and a session's own
filter and processors); a session's exact state is a `snapshot.Snapshot`.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Sequence

from quipu.engine.base import Backend, LogitsProcessor, ProgressFn, TokenFilter
from quipu.engine.text import unfinished_character
from quipu.errors import ContextOverflow, EngineError, Interrupted, QuipuError
from quipu.sessions.base import LOCAL, SILENT, Generation, ReplySink, Stats, ToolOffer, TurnPrompt, common_prefix
from quipu.sessions.marks import plain_marks, reply_marks
from quipu.sessions.params import SamplingParams, draw_seed
from quipu.sessions.context_moves import ContextMoves
from quipu.sessions.prompt import Rendered, context_tokens
from quipu.sessions.reasoning import Thinking
from quipu.sessions.reply_watch import Budget, CallWatch, reply_tokens
from quipu.sessions.snapshot import Snapshot
from quipu.sessions.stops import ReplyText

__all__ = ["InferenceSession", "Snapshot", "Generation", "Stats", "common_prefix"]


class InferenceSession(ContextMoves):
    """A context on a backend and the exact token history in it.

    `tokens` is everything logically in the context; the first `n_decoded` of them are in the
    KV cache. The last sampled token stays undecoded until the next one is wanted, so a snapshot
    taken between turns can be continued exactly by decoding it on restore.
    """

    capabilities = LOCAL
    backend: Backend

    def __init__(self, backend: Backend, params: SamplingParams | None = None, *, draws: int = 0,
                 stats: Stats | None = None, held: Sequence[int] = (), borrowed: bool = False):
        """A session on an empty context; `draws`: how many draws its seed has made (a session
        read again from its transcript goes on with them); `stats`: its figures so far (the
        model's load). `held`: what an earlier session on the backend left in its context (a
        server's last request), which the first prompt may take (`take_held`); anything else
        empties it first. `borrowed`: the backend is another's (a server's slot), which closing
        this session leaves open."""
        super().__init__(backend, backend.vocab)
        self._borrowed = borrowed
        self.params = (params or SamplingParams()).resolved()
        self.n_decoded = 0
        self.draws = draws
        self._logits_at = -1  # n_decoded when the backend's logits were computed
        # The fewest tokens the context has held since it was last taken (`take_low_water`):
        # the cells before it are as they were then.
        self._low_water = 0
        self.stats = stats or Stats()
        self._turn_started = 0.0
        # Tokens re-read from the token history (not restored from state bytes) when this
        # session was made; the first turn counts them as computed, not cached.
        self.rebuilt_tokens = 0
        self._rebuilt_pending = 0
        self.reply_start = 0  # where the reply generated last began in `tokens` (set by `infer`)
        # Where this turn's context went back to, where it could not go back exactly (None: it did).
        self.went_back: str | None = None
        self.logits_processors: list[LogitsProcessor] = []
        self.token_filter: TokenFilter | None = None
        # Whether a prompt is read on from where a step of a whole read starts (a server's
        # turn: what it reads computes as a whole read of the conversation does, whichever API
        # asked), not from the last token the context holds (`set_context`).
        self.whole_read = False
        backend.sampling.set_settings(self.params)
        self._held = list(held) if held and backend.memory.positions() == len(held) else []
        if not self._held:
            backend.memory.truncate(0)  # a session starts from an empty context, whatever the backend held

    # ---- context ------------------------------------------------------------------------

    def control_spellings(self, texts: Sequence[str]) -> list[str]:
        return self.backend.vocab.control_spellings(texts)

    @property
    def checkpoints(self) -> bool:
        return True  # (a recurrent state's checkpoints, an attention cache's cuts)

    def special_tokens(self) -> dict[str, int]:
        """{text: id} of the tokens a grammar writes as themselves (control tokens, and added
        tokens spelled `<...>`), never spelled out."""
        return self.backend.vocab.special_tokens()

    def context_for(self, rendered: Rendered) -> list[int]:
        return context_tokens(self.backend, self.tokens, rendered)

    def spell(self, tokens: Sequence[int]) -> str:
        return b"".join(self.backend.vocab.token_text(t) for t in tokens).decode("utf-8", "replace")

    def close(self) -> None:
        if not self._borrowed:
            self.backend.close()

    def set_params(self, params: SamplingParams) -> None:
        """New sampling parameters; the penalty window is kept."""
        params = params.resolved()
        self.backend.sampling.set_settings(params)  # a bad grammar is refused before anything changes
        self.params = params
        self._reset_sampler()  # a new grammar applies from the next reply on

    def begin_turn(self) -> None:
        """Starts the clock and the counters of a new turn."""
        self.stats = replace(self.stats, prompt_tokens=0, cached_tokens=0, completion_tokens=0, prefill_tokens=0,
                             prefill_s=0.0, decode_s=0.0, ttft_s=0.0)
        self.went_back = None
        self._turn_started = time.perf_counter()

    def set_context(self, tokens: Sequence[int], sink: ReplySink = SILENT, marks: Sequence[int] = ()) -> int:
        """Makes the context hold exactly `tokens`, reusing the longest common prefix. Returns it.
        `marks`: where a later prompt may part from this one (see `Backend.prefill`)."""
        tokens = list(tokens)
        self._check_room(len(tokens))
        keep = common_prefix(tokens, self.tokens)
        if self.whole_read and 0 < keep < len(tokens):
            keep = self.backend.memory.step_start(keep)
        self.rewind(keep)
        # Re-read tokens were computed (their time is the restore's), not reused from a cache.
        self.stats = replace(self.stats, cached_tokens=max(0, min(keep, self.n_decoded) - self._rebuilt_pending))
        self._rebuilt_pending = 0
        sink.begins(len(tokens), self.stats.cached_tokens)
        self.feed_prompt(tokens[keep:], sink, marks)
        return keep

    def feed_prompt(self, tokens: Sequence[int], sink: ReplySink = SILENT, marks: Sequence[int] = ()) -> None:
        """Appends `tokens` to the context and decodes them (with whatever was pending)."""
        self._drop_held()
        self._check_room(len(self.tokens) + len(tokens))
        self.tokens.extend(tokens)
        self.backend.sampling.accept(tokens)
        self.stats = replace(self.stats, prompt_tokens=len(self.tokens))
        started, before = time.perf_counter(), self.n_decoded
        self._decode_pending(sink.reading, marks)
        self.stats = replace(self.stats, prefill_s=self.stats.prefill_s + time.perf_counter() - started,
                             prefill_tokens=self.stats.prefill_tokens + self.n_decoded - before)

    def check_text_fits(self, text: str) -> None:
        """Refuses at once a text too long for the context to hold whatever its tokenization,
        without tokenizing megabytes first."""
        size = len(text.encode("utf-8"))
        if size > 4 * self.n_ctx and size > self.n_ctx * self.backend.vocab.max_token_bytes():
            raise ContextOverflow(self.n_ctx, self.n_ctx, at_least=True)

    def _check_room(self, n: int) -> None:
        # One cell must stay free for the first generated token to be decoded.
        if n >= self.n_ctx:
            raise ContextOverflow(n, self.n_ctx)

    def _decode_pending(self, on_progress: ProgressFn | None = None, marks: Sequence[int] = ()) -> None:
        pending = self.tokens[self.n_decoded :]
        if not pending:
            return
        if len(pending) == 1:
            self.backend.decode_one(pending[0], self.n_decoded)
            self.n_decoded += 1
        else:
            start = self.n_decoded

            def progress(done: int, total: int) -> None:
                self.n_decoded = start + done
                if on_progress is not None and on_progress(done, total) is False:
                    raise Interrupted("stopped while reading the prompt")

            try:
                self.backend.prefill(pending, start, progress, marks)
            except Interrupted:
                del self.tokens[self.n_decoded :]
                self._logits_at = -1
                self._reset_sampler()
                raise
        self._logits_at = self.n_decoded

    # ---- snapshots ----------------------------------------------------------------------

    def snapshot(self, with_state: bool = True) -> Snapshot:
        """The exact state of this session; `with_state=False` leaves out the KV bytes."""
        return Snapshot(
            tokens=list(self.tokens),
            n_decoded=self.n_decoded,
            draws=self.draws,
            params=self.params,
            context=self.backend.context.state_key(),
            state=self.backend.memory.snapshot_bytes() if with_state else None,
        )

    @classmethod
    def from_snapshot(
        cls, backend: Backend, snap: Snapshot, on_progress: ProgressFn | None = None, *,
        stats: Stats | None = None, started: float | None = None,
    ) -> "InferenceSession":
        """A session continuing `snap` exactly. Its KV bytes are used when they were made under
        this backend's context settings; otherwise the context is re-read from its tokens.
        `stats`: its figures so far (the model's load); `started`: when its restoring began
        (`time.perf_counter`; default: now), which its restore time counts from."""
        started = time.perf_counter() if started is None else started
        session = cls(backend, snap.params, draws=snap.draws, stats=stats)
        if snap.state is not None and snap.context == backend.context.state_key():
            held = snap.n_decoded if snap.state_decoded is None else snap.state_decoded
            if snap.pieces or snap.recurrent:
                backend.memory.restore_pieces(snap.state, snap.pieces, snap.recurrent)
            else:
                backend.memory.restore_bytes(snap.state)
            backend.media.place_media(snap.tokens[:held])
            if snap.state_decoded is not None and backend.memory.positions() > held:
                backend.memory.truncate(held)  # (the state holds more than the transcript's tokens bear out)
            if backend.memory.positions() != held or held > snap.n_decoded:
                backend.memory.truncate(0)
                raise EngineError("the saved context state does not match its token history")
            session.tokens = list(snap.tokens[:held])
            session.n_decoded = session._low_water = held
            # A turn whose state was not saved is read again; a recurrent state saved as of where
            # the next turn goes back to (`save_point`) reads on from there with that turn.
            if held < snap.n_decoded and not backend.memory.recurrent:
                session.tokens = list(snap.tokens[:snap.n_decoded])
                session._decode_pending(on_progress)
                session.rebuilt_tokens = session._rebuilt_pending = snap.n_decoded - held
            session.tokens = list(snap.tokens)
            session._reset_sampler()
        else:
            session.rebuild(snap.tokens, snap.n_decoded, on_progress)
        session.stats = replace(session.stats, restore_s=time.perf_counter() - started)
        return session

    def restore_prefix(self, state: bytes | memoryview, held: Sequence[int], keep: int,
                       points: Sequence[int] = ()) -> int:
        """Takes the state of a context that held `held` (its steps ending at `points`) and keeps
        its first `keep` tokens, or as many as it can go back to (a prompt cache hit). Returns how
        many it kept; EngineError when the bytes do not fit, the context left empty."""
        started = time.perf_counter()
        self.rewind(0)
        self.backend.memory.restore_bytes(state)
        self.backend.media.place_media(held)
        if self.backend.memory.positions() != len(held):
            self.backend.memory.truncate(0)
            raise EngineError("the cached state does not match its tokens")
        keep = min(keep, len(held))
        self.backend.memory.holds_steps(points)
        self.backend.memory.truncate(keep)
        keep = min(keep, self.backend.memory.positions())
        self.tokens = list(held[:keep])
        self.n_decoded = keep
        self._logits_at = -1
        self._reset_sampler()
        self.stats = replace(self.stats, restore_s=self.stats.restore_s + time.perf_counter() - started)
        return keep

    def reused(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the context would keep for them: their common beginning, as far
        back as it can go (a recurrent state: to a checkpoint)."""
        keep = common_prefix(tokens, self.tokens)
        if keep > self.n_decoded + 1:  # (tokens held but not read yet, past a reply's last: read with the turn)
            return self.n_decoded
        return keep if keep >= self.n_decoded else self.backend.memory.rewinds_to(keep)

    def rebuild(self, tokens: Sequence[int], n_decoded: int, on_progress: ProgressFn | None = None) -> None:
        """Re-reads `tokens[:n_decoded]` into an empty context; the rest stay pending. A recurrent
        state reads them with the next prompt instead, whose marks keep the checkpoints it needs."""
        self.rewind(0)
        self._check_room(len(tokens))
        if self.backend.memory.recurrent:
            self.tokens = list(tokens)
            self._reset_sampler()
            return
        self.tokens = list(tokens[:n_decoded])
        self._decode_pending(on_progress)
        self.tokens.extend(tokens[n_decoded:])
        self._reset_sampler()
        self.rebuilt_tokens = self._rebuilt_pending = self.n_decoded

    def fork(self, backend: Backend | None = None) -> "InferenceSession":
        """An independent copy on its own context (a new one on the same model by default)."""
        other = backend if backend is not None else self.backend.reopen()
        return InferenceSession.from_snapshot(other, self.snapshot())

    # ---- generation ---------------------------------------------------------------------

    def infer_next_token(self) -> int:
        """Samples the next token (decoding what is pending first) and appends it to the history."""
        if self.n_decoded < len(self.tokens):
            self._decode_pending()
        elif self._logits_at != self.n_decoded:
            if not self.tokens:
                raise QuipuError("there is nothing in the context to continue from")
            # Restored without logits: recompute them by decoding the last token again.
            last = self.tokens[-1]
            self.rewind(len(self.tokens) - 1)
            self.tokens.append(last)
            self.backend.sampling.accept([last])
            self._decode_pending()
        token = self.backend.sampling.sample(draw_seed(self.params.draw_base, self.draws), self.tokens,
                                             self.logits_processors, self.token_filter)
        self.draws += 1
        self.tokens.append(token)
        return token

    def infer(self, max_tokens: int, stop: Sequence[str] = (), sink: ReplySink = SILENT,
              thinking: Thinking | None = None, offer: ToolOffer | None = None,
              began: Thinking | None = None, at: int | None = None) -> Generation:
        """Generates up to `max_tokens` tokens into `sink`; ends at end-of-generation, a stop
        string, a full context, or when the sink says stop ("interrupted"). `at`: where in the
        context the reply begins (default: after everything in it), what is after it being the
        reply so far: the grammar starts there, replaying it, and a reply cut inside a character
        goes on with the rest of it. `thinking`: the reply's reasoning (its format, a budget
        that closes it after so many tokens); `offer`: tools, whose call, once its trigger is
        written (or from the start, where forced), keeps to the call's grammar, its markup never
        reaching the sink. `began`: the reasoning as the reply began, where it holds some
        already (a reply continued: its budget counts what the reply's reasoning took before)."""
        thinking = thinking or Thinking()
        self.reply_start = len(self.tokens) if at is None else at
        held = self.tokens[self.reply_start:]
        self.backend.sampling.constraint_reset(held)
        carry = unfinished_character([self.backend.vocab.token_bytes(t) for t in held[-4:]])
        reply = ReplyText(self.backend.vocab.token_bytes, carry, stop)
        sampled = 0
        first_at = last_at = 0.0
        finish = "length"
        if not self._turn_started:
            self.begin_turn()
        grammar = offer.grammar if offer is not None else None
        calls = CallWatch(self.backend, self.logits_processors, self.force, sink, thinking, grammar, offer.forced) \
            if offer is not None and grammar else None
        shown = calls or sink
        budget = None
        if thinking.budget is not None and thinking.fmt is not None:
            budget = Budget(self.backend, self.force, *((began, self.tokens[self.reply_start:]) if began is not None
                                                        else (thinking,)))

        def took(token: int) -> None:
            if calls is not None:
                calls.took(token)
            text = reply.push(token)
            if text:
                shown.text(text)
            if self.backend.vocab.is_control(token):  # (markup the text does not show)
                shown.control(self.backend.vocab.token_text(token).decode("utf-8", "replace"))

        for token in budget.start() if budget is not None else ():
            took(token)
        for _ in range(max_tokens):
            if len(self.tokens) >= self.n_ctx:
                finish = "context_full"
                break
            token = self.infer_next_token()
            last_at = time.perf_counter()
            sampled += 1
            if sampled == 1:
                first_at = last_at
                self.stats = replace(self.stats, ttft_s=first_at - self._turn_started)
            if self.backend.vocab.is_eog(token):
                finish = "stop"
                break
            took(token)
            for forced in budget.took(token) if budget is not None else ():
                took(forced)
            if reply.stopped:
                finish = "stop_sequence"
                break
            if sink.stopped():
                finish = "interrupted"
                break
        tail, finish = reply.end(finish)
        if tail:
            shown.text(tail)
        shown_before_call = calls.end() if calls is not None else None
        self.stats = replace(self.stats, completion_tokens=sampled, decode_s=last_at - first_at)
        self._turn_started = 0.0
        return Generation(reply.text, reply.tokens, finish, call_shown=shown_before_call, stopped_by=reply.matched)

    def reply_spelled(self) -> str:
        """The reply just generated, control tokens spelled out (its end-of-generation token not)."""
        tokens = self.tokens[self.reply_start:]
        if tokens and self.backend.vocab.is_eog(tokens[-1]):
            tokens = tokens[:-1]
        return self.spell(tokens)

    def force(self, text: str) -> list[int]:
        """Appends `text` (control tokens parsed) to the reply as if the model had written it;
        returns its tokens."""
        tokens = reply_tokens(self.backend, text)
        self.tokens.extend(tokens)
        self.backend.sampling.accept(tokens)
        return tokens

    def complete(self, tokens: Sequence[int], max_tokens: int, stop: Sequence[str] = (),
                 sink: ReplySink = SILENT) -> Generation:
        """One turn on raw tokens: the context becomes `tokens` (reusing what it can), then infer."""
        self.begin_turn()
        self.set_context(tokens, sink, plain_marks(self.backend.vocab.token_bytes, tokens))
        return self.infer(max_tokens, stop, sink)

    def reply(self, prompt: TurnPrompt, max_tokens: int, stop: Sequence[str] = (),
              sink: ReplySink = SILENT) -> Generation:
        """Brings the context to the conversation plus what the reply holds so far (reusing what
        it can), then generates the reply."""
        tokens = self.context_for(prompt.template_text())
        # Where the reply begins: a grammar constrains the reply alone, from its first token.
        start = len(self.context_for(prompt.template_text(with_tail=False))) if prompt.tail else len(tokens)
        self.begin_turn()
        self.set_context(tokens, sink, reply_marks(self.context_for, prompt, tokens))
        began = prompt.thinking(prompt.template_text(with_tail=False).text) if prompt.tail else None
        gen = self.infer(max_tokens, stop, sink, prompt.thinking(prompt.text), prompt.offer, began, at=start)
        return replace(gen, spelled=self.reply_spelled())
