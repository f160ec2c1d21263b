"""Conversation: messages rendered with the model's own chat template, fed incrementally."""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Sequence

from quipu.engine.base import ProgressFn
from quipu.errors import UsageError
from quipu.sessions.inference import Generation, InferenceSession, TokenFn
from quipu.sessions.template import ChatTemplate


@dataclass
class Message:
    role: str
    content: str
    # For replies: the exact tokens the model generated, so the context re-renders to itself.
    tokens: list[int] | None = None
    # For user messages: how many tokens the context held before this exchange (for /undo).
    context_before: int | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tokens is not None:
            data["tokens"] = self.tokens
        if self.context_before is not None:
            data["context_before"] = self.context_before
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Message":
        """From `to_dict`'s shape, as a checked transcript holds it."""
        return cls(data["role"], data["content"], data.get("tokens"), data.get("context_before"))


@dataclass
class Conversation:
    """Messages on an InferenceSession; each turn feeds only what is new in the context."""

    session: InferenceSession
    template: ChatTemplate
    messages: list[Message] = field(default_factory=list)

    @classmethod
    def start(cls, session: InferenceSession, system: str | None = None) -> "Conversation":
        conv = cls(session, ChatTemplate.of(session.backend))
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

    def render_tokens(self, messages: Sequence[Message], add_generation_prompt: bool) -> list[int]:
        """The context tokens for `messages`: template text parsed for special tokens, message
        text tokenized as plain text (typing `<|im_end|>` stays text), replies as generated."""
        backend = self.session.backend
        nonce = secrets.token_hex(8)
        marks = [f"\ue000{nonce}:{i}\ue001" for i in range(len(messages))]
        rendered = self.template.render(
            [{"role": m.role, "content": mark} for m, mark in zip(messages, marks)], add_generation_prompt
        )
        parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", rendered)
        tokens: list[int] = []
        for i, part in enumerate(parts):
            if i % 2 == 0:
                if part:
                    tokens += backend.tokenize(part, add_special=False, parse_special=True)
            else:
                message = messages[int(part)]
                if message.tokens is not None:
                    tokens += message.tokens
                elif message.content:
                    tokens += backend.tokenize(message.content, add_special=False, parse_special=False)
        bos = backend.bos_token()
        if bos is not None and (not tokens or tokens[0] != bos):
            tokens.insert(0, bos)
        return tokens

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
            return self._generate(Message("assistant", "", []), max_tokens, stop, on_token, on_progress)
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
            return self._generate(last if keep else Message("assistant", "", []), max_tokens, stop, on_token,
                                  on_progress)
        except BaseException:
            self.messages.append(last)
            raise

    def _generate(self, reply: Message, max_tokens: int, stop: Sequence[str], on_token: TokenFn | None,
                  on_progress: ProgressFn | None) -> Generation:
        """Brings the context to the conversation plus what `reply` holds so far (reusing what it
        can), then generates into `reply`, which joins the conversation when done."""
        prompt = self.render_tokens(self.messages, add_generation_prompt=True) + self._reply_tokens(reply)
        self.session.begin_turn()
        self.session.set_context(prompt, on_progress)
        return self._reply(reply, max_tokens, stop, on_token)

    def _reply_tokens(self, message: Message) -> list[int]:
        if message.tokens is not None:
            return list(message.tokens)
        return self.session.backend.tokenize(message.content, add_special=False, parse_special=False)

    def _reply(self, message: Message, max_tokens: int, stop: Sequence[str], on_token: TokenFn | None) -> Generation:
        before = self._reply_tokens(message)
        gen = self.session.infer(max_tokens, stop, on_token)
        self.messages.append(message)
        message.content += gen.text
        message.tokens = self._tokens_spelling(before + gen.tokens, message.content, gen.finish_reason)
        return gen

    def _tokens_spelling(self, tokens: list[int], text: str, finish_reason: str) -> list[int] | None:
        """The generated tokens behind `text`: all of them, or, where a stop string cut the text,
        the prefix that spells it exactly. None when no token boundary matches (the reply is then
        re-read from its text next turn)."""
        if finish_reason != "stop_sequence":
            return tokens
        want = text.encode("utf-8")
        spelled = b""
        for i, token in enumerate(tokens):
            if spelled == want:
                return tokens[:i]
            spelled += self.session.backend.token_bytes(token)
            if not want.startswith(spelled):
                return None
        return tokens if spelled == want else None

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
