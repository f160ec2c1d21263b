"""A chat template's reasoning format, found from the template itself: a message with a
placeholder reasoning in each field templates read (`reasoning_content`, `thinking`,
`reasoning`), as a plain reply and as a reply that made a call, shows the field and the markup
before the reasoning, between it and the answer, and after the answer; a generation prompt
with thinking on and off shows what opens it; a prompt that ends with a tag whose close the
source spells (`<think>`: `</think>`) opens it. The markup the table knows (`reasoning.TABLE`)
wins where both know it; a style nothing shows has no format."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Callable

from quipu.errors import TemplateError
from quipu.sessions.reasoning import FIELDS, TABLE, ReasoningFormat


# render(messages, add_generation_prompt, **variables) -> the template's text
# (`template.ChatTemplate.render`).
Render = Callable[..., str]

__all__ = ["find_format"]

# Markup: a tag in angle brackets, or capitals (or a tag) in square brackets.
MARKUP = re.compile(r"<[^<>\s]{1,48}>|\[/?[A-Z][A-Z_ ]{0,38}\]|\[/?[A-Za-z_]{1,20}\]")
_REASON, _ANSWER, _USER = "quipuReasonQ", "quipuAnswerQ", "quipuUserQ"


def _first_markup(text: str) -> str:
    """The markup `text` begins with: a tag, with a word and the tag after it where they follow
    at once (Kimi's `<|close|>think<|sep|>`); "" if it begins with none."""
    m = MARKUP.match(text)
    if not m:
        return ""
    word = re.match(r"[A-Za-z_]{1,20}", text[m.end():])
    if word:
        after = MARKUP.match(text, m.end() + word.end())
        if after:
            return text[:after.end()]
    return m.group(0)


def _last_markup(text: str) -> str:
    """The markup `text` ends with (blanks aside), with a word just before or after the tag
    (`<|channel>thought`, `<|open|>think<|sep|>`); a line of text where it ends with no tag and
    opens reasoning in words (Apriel's `Here are my reasoning steps:`)."""
    text = text.rstrip()
    tags = list(MARKUP.finditer(text))
    if not tags:
        return ""
    last = tags[-1]
    if last.end() == len(text):
        start = last.start()
        word = re.search(r"[A-Za-z_]{1,20}\Z", text[:start])
        if word and len(tags) > 1 and tags[-2].end() == word.start():
            start = tags[-2].start()
        return text[start:]
    tail = text[last.end():]
    if re.fullmatch(r"[A-Za-z_]{1,20}", tail):
        return text[last.start():]
    return ""


def _closing_of(opener: str, source: str) -> str:
    """The close a tag pairs with by convention (`<x>`: `</x>`, `[X]`: `[/X]`), where the source spells it."""
    m = re.fullmatch(r"<([^<>/\s]+)>|\[([^\[\]/\s]+)\]", opener)
    if not m:
        return ""
    close = f"</{m.group(1)}>" if m.group(1) else f"[/{m.group(2)}]"
    return close if close in source else ""


def _render(render: Render, messages: list[dict[str, Any]], generation: bool,
            **variables: Any) -> str | None:
    try:
        return render(messages, generation, **variables)
    except TemplateError:
        return None


def _by_rendering(render: Render) -> ReasoningFormat | None:
    user = [{"role": "user", "content": _USER}]
    prompt = _render(render, user, True)
    if prompt is None:
        return None
    for name in FIELDS:
        message = {"role": "assistant", "content": _ANSWER, name: _REASON}
        for messages, generation in ((user + [message], False),
                                     (user + [message, {"role": "user", "content": _USER}], True)):
            text = _render(render, messages, generation)
            if text and _REASON in text and _ANSWER in text and text.index(_REASON) < text.index(_ANSWER):
                break
        else:
            found = _in_a_call(render, user, prompt, name)
            if found is not None:
                return found
            continue
        r, a = text.index(_REASON), text.index(_ANSWER)
        plain = _render(render, user + [{"role": "assistant", "content": _ANSWER}], False) or ""
        before = text[len(prompt):r].strip() if text.startswith(prompt) else ""
        opener = before
        if not opener and text.startswith(prompt):
            opener = _last_markup(prompt)  # (the prompt opens it: Qwen 3.5, GLM 4.7)
        elif not opener:
            opener = _last_markup(text[:r])
            if opener in plain and not _opens_block(plain, opener, _ANSWER):
                opener = ""  # (the assistant's header, which an answer alone has too)
        written_between = text[r + len(_REASON):a]
        between = written_between.strip()
        close = _first_markup(between) or between
        if not opener or not close or "\n" in close:
            return None
        answer_open = between[len(close):].strip()
        after = text[a + len(_ANSWER):].lstrip()
        answer_close = _first_markup(after) if answer_open else ""
        empty = plain[len(prompt):plain.index(_ANSWER)] if plain.startswith(prompt) and _ANSWER in plain else ""
        answers: tuple[str, ...] = (answer_open,) if answer_open else ()
        if empty.strip() and not any(empty.strip().startswith(o) for o in (opener, close, *answers)):
            answers += (empty.strip(),)
        return ReasoningFormat("template", (opener,), close, answers, (answer_close,) if answer_close else (),
                               field=name, empty=empty, between=written_between)
    return None


def _in_a_call(render: Render, user: list[dict[str, Any]], prompt: str,
               name: str) -> ReasoningFormat | None:
    """The markup around the reasoning of a reply that made a call, for templates that render
    reasoning there alone (Command R7B, Gemma 4: the reasoning of a turn's tool loop)."""
    call = {"id": "000000001", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    text = _render(render, user + [{"role": "assistant", "content": "", name: _REASON, "tool_calls": [call]},
                                     {"role": "tool", "content": "r", "tool_call_id": "000000001", "name": "f"}],
                   True)
    if not text or _REASON not in text:
        return None
    r = text.index(_REASON)
    opener = text[len(prompt):r].strip() if text.startswith(prompt) else ""
    if not opener:  # (a prompt that closes the reasoning itself, as thinking off does: the markup before it)
        opener = _last_markup(text[:r])
    after = text[r + len(_REASON):]
    close = _first_markup(after.lstrip())
    if not opener or not close or "\n" in opener:
        return None
    return ReasoningFormat("template", (opener,), close, field=name,
                           between=after[:after.index(close) + len(close)])


def _opens_block(text: str, opener: str, answer: str) -> bool:
    """Whether `opener` stands in `text` right before a close and the answer (an empty block)."""
    at = text.rfind(opener, 0, text.find(answer))
    return at >= 0 and bool(MARKUP.match(text[at + len(opener):].lstrip()))


def _by_switch(render: Render) -> ReasoningFormat | None:
    """The markup a generation prompt writes with thinking on and off: an empty block when off
    (Qwen3's `<think>\\n\\n</think>`, Gemma 4's `<|channel>thought\\n<channel|>`), the opener when on."""
    user = [{"role": "user", "content": _USER}]
    on = _render(render, user, True, enable_thinking=True)
    off = _render(render, user, True, enable_thinking=False)
    if on is None or off is None or on == off:
        return None
    common = 0
    while common < min(len(on), len(off)) and on[common] == off[common]:
        common += 1
    tag = on.rfind("<", 0, common)
    if tag >= 0 and ">" not in on[tag:common]:
        common = tag  # (the tails share the start of a tag: from the tag's start)
    on_tail, off_tail = on[common:].strip(), off[common:].strip()
    if _USER in on[common:] + off[common:] or len(on_tail) > 64 or len(off_tail) > 64:
        return None  # (the switch changes more than the prompt's end: a system prompt's words)
    if off_tail and not on_tail:  # off writes an empty block
        opener = _first_markup(off_tail)
        rest = off_tail[len(opener):].lstrip()
        close = _last_markup(rest) if rest else ""
        if opener and close and not rest[:len(rest) - len(close)].strip():
            return ReasoningFormat("template", (opener,), close, empty=off[common:])
    if on_tail and off_tail:  # on opens, off closes (DeepSeek V3.1's `<think>` and `</think>`)
        opener, close = _last_markup(on_tail), _last_markup(off_tail)
        if opener and close and opener != close:
            return ReasoningFormat("template", (opener,), close, empty=off[common:])
    return None


def find_format(source: str, render: Render) -> ReasoningFormat | None:
    """The reasoning format of the chat template `source` that `render` renders
    (`ChatTemplate.reasoning` keeps it); None: it writes no reasoning quipu knows."""
    known = next((f for f in TABLE if all(m in source for m in (*f.opens, f.close))), None)
    found = _by_rendering(render) if any(n in source for n in FIELDS) else None
    found_field, found_empty, found_between = (found.field, found.empty, found.between) if found else (None, "", "")
    if found is not None and known is not None and (found.close == known.close or found.opens[0] in known.opens):
        # (the table's markup, where it knows more: harmony's headers, Apriel's words)
        found = known if known.headers else replace(
            known, answer_opens=found.answer_opens or known.answer_opens,
            answer_closes=found.answer_closes or known.answer_closes)
        found = replace(found, field=found_field, empty=found_empty, between=found_between)
    if found is None:
        switched = _by_switch(render) if "enable_thinking" in source else None
        if known is not None and (switched is None or switched.opens[0] in known.opens):
            found = replace(known, empty=switched.empty if switched else "")
        else:
            found = switched or _by_prompt(render, source)
    if found is not None and found.field is None:
        found = replace(found, in_content=_keeps_in_content(render, found))
    return found


def _keeps_in_content(render: Render, fmt: ReasoningFormat) -> bool:
    """Whether the template, reading no reasoning field, shows an earlier reply's reasoning as
    written in its content."""
    user = {"role": "user", "content": _USER}
    reply = {"role": "assistant", "content": fmt.written(_REASON, _ANSWER)}
    return _REASON in (_render(render, [user, reply, user], True) or "")


def _by_prompt(render: Render, source: str) -> ReasoningFormat | None:
    """A generation prompt that ends with an opener whose close the source spells (DeepSeek-R1's `<think>\\n`)."""
    prompt = _render(render, [{"role": "user", "content": _USER}], True)
    opener = _last_markup(prompt or "")
    close = _closing_of(opener, source) if opener else ""
    return ReasoningFormat("template", (opener,), close) if close else None
