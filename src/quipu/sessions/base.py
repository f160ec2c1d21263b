"""What every model session is, wherever its model runs: the `ModelSession` protocol, what a
session can do (`Capabilities`, the one table every refusal comes from), where a reply goes as
it is generated (`ReplySink`), and the plain values a turn passes around (`Message`,
`TurnPrompt`, `Generation`, `Stats`).

Three sessions implement the protocol, and everything above them (`Conversation`, the named
sessions and the chat in `quipu.app`) is written once against it:

- `InferenceSession` (`inference.py`): a local llama.cpp context, exact tokens, KV snapshots.
- `LlamaServerSession` (`llama_server.py`): a context on llama.cpp's llama-server driven by
  token arrays, exact tokens, seeded per draw.
- `ChatApiSession` (`chat_api.py`): any OpenAI-compatible chat API; the context is the message
  list, which the server renders and tokenizes itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence, cast

from quipu.errors import CapabilityError
from quipu.options import FEATURES

if TYPE_CHECKING:
    from quipu.sessions.params import SamplingParams
    from quipu.sessions.prompt import Rendered
    from quipu.sessions.call_grammars import CallGrammar
    from quipu.sessions.reasoning import ReasoningFormat, Thinking


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many tokens (or other items) `a` and `b` begin with alike."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class Message:
    role: str  # system, user, assistant, or tool (a tool's result)
    content: str
    # For user messages: how many tokens the context held before this exchange (for /undo).
    context_before: int | None = None
    # An assistant's calls, in OpenAI's shape ({"id"?, "type": "function", "function": {"name",
    # "arguments": a dict}}); a tool message's call id and tool name.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    # An assistant's reasoning, apart from its answer (`content`); and the reply as its model wrote
    # it, markup and control tokens spelled, where that is more than the two (what a
    # continuation goes on from).
    reasoning: str | None = None
    spelled: str | None = None
    # For user messages: how many random draws the seed had made before this exchange (a branch
    # that goes on from before it draws as the conversation did then); and, where fewer than
    # `context_before`, how many of those tokens had been read (the reply's last token is read
    # with the next prompt: going back, it is again).
    draws_before: int | None = None
    decoded_before: int | None = None
    # For a reply: its id in the log of answers, which the next exchange's answer follows up.
    logged: int | None = None

    def to_dict(self) -> dict[str, Any]:
        data = self.for_template(self.content)
        for key in ("reasoning", "spelled", "context_before", "draws_before", "decoded_before", "logged"):
            if getattr(self, key) is not None:
                data[key] = getattr(self, key)
        return data

    @property
    def written(self) -> str:
        """The reply as its model wrote it (its content, where nothing more is known)."""
        return self.spelled if self.spelled is not None else self.content

    def for_template(self, content: str) -> dict[str, Any]:
        """The message as a chat template is given it (`content` as the template is to see it)."""
        data: dict[str, Any] = {"role": self.role, "content": content}
        data.update((key, getattr(self, key)) for key in ("tool_calls", "tool_call_id", "name")
                    if getattr(self, key) is not None)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Message":
        """From `to_dict`'s shape, as a checked transcript holds it."""
        return cls(data["role"], data["content"], data.get("context_before"), data.get("tool_calls"),
                   data.get("tool_call_id"), data.get("name"), data.get("reasoning"), data.get("spelled"),
                   data.get("draws_before"), data.get("decoded_before"), data.get("logged"))


