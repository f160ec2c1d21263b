"""Conversation: messages rendered with the model's own chat template, fed incrementally."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from quipu.engine.base import ProgressFn
from quipu.errors import UsageError
from quipu.sessions.inference import Generation, InferenceSession, TokenFn
from quipu.sessions.prompt import Protector, Rendered, context_tokens, reference_tokens
from quipu.sessions.template import ChatTemplate
from quipu.sessions.thinking import starts_thinking


@dataclass
class Message:
    role: str
    content: str
    # For user messages: how many tokens the context held before this exchange (for /undo).
    context_before: int | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.context_before is not None:
            data["context_before"] = self.context_before
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Message":
        """From `to_dict`'s shape, as a checked transcript holds it."""
        return cls(data["role"], data["content"], data.get("context_before"))


@dataclass
class Conversation:
    """Messages on an InferenceSession; each turn feeds only what is new in the context."""

    session: InferenceSession
    template: ChatTemplate
    messages: list[Message] = field(default_factory=list)
    # What the template is given besides the messages (`enable_thinking`, ...).
    variables: dict[str, Any] = field(default_factory=dict)
    # The text the current (or last) reply was generated after.
    prompt_text: str = ""

    @property
    def reply_starts_thinking(self) -> bool:
        """Whether the reply being generated starts inside a reasoning block its prompt opened."""
        return starts_thinking(self.prompt_text)

    @classmethod
    def start(cls, session: InferenceSession, system: str | None = None, *, template: str | None = None,
              variables: dict[str, Any] | None = None) -> "Conversation":
        """A new conversation; `template` replaces the model's own chat template."""
        conv = cls(session, ChatTemplate.of(session.backend, template), variables=dict(variables or {}))
        if system:
            conv.messages.append(Message("system", system))
        return conv

    @property
    def system(self) -> str | None:
        return self.messages[0].content if self.messages and self.messages[0].role == "system" else None

    def set_system(self, text: str | None) -> None:
        if self.system is not None:
            del self.messages[0]
        if text:
            self.messages.insert(0, Message("system", text))

    def render(self, messages: Sequence[Message], add_generation_prompt: bool, tail: str = "") -> Rendered:
        """The template's text for `messages` (and `tail`, a reply in progress), in parts that
        keep a user's spelling of a control token as text."""
        protector = Protector(self.control_texts([m.content for m in messages] + [tail]))
        shown = [{"role": m.role, "content": protector.hide(m.content)} for m in messages]
        text = self.template.render(shown, add_generation_prompt, **self.variables)
        return protector.reveal(text + protector.hide(tail))

    def control_texts(self, texts: Sequence[str]) -> list[str]:
        """The control tokens' spellings that `texts` must keep as text (every one the model has)."""
        return self.session.backend.control_texts()

    def render_tokens(self, messages: Sequence[Message], add_generation_prompt: bool) -> list[int]:
        """The context tokens for `messages` on an empty context, as the reference tokenizes them."""
        return reference_tokens(self.session.backend, self.render(messages, add_generation_prompt))

    def context_tokens(self, add_generation_prompt: bool = True, tail: str = "") -> list[int]:
        """The context tokens for the conversation (and `tail`), keeping those the context holds
        already as far as they still spell it: replies keep the tokens the model generated."""
        rendered = self.render(self.messages, add_generation_prompt, tail)
        return context_tokens(self.session.backend, self.session.tokens, rendered)

    def send(
        self,
        text: str,
        *,
        max_tokens: int,
        stop: Sequence[str] = (),
        on_token: TokenFn | None = None,
        on_progress: ProgressFn | None = None,
    ) -> Generation:
        """Adds a user message and generates the reply, which joins the conversation."""
        self.session.check_text_fits(text)
        before = len(self.session.tokens)
        self.messages.append(Message("user", text, context_before=before))
        try:
            return self._generate(Message("assistant", ""), max_tokens, stop, on_token, on_progress)
        except BaseException:
            del self.messages[-1]
            self.session.rewind(before)  # no half-read prompt stays behind
            raise

    def continue_reply(
        self,
        *,
        max_tokens: int,
        stop: Sequence[str] = (),
        on_token: TokenFn | None = None,
        on_progress: ProgressFn | None = None,
    ) -> Generation:
        """Keeps generating the last reply, as if it had never ended."""
        return self._redo_last_reply(True, max_tokens, stop, on_token, on_progress)

    def retry(
        self,
        *,
        max_tokens: int,
        stop: Sequence[str] = (),
        on_token: TokenFn | None = None,
        on_progress: ProgressFn | None = None,
    ) -> Generation:
        """Generates the last reply again, with new random draws."""
        return self._redo_last_reply(False, max_tokens, stop, on_token, on_progress)

    def _redo_last_reply(self, keep: bool, max_tokens: int, stop: Sequence[str], on_token: TokenFn | None,
                         on_progress: ProgressFn | None) -> Generation:
        if not self.messages or self.messages[-1].role != "assistant":
            raise UsageError(f"there is no reply to {'continue' if keep else 'retry'}")
        last = self.messages.pop()
        try:
            return self._generate(last if keep else Message("assistant", ""), max_tokens, stop, on_token,
                                  on_progress)
        except BaseException:
            self.messages.append(last)
            raise

    def _generate(self, reply: Message, max_tokens: int, stop: Sequence[str], on_token: TokenFn | None,
                  on_progress: ProgressFn | None) -> Generation:
        """Brings the context to the conversation plus what `reply` holds so far (reusing what it
        can), then generates into `reply`, which joins the conversation when done."""
        rendered = self.render(self.messages, True, reply.content)
        self.prompt_text = rendered.text
        prompt = context_tokens(self.session.backend, self.session.tokens, rendered)
        # Where the reply begins: a grammar constrains the reply alone, from its first token.
        start = len(self.context_tokens(True)) if reply.content else len(prompt)
        self.session.begin_turn()
        self.session.set_context(prompt, on_progress)
        self.session.start_reply(start)
        gen = self.session.infer(max_tokens, stop, on_token)
        self.messages.append(reply)
        reply.content += gen.text
        return gen

    def undo(self) -> bool:
        """Drops the last exchange (the last user message and what followed it) and returns the
        context to exactly what it held before it: a rewind, nothing is re-read."""
        for i in range(len(self.messages) - 1, -1, -1):
            if self.messages[i].role == "user":
                before = self.messages[i].context_before
                del self.messages[i:]
                if before is not None:
                    self.session.rewind(before)
                return True
        return False

    def reset(self) -> None:
        """Forgets the conversation, keeping the system prompt."""
        del self.messages[1 if self.system is not None else 0 :]

    def size_alone(self, text: str) -> tuple[int, int]:
        """(tokens `text` takes as a user message, tokens of everything around it) in a
        conversation of nothing but the system prompt and this message."""
        head = [m for m in self.messages[:1] if m.role == "system"]
        empty = len(self.render_tokens(head + [Message("user", "")], add_generation_prompt=True))
        full = len(self.render_tokens(head + [Message("user", text)], add_generation_prompt=True))
        return full - empty, empty

    def drop_oldest(self, keep_free: int) -> int:
        """Drops the oldest exchanges (never the system prompt) until the conversation leaves at
        least `keep_free` tokens of the context free. Returns how many messages went."""
        first = 1 if self.system is not None else 0
        dropped = 0
        while len(self.messages) > first:
            needed = len(self.render_tokens(self.messages, add_generation_prompt=True))
            if needed + keep_free <= self.session.n_ctx:
                break
            del self.messages[first]
            while len(self.messages) > first and self.messages[first].role != "user":
                del self.messages[first]
                dropped += 1
            dropped += 1
        for m in self.messages:
            m.context_before = None  # the context is re-read from here; old marks mean nothing
        return dropped
