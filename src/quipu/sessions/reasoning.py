"""A thinking model's reasoning, as its template writes it: the one table of reasoning formats,
and the split of a reply into its reasoning and its answer, as it streams and once it is done.

A format is the markup around the reasoning and the answer: `<think>...</think>` (Qwen3,
DeepSeek-R1, GLM, SmolLM3, ...), `<seed:think>`, `[THINK]...[/THINK]` (Magistral, Ministral 3
Reasoning), `<|START_THINKING|>...<|END_THINKING|><|START_RESPONSE|>...` (Command R7B),
`<|channel>thought ...<channel|>` (Gemma 4), `<|inner_prefix|>...<|inner_suffix|>` (Apertus),
and harmony's channels (`<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final
<|message|>...`, GPT-OSS), whose messages each begin with a header.

Where a template renders a message's reasoning, its format is found by rendering: a message with
a placeholder reasoning in each field templates read (`reasoning_content`, `thinking`,
`reasoning`) shows the field, the markup before the reasoning, between it and the answer, and
after the answer; a generation prompt with thinking on and off shows what opens it. So a new
model in a known style needs no new row. A template that never renders reasoning is known by
the markup its source spells (`TABLE`); one in no known style has none: its replies are answers.

Markup may be control tokens, which a reply's text does not show: the splitter is fed the
spelling of each control token apart from the text (`feed(text, control=True)`), so it sees the
markup whatever its tokens, and shows none of the control tokens it does not read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

from quipu.errors import TemplateError
from quipu.sessions.base import ReplySink
from quipu.sessions.stops import pending_prefix

if TYPE_CHECKING:
    from quipu.sessions.template import ChatTemplate

__all__ = ["ReasoningFormat", "Splitter", "TABLE", "find_format", "FIELDS", "Thinking", "ReasoningSink"]

# The message fields a template may read a reply's reasoning from, most common first.
FIELDS = ("reasoning_content", "thinking", "reasoning")


@dataclass(frozen=True)
class ReasoningFormat:
    """One family's markup: what opens the reasoning at the start of a reply (or of a message,
    for a format with headers), what closes it, what stands before and after the answer."""

    name: str
    opens: tuple[str, ...]
    close: str
    answer_opens: tuple[str, ...] = ()
    answer_closes: tuple[str, ...] = ()
    # A message's header, (its starts, its end): markup, read for its channel (harmony's
    # `<|start|>assistant<|channel|>analysis<|message|>`: a header that ends with an opener opens
    # reasoning; any other begins answer text, or a call, which a tool watch reads).
    headers: tuple[tuple[str, ...], str] | None = None
    field: str | None = None  # the message field the template reads the reasoning from
    empty: str = ""  # what the template writes for a reply without reasoning (after its prompt)
    # What the template writes from the reasoning's end to the answer's start ("" : the close).
    between: str = ""
    # Where the template reads no field: whether it keeps the reasoning written in the content.
    in_content: bool = False

    def starts_inside(self, prompt_text: str) -> bool:
        """Whether a reply to `prompt_text` begins inside reasoning the prompt opened."""
        opened = max(prompt_text.rfind(o) for o in self.opens)
        return opened >= 0 and opened > prompt_text.rfind(self.close)

    def splitter(self, inside: bool = False) -> "Splitter":
        return Splitter(self, inside)

    def set_apart(self, text: str, inside: bool = False) -> tuple[str, str]:
        """(reasoning, all after it as written, markup included): where a reply's calls are read."""
        splitter = self.splitter(inside)
        pieces = splitter.feed(text) + splitter.flush()
        reasoning = "".join(t for r, t in pieces if r).strip()
        if not splitter.reasoned:
            return "", text
        return reasoning, text[splitter.outside_from:] if splitter.outside_from is not None else ""

    @property
    def closes_with(self) -> str:
        """What ends the reasoning and begins the answer, as the template writes it."""
        return self.between or self.close + (self.answer_opens[0] if self.answer_opens else "")

    @property
    def no_reasoning(self) -> str:
        """What a reply without reasoning begins with, as the template writes one."""
        if self.empty.strip() and any(self.empty.strip().startswith(o) for o in (*self.opens, *self.answer_opens)):
            return self.empty
        return self.opens[0] + self.closes_with

    def written(self, reasoning: str, answer: str) -> str:
        """A reply as the model would write it, from its reasoning and answer."""
        return f"{self.opens[0]}{reasoning}{self.closes_with}{answer}" if reasoning else answer


