"""Where a later prompt may part from this one: the counts of a prompt's tokens at which its
reading ends a step (`Backend.prefill`'s marks), so that the next turn, a retry, a second question
or a new conversation with the same system prompt goes back there instead of reading everything
again, and reads on as a whole read with the same marks does: a memory that cannot go back a
token (a hybrid model's recurrent state) keeps a checkpoint there, an attention cache is cut
back there."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from quipu.sessions.base import Message, TurnPrompt, common_prefix
from quipu.sessions.prompt import Rendered


# A message's text no message begins with: its rendering parts from any other's where the
# message's own text begins.
PROBE = "\x00"


def parting(messages: Sequence[Message]) -> list[list[Message]]:
    """The conversations a later prompt may begin as, before their renderings' generation prompt
    (`TurnPrompt.parts`): these messages (a retry, a template that leaves a reply's reasoning out
    of the next prompt, one that writes a past reply's header otherwise); where the last
    message's last paragraph begins, those before it (piped text ends: `quipu run` puts a blank
    line between it and the question); and the system prompt with the header of a first
    message whose text is not yet written (a new conversation with the same system prompt, or
    the template's own)."""
    messages = list(messages)
    variants = [messages]
    last = messages[-1] if messages else None
    if last is not None and last.role == "user" and "\n\n" in last.content.strip():
        head = last.content.strip()
        variants.append(messages[:-1] + [replace(last, content=head[:head.rindex("\n\n")])])
    system = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
    if system < len(messages):  # (where the first message after the system prompt begins its text)
        variants.append(messages[:system] + [Message("user", PROBE)])
    return variants


def reply_marks(context_for: Callable[[Rendered], list[int]], prompt: TurnPrompt, tokens: Sequence[int]) -> list[int]:
    """A reply's prompt `tokens` (`context_for` makes a rendering's): where each of the prompt's
    parts (`parting`) ends in them, and their end."""
    marks = [common_prefix(context_for(part), tokens) for part in prompt.parts]
    return [m for m in marks if 0 < m < len(tokens)] + [len(tokens)]


def plain_marks(token_bytes: Callable[[int], bytes], tokens: Sequence[int]) -> list[int]:
    """A plain prompt's (`--raw`): where its last paragraph begins (after the last token that
    ends a blank line: piped text, then the question), and its end."""
    text = b""
    last = 0
    for i, token in enumerate(tokens):
        text = (text + token_bytes(token))[-2:]
        if text == b"\n\n" and i + 1 < len(tokens):
            last = i + 1
    return [last, len(tokens)] if last else [len(tokens)]