class ReplySink:
    """Where a reply goes while it is generated, one object a turn: the answer's text, a thinking
    model's reasoning, the progress of reading the prompt. `stopped()` is asked after every token
    and every batch of the prompt, and is the one way to stop a reply: a reply stopped while its
    prompt is read ends in `Interrupted` (there is nothing to show), one stopped later ends with
    what came, finish reason "interrupted". Override what you need; the rest does nothing."""

    def text(self, piece: str) -> None:
        pass

    def reasoning(self, piece: str) -> None:
        pass

    def control(self, spelling: str) -> None:
        """A control token the model wrote, which the text does not show (markup a reader of
        the reply's format may need: `<|channel|>`, `<|END_THINKING|>`)."""

    def progress(self, done: int, total: int) -> None:
        pass

    def begins(self, prompt_tokens: int, cached_tokens: int) -> None:
        """The prompt is laid out and fits: `prompt_tokens` in all, `cached_tokens` of them
        restored rather than read; its reading begins."""

    def logprobs(self, entries: list[dict[str, Any]]) -> None:
        """The log probabilities of the tokens drawn since the last piece, given before the
        piece that holds them (where a request asked for them: `app/logprobs.py`)."""

    def stopped(self) -> bool:
        return False

    def seen(self, answer: str) -> str:
        """Where a reply was stopped, how much of its answer (`answer`, whole so far) its reader
        saw: what is kept of it (all of it, unless the sink held some back)."""
        return answer

    def reading(self, done: int, total: int) -> bool:
        """Progress of reading a prompt, and whether to go on: what the engine's prefill asks."""
        self.progress(done, total)
        return not self.stopped()


SILENT = ReplySink()


