"""Making room in a full context: the oldest exchanges of a conversation dropped, their tokens
taken out of the context and the kept ones moved down where the model's cache can move cells
(as llama.cpp's context shift), else read again with the next turn."""

from __future__ import annotations

from dataclasses import replace

from quipu.errors import CapabilityError, TemplateError
from quipu.sessions.base import Message
from quipu.sessions.conversation import Conversation


def _dropped_span(self: Conversation, before: list[Message], first: int) -> tuple[int, int] | None:
    """The tokens of the exchanges just dropped, in the context: from where the first of
    them began (after the system prompt, for the conversation's first) to where the first
    kept one began; None where the context does not say so for sure."""
    session = self.held
    if len(self.messages) <= first or session is None:  # (all went: nothing to keep)
        return None
    start, end = before[first].context_before, self.messages[first].context_before
    if start is None or end is None:
        return None
    if start == 0:  # sent with the system prompt: it begins where the system prompt's rendering ends
        if not first:
            return None
        try:
            system = self.render_tokens(before[:first], add_generation_prompt=False)
        except (TemplateError, CapabilityError):
            return None
        if list(session.tokens[:len(system)]) != system:
            return None
        start = len(system)
    # The mark is where that exchange's tokens began, which may be the end of the reply
    # before it (`<|im_end|>` and a new line): the kept exchange begins where the context
    # holds what its rendering begins with.
    try:
        kept = self.render_tokens(self.messages, add_generation_prompt=False)[start:start + 8]
    except (TemplateError, CapabilityError):
        return None
    held = session.tokens
    for k in range(16):
        if list(held[end + k:end + k + len(kept)]) == kept:
            end += k
            return (start, end) if start < end <= session.n_decoded else None
    return None

def drop_oldest(self: Conversation, keep_free: int, keep_latest: bool = False) -> int:
    """Drops the oldest exchanges (never the system prompt) until the conversation leaves at
    least `keep_free` tokens of the context free; where the context's size is the server's
    own, the oldest exchange. With `keep_latest`, never the last exchange, though fewer
    tokens are then free. Returns how many messages went."""
    first = 1 if self.system is not None else 0
    dropped = 0
    before = list(self.messages)
    while len(self.messages) > first:
        if keep_latest and not any(m.role == "user" for m in self.messages[first + 1:]):
            break  # (what is left is the last exchange)
        if self.session.capabilities.context_size:
            needed = len(self.render_tokens(self.messages, add_generation_prompt=True))
            if needed + keep_free <= self.session.n_ctx:
                break
        elif dropped:
            break
        del self.messages[first]
        while len(self.messages) > first and self.messages[first].role != "user":
            del self.messages[first]
            dropped += 1
        dropped += 1
    # Where the model's cache can move its cells, the dropped exchanges' tokens go from the
    # context and the kept ones move down, nothing read again (as llama.cpp's context shift:
    # the kept cells were computed with the dropped tokens before them). The next turn keeps
    # what of them its rendering still spells, as always.
    span = _dropped_span(self, before, first) if dropped else None
    if span is not None and self.held is not None and self.held.shift_out(*span):
        def moved(at: int | None) -> int | None:
            return None if at is None else max(span[0], at - (span[1] - span[0]))

        self.messages[:] = [replace(m, context_before=moved(m.context_before), decoded_before=moved(m.decoded_before))
                            for m in self.messages]
        return dropped
    # (the context is re-read from here; old marks mean nothing)
    self.messages[:] = [replace(m, context_before=None, decoded_before=None) for m in self.messages]
    return dropped