START, REASONING, AFTER, ANSWER, HEADER = range(5)


class Splitter:
    """A reply's text as it streams, in (is_reasoning, text) pieces with the markup taken out.
    Reasoning opens only at the start of the reply or of a message (after blanks at most), so an
    answer that mentions the markup stays an answer; markup split across pieces is held back
    until it is whole. `outside_from` is where the text after the reasoning began (in what was
    fed), None while the reply is in its reasoning, or may still open it."""

    def __init__(self, fmt: ReasoningFormat | None, inside: bool = False):
        self.fmt = fmt
        self.state = REASONING if inside and fmt is not None else (START if fmt is not None else ANSWER)
        self._buf = ""
        self._ctl: list[bool] = []  # per character of `_buf`: a control token's spelling
        self.fed = 0  # characters fed so far
        self.outside_from: int | None = 0 if fmt is None else None
        self._strip = False
        self.reasoned = self.state == REASONING  # whether the reply has had reasoning

    @property
    def in_reasoning(self) -> bool:
        return self.state == REASONING

    def feed(self, text: str, control: bool = False) -> list[tuple[bool, str]]:
        if not text:
            return []
        if self.fmt is None:
            self.fed += len(text)
            return [] if control else [(False, text)]
        self._buf += text
        self._ctl += [control] * len(text)
        self.fed += len(text)
        out: list[tuple[bool, str]] = []
        while self._buf and self._step(out):
            pass
        return _joined(out)

    def flush(self) -> list[tuple[bool, str]]:
        out: list[tuple[bool, str]] = []
        if self._buf and self.state != HEADER:  # (a header cut short is markup all the same)
            if self.state == START:
                self._mark_outside(0)
            self._emit(out, self.state == REASONING, len(self._buf))
        self._buf, self._ctl = "", []
        return _joined(out)

    # ---- the machine -------------------------------------------------------------------------

    def _consumed_at(self) -> int:
        return self.fed - len(self._buf)

    def _mark_outside(self, at: int) -> None:
        self.outside_from = self._consumed_at() + at

    def _emit(self, out: list, reasoning: bool, n: int) -> None:
        text = "".join(c for c, ctl in zip(self._buf[:n], self._ctl[:n], strict=True) if not ctl)
        if text:
            out.append((reasoning, text))
        self._drop(n)

    def _drop(self, n: int) -> None:
        self._buf, self._ctl = self._buf[n:], self._ctl[n:]

    def _step(self, out: list) -> bool:
        """One move on the held text; False when it must wait for more."""
        fmt = self.fmt
        assert fmt is not None
        buf = self._buf
        if self.state in (START, AFTER):
            rest = buf.lstrip()
            lead = len(buf) - len(rest)
            if not rest:
                if self.state == AFTER:
                    self._drop(lead)  # (the blanks after the reasoning are not the answer's)
                return False
            if self.state == AFTER:
                self._drop(lead)
                lead = 0
            starts = fmt.headers[0] if fmt.headers else ()
            for opener in fmt.opens:
                if rest.startswith(opener):
                    self._drop(lead + len(opener))
                    self.state, self.reasoned = REASONING, True
                    return True
            for start in starts:
                if rest.startswith(start):
                    self._mark_outside(lead)
                    self._drop(lead)
                    self.state = HEADER
                    return True
            for opener in fmt.answer_opens:
                if rest.startswith(opener):
                    self._mark_outside(lead)
                    self._drop(lead + len(opener))
                    self.state, self._strip = ANSWER, True
                    return True
            if any(m.startswith(rest) for m in (*fmt.opens, *starts, *fmt.answer_opens)):
                return False  # (it may be markup yet)
            self._mark_outside(lead)
            self.state = ANSWER
            return True
        if self.state == REASONING:
            at = buf.find(fmt.close)
            if at >= 0:
                self._emit(out, True, at)
                self._drop(len(fmt.close))
                self._mark_outside(0)
                self.state = AFTER
                return True
            keep = pending_prefix(buf, (fmt.close,))
            self._emit(out, True, len(buf) - keep)
            return False
        if self.state == HEADER:
            end = fmt.headers[1] if fmt.headers else ""
            at = buf.find(end)
            if at < 0:
                return False
            header = buf[:at + len(end)]
            self._drop(len(header))
            self.state = REASONING if any(header.endswith(o) for o in fmt.opens) else ANSWER
            self.reasoned = self.reasoned or self.state == REASONING
            return True
        # ANSWER: its closing markup (and, with headers, the next message's) taken out
        starts = fmt.headers[0] if fmt.headers else ()
        if self._strip:  # (the blanks after the answer's markup are not the answer's)
            rest = buf.lstrip()
            if not rest:
                return False
            self._drop(len(buf) - len(rest))
            self._strip = False
            buf = self._buf
        found = [(buf.find(m), m) for m in (*fmt.answer_closes, *starts) if m and buf.find(m) >= 0]
        if found:
            at, mark = min(found)
            self._emit(out, False, at)
            if mark in starts:
                self.state = HEADER
            else:
                self._drop(len(mark))
                self.state = AFTER if starts else ANSWER
            return True
        keep = pending_prefix(buf, tuple(m for m in (*fmt.answer_closes, *starts) if m))
        self._emit(out, False, len(buf) - keep)
        return False


