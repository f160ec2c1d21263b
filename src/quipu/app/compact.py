"""Room in a long conversation. A message that could never fit is refused at once
(`refuse_if_it_never_fits`). A conversation is compacted into a branch that can be undone: the
model summarises the older exchanges (`summarize`), the user may edit the summary, and a new
branch holds the system prompt, the summary and the last exchanges as they were (`compact`); the
conversation as it was stays a branch, one /switch away."""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from quipu.app.environment import Environment
from quipu.app.named import NamedSession
from quipu.engine.base import ProgressFn
from quipu.errors import ContextOverflow, UsageError
from quipu.sessions.base import SILENT, Message, ReplySink
from quipu.sessions.conversation import Conversation


class ChatSession(Protocol):
    """What compaction uses of a chat (`app.chat.ChatSession`)."""

    env: Environment
    named: NamedSession | None
    kept: bool

    @property
    def messages(self) -> list[Message]: ...
    def save(self) -> None: ...
    def reload(self, on_progress: ProgressFn | None = None) -> None: ...

# What the model is asked (the config's [chat] compact_prompt replaces it), and how many of the
# last exchanges the compacted branch keeps as they were ([chat] compact_keep).
SUMMARY_PROMPT = ("Summarize our conversation so far for yourself, to go on from: the facts, names, numbers, "
                  "decisions and open questions, and every correction I made, in a few short paragraphs. "
                  "Write only the summary.")
KEEP_LAST = 2
SUMMARY_HEAD = "A summary of our conversation so far:"
SUMMARY_TAKEN = "Understood: I have the summary, and go on from it."
MAX_SUMMARY_TOKENS = 600
MIN_SUMMARY_TOKENS = 8  # a summary shorter than this says nothing: there is no room to save


def _keep_last(chat: ChatSession) -> int:
    kept = chat.env.config.chat.get("compact_keep", KEEP_LAST)
    return int(kept) if isinstance(kept, int) and not isinstance(kept, bool) and kept >= 0 else KEEP_LAST


def older_part(chat: ChatSession) -> tuple[int, int]:
    """(where the exchanges to summarise begin, where the kept ones begin), as indexes of the
    messages; UsageError where nothing is old enough to summarise."""
    messages = chat.messages
    first = 1 if messages and messages[0].role == "system" else 0
    yours = [i for i, m in enumerate(messages) if m.role == "user" and i >= first]
    keep = _keep_last(chat)
    if len(yours) <= keep:
        raise UsageError(f"nothing to compact: the conversation has {len(yours)} exchange"
                         f"{'' if len(yours) == 1 else 's'}, and the last {keep} stay as they are")
    return first, yours[len(yours) - keep] if keep else len(messages)


def summarize(chat: ChatSession, instructions: str | None = None, sink: ReplySink = SILENT) -> str:
    """The model's summary of the older exchanges (all but the last few), read where the context
    holds them: the context goes back to before the kept exchanges, the request is read and the
    summary generated; then the conversation is restored as it was saved, exactly, so nothing
    changes until `compact` makes the branch."""
    _, kept_at = older_part(chat)
    named = chat.named
    assert named is not None
    conv = named.conversation
    room = summary_room(chat)
    prompt = str(chat.env.config.chat.get("compact_prompt") or SUMMARY_PROMPT)
    if instructions:
        prompt += f" {instructions.strip()}"
    if not chat.kept:
        raise UsageError("this chat is not saved: /save NAME keeps it, then /compact")
    chat.save()  # (the conversation as it is, on disk: it is put back from there)
    named.flush()
    try:
        conv.back_to(kept_at)
        gen = conv.send(prompt, max_tokens=room, sink=sink)
    finally:
        chat.reload()
    summary = (gen.answer if gen.answer is not None else gen.text).strip()
    if not summary:
        raise UsageError("the model wrote no summary; /compact again, perhaps with instructions")
    return summary


def compact(chat: ChatSession, summary: str) -> int:
    """A new branch: the system prompt, `summary` (as a message of the user's, taken), and the
    last exchanges as they were; its context read now, so the next message reads only itself.
    The conversation as it was stays a branch. Returns the new branch's id."""
    first, kept_at = older_part(chat)
    named = chat.named
    assert named is not None
    conv = named.conversation
    compacted = _compacted(conv, first, kept_at, summary)
    before, after = _sizes(conv, compacted)
    if after >= before:  # (a summary no shorter than what it replaces would only grow the context)
        raise UsageError(f"nothing compacted: with the summary the conversation would be {after} tokens, and it is "
                         f"{before} now; make the summary shorter")
    named.stash()
    conv.messages[:] = compacted
    held = conv.held
    if held is not None and hasattr(held, "set_context"):  # (a local context: read now)
        held.set_context(conv.context_tokens(add_generation_prompt=False))
    chat.save()
    return named.branch[0]


def _compacted(conv: Conversation, first: int, kept_at: int, summary: str) -> list[Message]:
    """The messages of the compacted branch: the system prompt, the summary, the kept exchanges."""
    kept = [replace(m, context_before=None, decoded_before=None, draws_before=None) for m in conv.messages[kept_at:]]
    return [*conv.messages[:first], Message("user", f"{SUMMARY_HEAD}\n\n{summary.strip()}"),
            Message("assistant", SUMMARY_TAKEN), *kept]


def _sizes(conv: Conversation, compacted: list[Message]) -> tuple[int, int]:
    """The conversation's context in tokens, now and as `compacted`."""
    was = list(conv.messages)
    before = len(conv.context_tokens(add_generation_prompt=False))
    try:
        conv.messages[:] = compacted
        return before, len(conv.context_tokens(add_generation_prompt=False))
    finally:
        conv.messages[:] = was


def summary_room(chat: ChatSession) -> int:
    """The most tokens a summary may take for the compacted branch to be shorter than the
    conversation (at most `MAX_SUMMARY_TOKENS`); UsageError where the older exchanges are too
    short for any summary to save room."""
    first, kept_at = older_part(chat)
    named = chat.named
    assert named is not None
    before, frame = _sizes(named.conversation, _compacted(named.conversation, first, kept_at, ""))
    room = min(MAX_SUMMARY_TOKENS, before - frame - 1)
    if room < MIN_SUMMARY_TOKENS:
        raise UsageError("nothing to compact: the older exchanges are too short for a summary of them to save room")
    return room


def refuse_if_it_never_fits(conv: Conversation, text: str, exc: ContextOverflow) -> None:
    """A message too long even for a conversation of nothing but the system prompt gets one
    clear refusal: dropping old exchanges or a new session could not make room for it."""
    n_ctx = conv.session.n_ctx
    if exc.at_least:
        raise UsageError(f"this message cannot fit: it is more than {n_ctx} tokens, and the context holds "
                         f"{n_ctx}; shorten it, or start the chat with a larger --ctx")
    size, overhead = conv.size_alone(text)
    room = n_ctx - 1 - overhead  # one cell stays free for the reply's first token
    if size > room:
        raise UsageError(f"this message cannot fit: it is {size} tokens, and the context ({n_ctx} tokens) has "
                         f"room for {max(room, 0)} beside the system prompt; shorten it, or start the chat "
                         "with a larger --ctx")
