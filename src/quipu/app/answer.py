"""An answer: the one record of a finished reply, whichever way it was asked for (a one-shot
run, a session's turn, a chat's, a batch's row), as `--json` prints it, the log keeps it and the
chat shows it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from quipu.sessions.base import LOCAL, Capabilities, Generation, Stats

if TYPE_CHECKING:
    from quipu.engine.grammar import Grammar
    from quipu.sessions.params import SamplingParams


@dataclass
class Answer:
    text: str  # the answer; a thinking model's reasoning is apart
    finish_reason: str
    model: str
    seed: int | None
    session: str | None
    stats: Stats = field(default_factory=Stats)
    notices: list[str] = field(default_factory=list)
    reasoning: str = ""
    failure: Exception | None = None  # a server failing mid-reply: raised once the answer is out
    constrained_by: str | None = None  # which engine kept the reply to a grammar (said under --verbose)
    tool_calls: list[Any] = field(default_factory=list)  # app.tools.CallRecord: the calls run, then those left to run
    # A reply under a grammar cut (by the token limit or a full context) before the grammar was
    # done: its text will not parse.
    incomplete: bool = False
    fingerprint: str | None = None  # the model file's (a local model's), as the log keeps it
    system: str | None = None  # the system prompt the answer was given, as the log keeps it
    tokens: list[int] = field(default_factory=list)  # the reply's tokens, as generated
    logprobs: list[dict[str, Any]] | None = None  # each drawn token's log probability, where asked (`app/logprobs.py`)
    stop_sequence: str | None = None  # the stop string that ended it, where one did
    context: list[int] | None = None  # the context's tokens after it, where a server's request asks for them
    cache_written: int = 0  # the prompt's tokens whose state its turn wrote to the prompt cache

    @classmethod
    def of(cls, gen: Generation, model: str, params: SamplingParams, stats: Stats, host: Capabilities = LOCAL, *,
           session: str | None = None, notices: Sequence[str] = (), fingerprint: str | None = None,
           system: str | None = None, tool_calls: Sequence[Any] = ()) -> Answer:
        """The answer `gen` is, generated with `params` on `host` (its figures `stats`)."""
        answer = gen.text if gen.answer is None else gen.answer
        return cls(answer, gen.finish_reason, model, params.seed, session, stats, list(notices), gen.reasoning,
                   gen.error, constrained_by(params.grammar, host),
                   incomplete=cut_short(params.grammar, gen.finish_reason, answer), fingerprint=fingerprint,
                   system=system, tool_calls=list(tool_calls), tokens=list(gen.tokens),
                   stop_sequence=gen.stopped_by)

    @property
    def context_full(self) -> bool:
        """Whether the context filled up: the reply was cut there, or never began."""
        return self.finish_reason == "context_full"

    def to_json(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "reasoning": self.reasoning or None,
            "finish_reason": self.finish_reason,
            "model": self.model,
            "seed": self.seed,
            "session": self.session,
            "usage": self.stats.usage(),
            "timings": self.stats.timings(),
            **({"placement": self.stats.placement} if self.stats.placement is not None else {}),
            **({"tool_calls": [c.to_json() for c in self.tool_calls]} if self.tool_calls else {}),
            **({"incomplete": self.incomplete} if self.constrained_by is not None else {}),
        }


def cut_short(grammar: Grammar | None, finish_reason: str, text: str) -> bool:
    """Whether a reply under `grammar` (None: none) was cut, by the token limit or a full
    context, before the grammar was done: for a schema, JSON that does not parse (a reply under
    any other grammar that was cut is taken for unfinished)."""
    if grammar is None or finish_reason not in ("length", "context_full"):
        return False
    if grammar.kind != "json_schema":
        return True
    try:
        json.loads(text)
    except ValueError:
        return True
    return False


def constrained_by(grammar: Grammar | None, host: Capabilities = LOCAL) -> str | None:
    """Which engine keeps replies to `grammar` on `host`, in words (None: no grammar)."""
    if grammar is None:
        return None
    if not host.own_grammar:
        from quipu.engine.constraint import describe

        return describe(grammar)
    return f"llama-server's own grammar engine enforces the {grammar.what}"