def _joined(pieces: list[tuple[bool, str]]) -> list[tuple[bool, str]]:
    out: list[tuple[bool, str]] = []
    for reasoning, text in pieces:
        if out and out[-1][0] == reasoning:
            out[-1] = (reasoning, out[-1][1] + text)
        else:
            out.append((reasoning, text))
    return out


# ---- the table: families whose templates spell their markup but never render reasoning -------

HARMONY = ReasoningFormat("harmony", ("<|channel|>analysis<|message|>",), "<|end|>",
                          ("<|channel|>final<|message|>",), ("<|end|>", "<|return|>"),
                          headers=(("<|start|>", "<|channel|>"), "<|message|>"), field="thinking",
                          between="<|end|><|start|>assistant<|channel|>final<|message|>")

TABLE: tuple[ReasoningFormat, ...] = (
    HARMONY,
    ReasoningFormat("command-r", ("<|START_THINKING|>",), "<|END_THINKING|>", ("<|START_RESPONSE|>",),
                    ("<|END_RESPONSE|>",)),
    ReasoningFormat("gemma-4", ("<|channel>thought",), "<channel|>"),
    ReasoningFormat("seed", ("<seed:think>",), "</seed:think>"),
    ReasoningFormat("mistral", ("[THINK]",), "[/THINK]"),
    ReasoningFormat("apertus", ("<|inner_prefix|>",), "<|inner_suffix|>"),
    ReasoningFormat("apriel", ("Here are my reasoning steps:",), "[BEGIN FINAL RESPONSE]", (),
                    ("[END FINAL RESPONSE]",)),
    ReasoningFormat("think", ("<think>",), "</think>"),
)


# A template that shows no reasoning of its own still gets a reply that opens with `<think>` split
# (a thinking model under a plain ChatML template, or none): the most common style of all.
BY_DEFAULT = TABLE[-1]


# ---- found by rendering ---------------------------------------------------------------------

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


def _render(template: "ChatTemplate", messages: list[dict[str, Any]], generation: bool,
            **variables: Any) -> str | None:
    try:
        return template.render(messages, generation, **variables)
    except TemplateError:
        return None


def _by_rendering(template: "ChatTemplate") -> ReasoningFormat | None:
    user = [{"role": "user", "content": _USER}]
    prompt = _render(template, user, True)
    if prompt is None:
        return None
    for name in FIELDS:
        message = {"role": "assistant", "content": _ANSWER, name: _REASON}
        for messages, generation in ((user + [message], False),
                                     (user + [message, {"role": "user", "content": _USER}], True)):
            text = _render(template, messages, generation)
            if text and _REASON in text and _ANSWER in text and text.index(_REASON) < text.index(_ANSWER):
                break
        else:
            found = _in_a_call(template, user, prompt, name)
            if found is not None:
                return found
            continue
        r, a = text.index(_REASON), text.index(_ANSWER)
        plain = _render(template, user + [{"role": "assistant", "content": _ANSWER}], False) or ""
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


