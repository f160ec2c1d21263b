"""Conversation: messages rendered with the model's own chat template, fed incrementally."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from quipu.engine.base import defuse
from quipu.errors import CapabilityError, TemplateError, UsageError
from quipu.sessions.base import (SILENT, Generation, Message, ModelSession, ReplySink, TokenSession, TurnPrompt,
                                 common_prefix, holding_tokens, token_session)
from quipu.sessions.prompt import Protector, Rendered, hidden, strings_of
from quipu.sessions.template import ChatTemplate
from quipu.sessions.reasoning import BY_DEFAULT, ReasoningFormat
from quipu.sessions.reasoning_sink import ReasoningSink
from quipu.sessions.marks import parting
from quipu.sessions.tool_turns import TurnSettings, offer_tools, read_calls, tool_format
from quipu.sessions.tools import Format, generic_system_prompt
from quipu.sessions.toolspec import ToolCall

__all__ = ["Conversation", "Message", "TurnSettings", "EFFORTS"]

EFFORTS = ("low", "medium", "high")


@dataclass
class Conversation:
    """Messages on a `ModelSession`, one class for every kind of session: send, retry,
    continue, undo, reset, drop the oldest exchanges, the system prompt. Each turn reads only
    what is new in the context. The template renders the messages where the session takes
    tokens; a chat API's server renders them itself (`template` is None). `settings`: what its
    replies are given besides the messages (the tools, the reasoning budget, the template's
    variables), changed by `update`; a turn may be given its own (`turn`)."""

    session: ModelSession
    template: ChatTemplate | None
    messages: list[Message] = field(default_factory=list)
    settings: TurnSettings = field(default_factory=TurnSettings)
    # The session as one that holds its context's tokens, where it does (not a chat API's).
    held: TokenSession | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.held = holding_tokens(self.session)

    @classmethod
    def start(cls, session: ModelSession, system: str | None = None, *, template: str | None = None,
              messages: Sequence[Message] = (), settings: TurnSettings | None = None) -> "Conversation":
        """A conversation on `session` (new, or of `messages`); `template` replaces the model's own
        chat template."""
        conv = cls(session, cls.template_for(session, template), list(messages), settings or TurnSettings())
        if system is not None:
            conv.set_system(system)
        return conv

    def update(self, **changes: Any) -> None:
        """The replies that follow are given these settings (`TurnSettings`' fields)."""
        self.settings = self.settings.but(**changes)

    @property
    def tool_format(self) -> Format:
        return tool_format(self.template)

    @staticmethod
    def template_for(session: ModelSession, source: str | None) -> ChatTemplate | None:
        """`source`, else the model's own template (ChatML when it has none); None where the
        server renders the conversation."""
        held = holding_tokens(session)
        if held is None or not session.capabilities.can("chat_template"):
            return None
        return ChatTemplate(source or held.chat_template(), held.special_token_text("bos"),
                            held.special_token_text("eos"))

    @property
    def tokens_side(self) -> TokenSession:
        """The session's tokens, tokenizer and template; refused where the server keeps them."""
        return token_session(self.session, "show_prompt")

    def set_reasoning(self, *, effort: str | None = None, budget: int | None = None, chat: bool = False) -> None:
        """How the model reasons in the next replies: `effort` (the template's `reasoning_effort`:
        low, medium, high), `budget` (at most so many tokens of reasoning; 0: none; -1: no limit).
        Refused in one line where the template or the session cannot do it."""
        if effort is not None:
            self.session.capabilities.require("think", chat=chat)
            if effort not in EFFORTS:
                raise UsageError(f"the reasoning effort must be {', '.join(EFFORTS)}; got {effort!r}")
            if self.template is None or "reasoning_effort" not in self.template.source:
                raise UsageError("this model's chat template takes no reasoning effort")
            self.update(variables={**self.settings.variables, "reasoning_effort": effort})
        if budget is not None:
            self.session.capabilities.require("reasoning_budget", chat=chat)
            if budget < -1:
                raise UsageError(f"the reasoning budget must be 0 or more (-1: no limit); got {budget}")
            if budget >= 0 and (self.template is None or self.template.reasoning is None):
                raise UsageError("this model's chat template writes no reasoning that quipu knows how to limit")
            self.update(reasoning_budget=None if budget == -1 else budget)

    @property
    def reasoning(self) -> ReasoningFormat | None:
        """How the model's template writes a reply's reasoning (`<think>` where it shows none;
        None where the server renders the conversation and splits the reply itself)."""
        if self.template is None:
            return None
        return self.template.reasoning or BY_DEFAULT

    @property
    def without_template(self) -> bool:
        """Whether the model has no chat template of its own, nor was it given one (ChatML stands in)."""
        return self.template is not None and self.template.is_fallback

    @property
    def folds_system(self) -> bool:
        return self.template is not None and self.template.folds_system

    @property
    def system(self) -> str | None:
        return self.messages[0].content if self.messages and self.messages[0].role == "system" else None

    def set_system(self, text: str | None) -> None:
        if self.system is not None:
            del self.messages[0]
        if text:
            self.messages.insert(0, Message("system", text))

    def extend(self, earlier: Sequence[Message]) -> None:
        """Gives a conversation that holds no exchange yet earlier ones (a follow-up's)."""
        if any(m.role != "system" for m in self.messages):
            raise ValueError("a conversation's earlier exchanges go in before its own")
        self.messages.extend(earlier)

    def render(self, messages: Sequence[Message], add_generation_prompt: bool, tail: str = "",
               turn: TurnSettings | None = None) -> Rendered:
        """The template's text for `messages` (and `tail`, a reply in progress), in parts that
        keep a user's spelling of a control token as text; with `turn`'s settings (default: the
        conversation's)."""
        template = self.template
        if template is None:
            raise self.session.capabilities.refusal("show_prompt")
        turn = turn or self.settings
        # Every text from outside (a tool's definition, a call's arguments) is data, never markup.
        defined = [tool.to_openai() for tool in turn.tools]
        calls = [m.tool_calls for m in messages if m.tool_calls]
        texts = [m.content for m in messages] + [tail] + list(strings_of(defined)) + list(strings_of(calls))
        self.session.check_text_fits("".join(texts))  # (refused before a tokenizer sees megabytes)
        protector = Protector(self.tokens_side.control_spellings(texts))
        # A user's, a tool's or a system prompt's spelling of a control token stays text; a reply
        # is the model's own, whose markup (a call's, reasoning's) is the tokens it wrote, and
        # whose calls' arguments are data the grammar kept to text.
        fmt = self.reasoning
        shown = [_shown(m, protector, fmt) for m in messages]
        variables = dict(turn.variables)
        if turn.reasoning_budget == 0 and "enable_thinking" not in variables and \
                "enable_thinking" in template.source:
            variables["enable_thinking"] = False  # (no reasoning: the template's own switch first)
        if turn.tools:
            if self.tool_format.generic and "tools" not in template.source:
                # the template cannot tell the model of them: the system prompt does
                told = protector.hide(generic_system_prompt(list(turn.tools)))
                if shown and shown[0]["role"] == "system":
                    shown[0] = {**shown[0], "content": f"{shown[0]['content']}\n\n{told}"}
                else:
                    shown.insert(0, {"role": "system", "content": told})
            else:
                variables["tools"] = hidden(defined, protector.hide)
        text = template.render(shown, add_generation_prompt, **variables)
        return protector.reveal(text + protector.hide(defuse(tail)))

    def render_tokens(self, messages: Sequence[Message], add_generation_prompt: bool) -> list[int]:
        """The context tokens for `messages` on an empty context, as the reference tokenizes them."""
        return self.tokens_side.reference_tokens(self.render(messages, add_generation_prompt))

    def context_tokens(self, add_generation_prompt: bool = True, tail: str = "") -> list[int]:
        """The context tokens for the conversation (and `tail`), keeping those the context holds
        already as far as they still spell it: replies keep the tokens the model generated."""
        return self.tokens_side.context_for(self.render(self.messages, add_generation_prompt, tail))

    def continued_tokens(self) -> list[int]:
        """The context tokens `continue_reply` reads: the conversation before its last reply, then
        that reply as its model wrote it (its reasoning too)."""
        if not self.messages or self.messages[-1].role != "assistant":
            raise UsageError("there is no reply to continue")
        last = self.messages[-1]
        return self.tokens_side.context_for(self.render(self.messages[:-1], True, self._written(last)))

    @staticmethod
    def _written(reply: Message) -> str:
        """What a reply that goes on is read after: what it holds so far, as its model wrote it."""
        return reply.written if reply.content or reply.reasoning else ""

    def tokens_with(self, text: str) -> list[int]:
        """The context tokens the conversation would have with `text` as the next user message."""
        self.messages.append(Message("user", text))
        try:
            return self.context_tokens()
        finally:
            self.messages.pop()

    def kept_by_next_turn(self) -> int:
        """How many of the context's tokens the next user message's prompt begins with: a
        template that leaves a reply's reasoning out once another message follows parts before
        it (where a context whose state cannot go back a token is saved, `StateFile.save`)."""
        try:
            return common_prefix(self.tokens_with("?"), self.tokens_side.tokens)
        except (TemplateError, CapabilityError):
            return len(self.tokens_side.tokens)

    def send(self, text: str, *, max_tokens: int, stop: Sequence[str] = (), sink: ReplySink = SILENT,
             turn: TurnSettings | None = None) -> Generation:
        """Adds a user message and generates the reply, which joins the conversation. Every turn
        is given `turn`'s settings (default: the conversation's)."""
        self.session.check_text_fits(text)
        tokens = self.held
        before = tokens.used if tokens is not None else None
        decoded = tokens.n_decoded if tokens is not None else None
        held = list(tokens.tokens) if tokens is not None else []
        user = Message("user", text, context_before=before, draws_before=self.session.draws)
        at = len(self.messages)
        self.messages.append(user)
        try:
            gen = self._generate(Message("assistant", ""), max_tokens, stop, sink, turn)
        except BaseException:
            del self.messages[-1]
            self.session.rewind(before or 0)  # no half-read prompt stays behind
            raise
        if tokens is not None and before is not None:
            # The turn may have read the end of the last reply again (where the template's text
            # after it tokenizes with it, as with no markup of the model's own): the context is
            # as it was only up to there, and an /undo goes back to that point.
            kept = min(before, common_prefix(held, tokens.tokens))
            self.messages[at] = replace(user, context_before=kept,
                                        decoded_before=decoded if decoded is not None and decoded < kept else None)
        return gen

    def continue_reply(self, *, max_tokens: int, stop: Sequence[str] = (), sink: ReplySink = SILENT,
                       turn: TurnSettings | None = None) -> Generation:
        """Keeps generating the last reply, as if it had never ended."""
        self.session.capabilities.require("continue")
        return self._redo_last_reply(True, max_tokens, stop, sink, turn)

    def retry(self, *, max_tokens: int, stop: Sequence[str] = (), sink: ReplySink = SILENT,
              turn: TurnSettings | None = None) -> Generation:
        """Generates the last reply again, with new random draws."""
        return self._redo_last_reply(False, max_tokens, stop, sink, turn)

    def _redo_last_reply(self, keep: bool, max_tokens: int, stop: Sequence[str], sink: ReplySink,
                         turn: TurnSettings | None) -> Generation:
        if not self.messages or self.messages[-1].role != "assistant":
            raise UsageError(f"there is no reply to {'continue' if keep else 'retry'}")
        last = self.messages.pop()
        try:
            return self._generate(last if keep else Message("assistant", ""), max_tokens, stop, sink, turn)
        except BaseException:
            self.messages.append(last)  # the exchange stays as it was
            raise

    def _parts(self, settings: TurnSettings) -> tuple[Rendered, ...]:
        """The conversations a later prompt may begin as (`marks.parting`), rendered; one the
        template refuses (a conversation it takes only whole) is no place to part."""
        parts = []
        for messages in parting(self.messages):
            try:
                parts.append(self.render(messages, False, "", settings))
            except TemplateError:
                continue
        return tuple(parts)

    def _generate(self, reply: Message, max_tokens: int, stop: Sequence[str], sink: ReplySink,
                  turn: TurnSettings | None) -> Generation:
        """Generates into `reply` after the conversation (and what `reply` holds so far), which
        joins the conversation when done; the answer and a thinking model's reasoning apart, and
        the tool calls it made."""
        settings = turn or self.settings
        fmt = self.reasoning
        tail = self._written(reply)
        bare = TurnPrompt(self.messages, tail, reasoning=fmt, budget=settings.reasoning_budget)
        if self.template is not None:  # (the session is given the prompt rendered)
            wanted = self.held is not None and self.held.checkpoints
            bare = replace(bare, rendered=self.render(self.messages, True, tail, settings),
                           head=self.render(self.messages, True, "", settings) if tail else None,
                           parts=self._parts(settings) if wanted else ())
        prompt = replace(bare, offer=offer_tools(self, settings, lambda: bare.thinking(bare.text).inside))
        split = ReasoningSink(sink, lambda: prompt.thinking(prompt.text))
        gen = self.session.reply(prompt, max_tokens, stop, split)
        reasoning, answer = split.finish()
        if gen.finish_reason == "interrupted":  # (what is kept of a stopped reply is what its reader saw)
            gen, answer = self._cut_to(gen, answer, sink.seen(answer))
        content = reply.content + answer
        spelled = gen.spelled if gen.spelled is not None else tail + gen.text
        made = replace(reply, content=content, reasoning=(reply.reasoning or "") + reasoning or None,
                       spelled=spelled if spelled != content else None)
        gen = replace(gen, answer=answer, reasoning=reasoning.strip())
        if prompt.offer is not None:
            opened = fmt is not None and fmt.starts_inside(prompt.text[:len(prompt.text) - len(tail)])
            gen, made = read_calls(self, settings, made, gen, opened)
            shown = gen.call_shown
            if self.template is not None and not gen.tool_calls and shown is not None and len(gen.text) > shown:
                sink.text(gen.text[shown:])  # a call that did not parse is shown, and kept, as text
                made = replace(made, content=made.content + gen.text[shown:])
                gen = replace(gen, answer=answer + gen.text[shown:])
        self.messages.append(made)
        return gen

    def _cut_to(self, gen: Generation, answer: str, seen: str) -> tuple[Generation, str]:
        """A stopped reply whose answer's reader saw only `seen` of it, cut back to the last of
        its tokens that `seen` holds (but for the space before a word: the context rewound
        there): those the reader never saw are not kept. As it was where the rest is not the answer's end in tokens (or the
        server keeps the tokens)."""
        held = self.held
        if held is None or len(seen) >= len(answer) or not answer.startswith(seen) or not gen.tokens:
            return gen, answer
        unseen, cut, text = len(answer) - len(seen), 0, ""
        while cut < len(gen.tokens):
            more = held.spell(gen.tokens[len(gen.tokens) - cut - 1:])
            if len(more) > unseen and not more[:len(more) - unseen].isspace():  # (a space the reader saw before it)
                break
            text, cut = more, cut + 1
        if not cut or not answer.endswith(text) or not gen.text.endswith(text):
            return gen, answer
        held.rewind(len(held.tokens) - cut)
        return replace(gen, text=gen.text[:len(gen.text) - len(text)], tokens=gen.tokens[:-cut]), \
            answer[:len(answer) - len(text)]

    def answer(self, *, max_tokens: int, stop: Sequence[str] = (), sink: ReplySink = SILENT,
               turn: TurnSettings | None = None) -> Generation:
        """Generates the reply to the conversation as it stands: its last message a user's or a
        tool's result."""
        if not self.messages or self.messages[-1].role not in ("user", "tool"):
            raise UsageError("the conversation does not end with a message to reply to (a user's or a tool's)")
        mark = len(self.messages)
        try:
            return self._generate(Message("assistant", ""), max_tokens, stop, sink, turn)
        except BaseException:
            del self.messages[mark:]
            raise

    def add_tool_results(self, results: Sequence[tuple[ToolCall, str]]) -> None:
        """Each (call, its result's text) as a tool message, after the reply that made the calls."""
        for call, text in results:
            self.messages.append(Message("tool", text, tool_call_id=call.id, name=call.name))

    def reply_to_tools(self, *, max_tokens: int, stop: Sequence[str] = (), sink: ReplySink = SILENT,
                       turn: TurnSettings | None = None) -> Generation:
        """Generates the model's next reply after the tools' results (no new user message)."""
        if not self.messages or self.messages[-1].role != "tool":
            raise UsageError("there is no tool result to reply to")
        return self.answer(max_tokens=max_tokens, stop=stop, sink=sink, turn=turn)

    def undo(self) -> bool:
        """Drops the last exchange (the last user message and what followed it) and returns the
        context to what it held before it: a rewind, nothing is re-read (where that turn read the
        end of the reply before it again, to the point the context was still as before)."""
        for i in range(len(self.messages) - 1, -1, -1):
            if self.messages[i].role == "user":
                self.back_to(i)
                return True
        return False

    def back_to(self, i: int) -> None:
        """Drops the messages from the `i`-th on, the context and the seed's draws going back to
        before it (a rewind)."""
        m = self.messages[i]
        del self.messages[i:]
        if m.context_before is not None:
            self.session.rewind(m.context_before)
        if m.decoded_before is not None and self.held is not None:
            self.held.undecode(m.decoded_before)
        if m.draws_before is not None:
            self.session.draws = m.draws_before

    def reset(self) -> None:
        """Forgets the conversation, keeping the system prompt: the context goes back to it (a
        rewind, as /undo's)."""
        first = 1 if self.system is not None else 0
        if len(self.messages) > first:
            self.back_to(first)
        held = self.held
        if held is not None:  # (where the messages had no mark of the context: as far as it still spells them)
            kept = common_prefix(held.tokens, self.context_tokens(add_generation_prompt=False)) if first else 0
            if kept < len(held.tokens):
                held.rewind(kept)

    def size_alone(self, text: str) -> tuple[int, int]:
        """(tokens `text` takes as a user message, tokens of everything around it) in a
        conversation of nothing but the system prompt and this message."""
        head = [m for m in self.messages[:1] if m.role == "system"]
        empty = len(self.render_tokens(head + [Message("user", "")], add_generation_prompt=True))
        full = len(self.render_tokens(head + [Message("user", text)], add_generation_prompt=True))
        return full - empty, empty

def _shown(message: Message, protector: Protector, fmt: ReasoningFormat | None) -> dict[str, Any]:
    """A message as the template is given it, what comes from outside hidden from markup; a
    reply's reasoning where the template reads it (its field, or the content as written)."""
    # (a reply's text that spells one of quipu's markers is never taken for a medium: the model's
    # own words are text, as a user's are)
    content = defuse(message.content) if message.role == "assistant" else protector.hide(message.content)
    if message.reasoning and fmt is not None and fmt.in_content:
        content = defuse(message.spelled if message.spelled is not None and not message.tool_calls
                         else fmt.written(message.reasoning, content))
    shown = message.for_template(content)
    if message.reasoning and fmt is not None and fmt.field:
        shown[fmt.field] = defuse(message.reasoning)
    if message.tool_calls:
        shown["tool_calls"] = hidden(message.tool_calls, protector.hide)
    return shown
