"""A thinking model's reasoning, as its template writes it: the one table of reasoning formats,
and the split of a reply into its reasoning and its answer, as it streams and once it is done.

A format is the markup around the reasoning and the answer: `<think>...</think>` (Qwen3,
DeepSeek-R1, GLM, SmolLM3, ...), `<seed:think>`, `[THINK]...[/THINK]` (Magistral, Ministral 3
Reasoning), `<|START_THINKING|>...<|END_THINKING|><|START_RESPONSE|>...` (Command R7B),
`<|channel>thought ...<channel|>` (Gemma 4), `<|inner_prefix|>...<|inner_suffix|>` (Apertus),
and harmony's channels (`<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final
<|message|>...`, GPT-OSS), whose messages each begin with a header.

Where a template renders a message's reasoning, its format is found by rendering it
(`reasoning_found.py`), so a new model in a known style needs no new row. A template that never renders reasoning is known by
the markup its source spells (`TABLE`); one in no known style has none: its replies are answers.

Markup may be control tokens, which a reply's text does not show: the splitter is fed the
spelling of each control token apart from the text (`feed(text, control=True)`), so it sees the
markup whatever its tokens, and shows none of the control tokens it does not read.
"""

from __future__ import annotations

from typing import Any

from dataclasses import dataclass

from quipu.sessions.stops import pending_prefix

__all__ = ["ReasoningFormat", "Splitter", "TABLE", "FIELDS", "Thinking"]

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
    # Markup the model may write out of its place, which is never shown (harmony's tokens reach
    # a reply as text: llama.cpp does not mark them as control tokens).
    stray: tuple[str, ...] = ()

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

    def _emit(self, out: list[Any], reasoning: bool, n: int) -> None:
        text = self._buf[:n]
        if any(self._ctl[:n]):  # (a control token's spelling is not shown)
            text = "".join(c for c, ctl in zip(text, self._ctl[:n], strict=True) if not ctl)
        if text:
            out.append((reasoning, text))
        self._drop(n)

    def _drop(self, n: int) -> None:
        self._buf, self._ctl = self._buf[n:], self._ctl[n:]

    def _step(self, out: list[Any]) -> bool:
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
            stray = [(at, m) for m in fmt.stray if (at := buf.find(m)) >= 0]
            at = buf.find(fmt.close)
            if stray and (at < 0 or min(stray)[0] < at):
                where, mark = min(stray)
                self._emit(out, True, where)
                self._drop(len(mark))
                return True
            if at >= 0:
                self._emit(out, True, at)
                self._drop(len(fmt.close))
                self._mark_outside(0)
                self.state = AFTER
                return True
            keep = pending_prefix(buf, (fmt.close, *fmt.stray))
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
        if not fmt.headers:  # (reasoning may begin after some answer: where its opener comes as a control token)
            opened = [(at, o) for o in fmt.opens if (at := buf.find(o)) >= 0 and all(self._ctl[at:at + len(o)])]
            if opened:
                at, opener = min(opened)
                self._emit(out, False, at)
                self._drop(len(opener))
                self.state, self.reasoned = REASONING, True
                return True
        found = [(buf.find(m), m) for m in (*fmt.answer_closes, *starts, *fmt.stray) if m and buf.find(m) >= 0]
        if found:
            at, mark = min(found)
            self._emit(out, False, at)
            if mark in fmt.stray and mark not in (*fmt.answer_closes, *starts):
                self._drop(len(mark))  # (out of its place: not shown)
            elif mark in starts:
                self.state = HEADER
            else:
                self._drop(len(mark))
                self.state = AFTER if starts else ANSWER
            return True
        keep = pending_prefix(buf, tuple(m for m in (*fmt.answer_closes, *starts, *fmt.stray) if m))
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
                          between="<|end|><|start|>assistant<|channel|>final<|message|>",
                          stray=("<|message|>", "<|constrain|>", "<|call|>", "<|start|>", "<|channel|>", "<|end|>",
                                 "<|return|>"))

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


@dataclass(frozen=True)
class Thinking:
    """A reply's reasoning: its format (None: none quipu reads), whether the reply begins inside
    it (its prompt opened it), and at most how many tokens it may take (None: no limit)."""

    fmt: ReasoningFormat | None = None
    inside: bool = False
    budget: int | None = None

    def splitter(self) -> Splitter:
        return Splitter(self.fmt, self.inside)
