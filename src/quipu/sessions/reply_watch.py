"""What watches a local reply as its tokens come: a reasoning budget, which writes the
reasoning's close once it has taken so many tokens (`Budget`), and tools offered, whose call,
from the token that completes its trigger, keeps to the call's grammar (`CallWatch`)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from quipu.engine.base import Backend, LogitsProcessor
from quipu.sessions.call_grammars import CallGrammar
from quipu.sessions.calls import CallSink
from quipu.sessions.base import ReplySink
from quipu.sessions.reasoning import Thinking


# force(text) -> its tokens: `text` (control tokens parsed) appended to the reply as if the model
# had written it (`InferenceSession.force`).
Force = Callable[[str], list[int]]


def reply_tokens(backend: Backend, text: str) -> list[int]:
    """The tokens of `text` (control tokens parsed) as they follow a reply's text."""
    tokens = backend.vocab.tokenize(text, add_special=False, parse_special=True)
    # (A SentencePiece tokenizer puts a space before a text's start: not what follows a reply's text.)
    if len(tokens) > 1 and backend.vocab.token_text(tokens[0]) == b" " and \
            b"".join(backend.vocab.token_text(t) for t in tokens[1:]) == text.encode():
        tokens = tokens[1:]
    return tokens


class Budget:
    """A reasoning budget: once the reply's reasoning has taken so many tokens, its close (and
    what the template writes before an answer) is written as if the model had, and the model
    goes on with its answer; a budget of 0 begins the reply without reasoning."""

    def __init__(self, backend: Backend, force: Force, thinking: Thinking, held: Sequence[int] = ()):
        """`thinking` as the reply began; `held`: what the reply holds already (a reply cut and
        continued), its reasoning counted against the budget as it was when it was written."""
        assert thinking.fmt is not None and thinking.budget is not None
        self.backend, self.force, self.fmt, self.left = backend, force, thinking.fmt, thinking.budget
        self.split = thinking.splitter()
        self.inside = thinking.inside
        self.held = bool(held)
        for token in held:
            self._count(token)

    def start(self) -> list[int]:
        if self.held:  # (a reply going on: its beginning was seen to when it was written)
            return self._force(self.fmt.closes_with) if self.split.in_reasoning and self.left <= 0 else []
        if self.left > 0:
            return []
        if self.inside:
            empty = self.fmt.empty
            return self._force(empty if empty.strip().startswith(self.fmt.close) else self.fmt.closes_with)
        return self._force(self.fmt.no_reasoning)

    def _count(self, token: int) -> None:
        was = self.split.in_reasoning
        backend = self.backend
        self.split.feed(backend.vocab.token_text(token).decode("utf-8", "replace"), control=backend.vocab.is_control(token))
        if was:
            self.left -= 1

    def took(self, token: int) -> list[int]:
        self._count(token)
        if self.split.in_reasoning and self.left <= 0:
            return self._force(self.fmt.closes_with)
        return []

    def _force(self, text: str) -> list[int]:
        tokens = self.force(text)
        self.split.feed(text)
        return tokens


class CallWatch(CallSink):
    """A reply's sink while tools are offered on the local model: from the token that completes
    a call's trigger, the reply keeps to the call's grammar (llguidance's mask)."""

    def __init__(self, backend: Backend, processors: list[LogitsProcessor], force: Force, sink: ReplySink,
                 thinking: Thinking, grammar: CallGrammar, forced: bool):
        """`processors`: the reply's logits processors, which the watch joins while the reply may
        not end."""
        super().__init__(sink, grammar, thinking)
        self.backend, self.processors, self.force, self.grammar = backend, processors, force, grammar
        # A required call is forced from the start, or once the reasoning the prompt opened ends.
        # Until then the reply may not end: the end-of-generation tokens are banned.
        self.pending = forced and thinking.inside and grammar.after_reasoning is not None
        self._ends = [t for t in backend.vocab.special_tokens().values() if backend.vocab.is_eog(t)] if self.pending else []
        if self.pending:
            processors.append(self._no_end)
        elif forced:
            self._force(grammar.forced)

    def _no_end(self, tokens: Sequence[int], logits: Any) -> None:  # (a numpy array of the logits)
        logits[self._ends] = float("-inf")

    def _stop_pending(self) -> None:
        if self.pending:
            self.pending = False
            self.processors.remove(self._no_end)

    def _force(self, text: str) -> None:
        if text:
            self.force(text)
            self.watch.push(text)
        self._constrain(self.grammar.forced_lark)

    def _constrain(self, lark: str | None = None) -> None:
        from quipu.engine.grammar import Grammar

        self.begin()
        self.backend.sampling.set_constraint(Grammar("lark", lark or self.grammar.lark))

    def took(self, token: int) -> None:
        if self.calling:
            return
        spelled = self.backend.vocab.token_text(token).decode("utf-8", "replace")
        if self.watch.push(spelled, control=self.backend.vocab.is_control(token)):
            self._constrain()
        elif self.pending and (after := self.watch.after_reasoning()) is not None:
            # (what the model wrote after the reasoning's end, where it is the start of what is due)
            due = self.grammar.after_reasoning or ""
            self._stop_pending()
            self._force(due[len(after):] if due.startswith(after) else self.grammar.forced)

    def end(self) -> int | None:
        """The reply is over: where the held-back call begins in the text (None: no call began)."""
        self._stop_pending()
        if self.calling:
            self.backend.sampling.set_constraint(None)
        return super().end()