class PassedOn(ReplySink):
    """A sink that passes everything on to another (`sink`): the base of those that change a
    part of a reply on its way (held back, split, recorded), which override only that part."""

    def __init__(self, sink: ReplySink):
        self.sink = sink

    def text(self, piece: str) -> None:
        self.sink.text(piece)

    def reasoning(self, piece: str) -> None:
        self.sink.reasoning(piece)

    def control(self, spelling: str) -> None:
        self.sink.control(spelling)

    def progress(self, done: int, total: int) -> None:
        self.sink.progress(done, total)

    def begins(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.sink.begins(prompt_tokens, cached_tokens)

    def logprobs(self, entries: list[dict[str, Any]]) -> None:
        self.sink.logprobs(entries)

    def stopped(self) -> bool:
        return self.sink.stopped()

    def seen(self, answer: str) -> str:
        return self.sink.seen(answer)


@dataclass(frozen=True)
class Stats:
    """Figures of the last turn (load and restore are the session's, reported with each turn)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prefill_tokens: int = 0  # decoded by this turn's prefill (neither reused nor restored)
    load_s: float = 0.0
    restore_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    ttft_s: float = 0.0
    # Where the model runs (a local one's backend, devices and layers, and its summary in words).
    placement: dict[str, Any] | None = None

    @property
    def prefill_tok_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        # The first token comes from the prefill's logits; each one after it costs a decode.
        return (self.completion_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def timings(self) -> dict[str, float]:
        return {
            "load_s": round(self.load_s, 4),
            "restore_s": round(self.restore_s, 4),
            "prefill_s": round(self.prefill_s, 4),
            "decode_s": round(self.decode_s, 4),
            "ttft_s": round(self.ttft_s, 4),
            "prefill_tok_s": round(self.prefill_tok_s, 2),
            "decode_tok_s": round(self.decode_tok_s, 2),
        }

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }


@dataclass(frozen=True)
class Generation:
    """What one reply produced: the text shown, the tokens sampled, and why it ended; the
    answer and a thinking model's reasoning apart (a `Conversation` splits them)."""

    text: str
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    # What cut it short, when something failed mid-reply (a server): the reply is kept as an
    # interrupted one, and the error raised once it is saved.
    error: Exception | None = None
    answer: str | None = None  # None: all of `text`
    reasoning: str = ""
    # The whole reply (a continued one's start included) as its model wrote it, control tokens
    # spelled, where the session knows its tokens.
    spelled: str | None = None
    tool_calls: list[Any] = field(default_factory=list)  # the calls the reply made (`sessions.tools.ToolCall`)
    # Where a reply began a call (held back from the sink): how much of its text was shown.
    call_shown: int | None = None
    stopped_by: str | None = None  # the stop string that ended it (finish_reason "stop_sequence")


# ---- what a session can do -------------------------------------------------------------------

def refusal_words(named: str, where: str) -> str:
    """The one wording of a refusal, for a host's (`Capabilities`) and a mode's (`app/modes.py`)."""
    return f"{named} cannot be used with {where}"


@dataclass(frozen=True)
class Capabilities:
    """What a kind of session can do, declared once; every refusal's words come from here."""

    kind: str  # "local", "llama-server", "chat-api"
    features: frozenset[str]
    where: str  # how a refusal names it: "... cannot be used with {where}"
    exact_tokens: bool  # the context is kept as exact tokens: a reply is never read again
    context_size: bool  # the context's size is known here (else it is the server's own)
    # The server keeps a reply to a grammar with its own engine (a GBNF grammar goes to it as
    # text, quipu checking only its depth); else quipu's (llguidance) does.
    own_grammar: bool = False

    def can(self, feature: str) -> bool:
        return feature in self.features

    def require(self, feature: str, *, chat: bool = False) -> None:
        """Refuses, in one line, what this kind of session cannot do."""
        if feature not in self.features:
            raise self.refusal(feature, chat=chat)

    def refusal(self, feature: str, *, chat: bool = False) -> CapabilityError:
        """The one line that refuses `feature` here."""
        return CapabilityError(refusal_words(FEATURES[feature][1 if chat else 0], self.where))


_ALL = frozenset(FEATURES)
LOCAL = Capabilities("local", _ALL - {"slot_files"}, "a local model", exact_tokens=True, context_size=True)
LLAMA_SERVER = Capabilities("llama-server", _ALL - {"context_settings", "prompt_cache", "state_files",
                                                    "reasoning_budget"},
                            "a server", exact_tokens=True, context_size=True, own_grammar=True)
CHAT_API = Capabilities("chat-api", frozenset({"tools", "media"}), "this server (only llama.cpp's llama-server takes it)",
                        exact_tokens=False, context_size=False)


# ---- a turn ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolOffer:
    """The tools a reply may call. A session that reads calls itself (a local model,
    llama-server) holds a call to `grammar` once its trigger is written (from the start where
    `forced`); a chat API's server is given `tools` and `choice`, renders them and reads the calls."""

    grammar: "CallGrammar | None" = None
    forced: bool = False
    tools: tuple[Any, ...] = ()  # `sessions.tools.ToolSpec`s
    choice: str = "auto"


@dataclass(frozen=True)
class TurnPrompt:
    """What a reply is generated after: the conversation's messages, what the reply holds
    already (`tail`: a reply being continued), and, for the sessions that do not render it
    themselves (a chat API's server renders its own), the template's text of it, rendered."""

    messages: Sequence[Message]
    tail: str = ""
    rendered: "Rendered | None" = None  # the template's text the reply follows, the tail included
    head: "Rendered | None" = None  # the same without the tail (a reply going on; else None)
    # Where a later prompt may part from this one (a session whose context keeps checkpoints
    # there asks for them, `TokenSession.checkpoints`): the conversation as a later prompt
    # begins, rendered (`marks.py`).
    parts: tuple["Rendered", ...] = ()
    # How the reply's reasoning is written (None: it has none quipu reads), and at most how many
    # tokens it may take (None: no limit; 0: none).
    reasoning: "ReasoningFormat | None" = None
    budget: int | None = None
    offer: "ToolOffer | None" = None  # the tools the reply may call

    def thinking(self, text: str) -> "Thinking":
        """The reply's reasoning, for a reply that follows `text` (its rendering)."""
        from quipu.sessions.reasoning import Thinking

        fmt = self.reasoning
        return Thinking(fmt, fmt is not None and fmt.starts_inside(text), self.budget)

    def template_text(self, with_tail: bool = True) -> "Rendered":
        """The template's text the reply follows (with what it holds already, or without)."""
        if self.rendered is None:
            raise CapabilityError("this conversation has no chat template to render")
        return self.head if not with_tail and self.head is not None else self.rendered

    @property
    def text(self) -> str:
        """The text the reply follows ("" where the server renders the conversation)."""
        return self.rendered.text if self.rendered is not None else ""


class ModelSession(Protocol):
    """A model's context and what it can do next, wherever the model runs: what every session
    does. What only a session that holds its context's exact tokens does (a local model's,
    llama-server's) is `TokenSession`'s, reached by its declared capability (`holding_tokens`)."""

    capabilities: Capabilities
    params: "SamplingParams"
    stats: Stats
    draws: int

    @property
    def n_ctx(self) -> int:
        """The context's size in tokens (0: unknown, the server's own)."""

    @property
    def used(self) -> int:
        """How many tokens the context holds (a chat API: as the last reply counted them)."""

    def set_params(self, params: "SamplingParams") -> None: ...

    def check_text_fits(self, text: str) -> None:
        """Refuses at once a text too long for the context whatever its tokenization."""

    def reply(self, prompt: TurnPrompt, max_tokens: int, stop: Sequence[str], sink: ReplySink) -> Generation:
        """Brings the context to `prompt` (reading only what is new) and generates the reply."""

    def rewind(self, n_keep: int) -> None:
        """Forgets the context from token `n_keep` on (where it holds no tokens: nothing)."""

    def close(self) -> None: ...


class TokenSession(ModelSession, Protocol):
    """A session that holds its context's exact tokens (`Capabilities.exact_tokens`): a local
    model's, llama-server's. Its template, tokenizer and tokens are quipu's to read."""

    @property
    def tokens(self) -> list[int]:
        """The context's exact tokens."""

    @property
    def n_decoded(self) -> int:
        """How many of the context's tokens its cache holds."""

    def chat_template(self) -> str | None:
        """The model's own chat template (None: none)."""

    def special_token_text(self, which: str) -> str: ...

    def special_tokens(self) -> Mapping[str, int]:
        """{spelling: id} of the tokens a grammar writes as themselves (control tokens, added
        tokens spelled `<...>`)."""

    @property
    def checkpoints(self) -> bool:
        """Whether its context keeps checkpoints where a later prompt may part from this one (a
        hybrid model's recurrent memory, which cannot go back a token): a prompt then carries
        where (`TurnPrompt.parts`)."""

    def control_spellings(self, texts: Sequence[str]) -> list[str]:
        """The control tokens' spellings `texts` hold, which a user's text must keep as text."""

    def context_for(self, rendered: "Rendered") -> list[int]:
        """The context tokens for `rendered`, keeping those the context holds where they still spell it."""

    def reference_tokens(self, rendered: "Rendered") -> list[int]:
        """The tokens of `rendered` on an empty context."""

    def raw_tokens(self, text: str) -> list[int]:
        """A plain completion's prompt, with the model's BOS."""

    def reused(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the context would keep rather than read (their common beginning,
        as far back as the context can go)."""

    def spell(self, tokens: Sequence[int]) -> str:
        """Tokens as text, control tokens written out: what the model sees."""

    def complete(self, tokens: Sequence[int], max_tokens: int, stop: Sequence[str], sink: ReplySink) -> Generation:
        """A plain completion of `tokens` (`--raw`)."""

    def undecode(self, n: int) -> None:
        """Keeps the tokens from `n` on but not their cells: they are read with the next prompt."""

    def shift_out(self, start: int, end: int) -> bool:
        """Drops tokens [start, end) from the context, moving the cells after them down (as
        llama.cpp's context shift); False where it cannot (the caller reads the rest again)."""


def holding_tokens(session: ModelSession) -> TokenSession | None:
    """The session as one that holds its context's tokens, where its capabilities say it does;
    None where the server keeps them (a chat API)."""
    return cast("TokenSession", session) if session.capabilities.exact_tokens else None


def token_session(session: ModelSession, feature: str) -> TokenSession:
    """The session as one that holds its context's tokens; where it does not, `feature` is
    refused in its one line (what needs them: --show-prompt, --raw)."""
    held = holding_tokens(session)
    if held is None:
        raise session.capabilities.refusal(feature)
    return held
