"""The log probability of each token a reply draws, under the model (its logits' log-softmax,
before a grammar, a penalty or the temperature shape them), with the likeliest tokens beside it:
what an OpenAI-style request's `logprobs` asks for. Recorded by a logits processor that sees the
logits first and changes nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from quipu.app.answer import Answer
from quipu.sessions.base import PassedOn, ReplySink

if TYPE_CHECKING:
    from quipu.engine.base import Backend
    from quipu.sessions.inference import InferenceSession


class Logprobs:
    """A logits processor (`InferenceSession.logits_processors`, first) that records, for each
    draw, the log-softmax of the logits; what was drawn is read from the history at the next
    draw (`done`, after the last)."""

    def __init__(self, top: int):
        self.top = top
        self.drawn: list[tuple[int, float, list[tuple[int, float]]]] = []  # (token, logprob, likeliest)
        self._pending: list[tuple[int, Any, list[tuple[int, float]]]] = []  # (where its token goes, log-softmax, likeliest)

    def __call__(self, history: Sequence[int], logits: Any) -> None:
        import numpy as np

        self.done(history)
        finite = logits[np.isfinite(logits)]
        if not finite.size:
            return
        peak = float(finite.max())
        lsm = logits - (peak + float(np.log(np.exp(finite - peak).sum())))
        top: list[tuple[int, float]] = []
        if self.top:
            ids = np.argpartition(-lsm, min(self.top, lsm.size - 1))[:self.top]
            top = sorted(((int(i), float(lsm[i])) for i in ids), key=lambda pair: -pair[1])
        self._pending.append((len(history), lsm.astype(np.float32), top))

    def done(self, history: Sequence[int]) -> None:
        """Reads what was drawn at each draw recorded whose token `history` holds now."""
        while self._pending and self._pending[0][0] < len(history):
            at, lsm, top = self._pending.pop(0)
            token = history[at]
            self.drawn.append((token, float(lsm[token]), top))

    @staticmethod
    def spelled(backend: Backend, drawn: Sequence[tuple[int, float, list[tuple[int, float]]]]
                ) -> list[dict[str, Any]]:
        """Drawn tokens in the OpenAI chat API's shape: each one's text, bytes, log probability
        and the likeliest tokens beside it."""
        def spelled(token: int, logprob: float) -> dict[str, Any]:
            raw = backend.vocab.token_bytes(token)
            return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}

        return [{**spelled(token, logprob), "top_logprobs": [spelled(t, lp) for t, lp in top]}
                for token, logprob, top in drawn if not backend.vocab.is_eog(token)]  # (the end is no text)


class Recorded(PassedOn):
    """A reply's sink (`sink`) with the log probabilities of the tokens `session` draws given
    before each piece that holds them (`ReplySink.logprobs`), as OpenAI streams them; `finish`
    puts them all in the answer."""

    def __init__(self, sink: ReplySink, session: InferenceSession, top: int):
        super().__init__(sink)
        self.session = session
        self.recorder = Logprobs(top)
        self._given = 0
        session.logits_processors.insert(0, self.recorder)  # (first: the model's own logits)

    def _flush(self) -> None:
        self.recorder.done(self.session.tokens)
        new = self.recorder.drawn[self._given:]
        if new:
            self._given = len(self.recorder.drawn)
            self.sink.logprobs(self.recorder.spelled(self.session.backend, new))

    def text(self, piece: str) -> None:
        self._flush()
        super().text(piece)

    def reasoning(self, piece: str) -> None:
        self._flush()
        super().reasoning(piece)

    def finish(self, answer: Answer) -> Answer:
        """`answer` with every drawn token's log probability; those no piece carried yet go to the sink."""
        self._flush()
        self.session.logits_processors.remove(self.recorder)
        answer.logprobs = self.recorder.spelled(self.session.backend, self.recorder.drawn)
        return answer