def _in_a_call(template: "ChatTemplate", user: list[dict[str, Any]], prompt: str,
               name: str) -> ReasoningFormat | None:
    """The markup around the reasoning of a reply that made a call, for templates that render
    reasoning there alone (Command R7B, Gemma 4: the reasoning of a turn's tool loop)."""
    call = {"id": "000000001", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    text = _render(template, user + [{"role": "assistant", "content": "", name: _REASON, "tool_calls": [call]},
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


def _by_switch(template: "ChatTemplate") -> ReasoningFormat | None:
    """The markup a generation prompt writes with thinking on and off: an empty block when off
    (Qwen3's `<think>\\n\\n</think>`, Gemma 4's `<|channel>thought\\n<channel|>`), the opener when on."""
    user = [{"role": "user", "content": _USER}]
    on = _render(template, user, True, enable_thinking=True)
    off = _render(template, user, True, enable_thinking=False)
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


def find_format(template: "ChatTemplate") -> ReasoningFormat | None:
    """The reasoning format of a chat template (`ChatTemplate.reasoning` keeps it); None: it
    writes no reasoning quipu knows."""
    source = template.source
    known = next((f for f in TABLE if all(m in source for m in (*f.opens, f.close))), None)
    found = _by_rendering(template) if any(n in source for n in FIELDS) else None
    found_field, found_empty, found_between = (found.field, found.empty, found.between) if found else (None, "", "")
    if found is not None and known is not None and (found.close == known.close or found.opens[0] in known.opens):
        # (the table's markup, where it knows more: harmony's headers, Apriel's words)
        found = known if known.headers else replace(
            known, answer_opens=found.answer_opens or known.answer_opens,
            answer_closes=found.answer_closes or known.answer_closes)
        found = replace(found, field=found_field, empty=found_empty, between=found_between)
    if found is None:
        switched = _by_switch(template) if "enable_thinking" in source else None
        if known is not None and (switched is None or switched.opens[0] in known.opens):
            found = replace(known, empty=switched.empty if switched else "")
        else:
            found = switched or _by_prompt(template, source)
    if found is not None and found.field is None:
        found = replace(found, in_content=_keeps_in_content(template, found))
    return found


def _keeps_in_content(template: "ChatTemplate", fmt: ReasoningFormat) -> bool:
    """Whether the template, reading no reasoning field, shows an earlier reply's reasoning as
    written in its content."""
    user = {"role": "user", "content": _USER}
    reply = {"role": "assistant", "content": fmt.written(_REASON, _ANSWER)}
    return _REASON in (_render(template, [user, reply, user], True) or "")


def _by_prompt(template: "ChatTemplate", source: str) -> ReasoningFormat | None:
    """A generation prompt that ends with an opener whose close the source spells (DeepSeek-R1's `<think>\\n`)."""
    prompt = _render(template, [{"role": "user", "content": _USER}], True)
    opener = _last_markup(prompt or "")
    close = _closing_of(opener, source) if opener else ""
    return ReasoningFormat("template", (opener,), close) if close else None


@dataclass(frozen=True)
class Thinking:
    """A reply's reasoning: its format (None: none quipu reads), whether the reply begins inside
    it (its prompt opened it), and at most how many tokens it may take (None: no limit)."""

    fmt: ReasoningFormat | None = None
    inside: bool = False
    budget: int | None = None

    def splitter(self) -> Splitter:
        return Splitter(self.fmt, self.inside)


class ReasoningSink(ReplySink):
    """A reply's sink that passes a thinking model's reasoning on as reasoning and the rest as the
    answer, its markup taken out (control tokens included), and keeps both as they streamed.
    `thinking` is asked at the first piece, once the prompt is rendered (it may open reasoning)."""

    def __init__(self, sink: ReplySink, thinking: Callable[[], Thinking]):
        self.sink = sink
        self._thinking = thinking
        self._splitter: Splitter | None = None
        self.answer: list[str] = []
        self.reasoning_parts: list[str] = []

    def _split(self) -> Splitter:
        if self._splitter is None:
            self._splitter = self._thinking().splitter()
        return self._splitter

    def text(self, piece: str) -> None:
        self._emit(self._split().feed(piece))

    def control(self, spelling: str) -> None:
        self._emit(self._split().feed(spelling, control=True))

    def reasoning(self, piece: str) -> None:  # (a server that splits the reply itself)
        self.reasoning_parts.append(piece)
        self.sink.reasoning(piece)

    def progress(self, done: int, total: int) -> None:
        self.sink.progress(done, total)

    def stopped(self) -> bool:
        return self.sink.stopped()

    def finish(self) -> tuple[str, str]:
        """The reply is over: (its reasoning, its answer), as they streamed."""
        if self._splitter is not None:
            self._emit(self._splitter.flush())
        return "".join(self.reasoning_parts), "".join(self.answer)

    def _emit(self, pieces: list[tuple[bool, str]]) -> None:
        for is_reasoning, text in pieces:
            if is_reasoning:
                self.reasoning_parts.append(text)
                self.sink.reasoning(text)
            else:
                self.answer.append(text)
                self.sink.text(text)
