"""A reply on the chat's screen as it streams: plain text wrapped between words at the
terminal's width (`PlainRenderer`, `WordWrap`), or Markdown re-rendered as it grows
(`MarkdownRenderer`), with a thinking model's reasoning shown dimmed or hidden."""

from __future__ import annotations

from typing import Protocol

from quipu.cli.terminal import Dim, Label, Terminal

class Renderer(Protocol):
    """A reply on the chat's screen as it streams: its answer, its reasoning, and its end."""

    def feed(self, text: str) -> None: ...
    def feed_reasoning(self, text: str) -> None: ...
    def close(self, stopped: bool = False) -> None: ...
    def unshown(self) -> str:
        """The end of the text fed that is not on the screen yet (a word held back to wrap it), which closing stopped drops."""


class WordWrap:
    """Breaks a streamed reply between words at the terminal's width, as it comes: a word is
    held until it ends (a space or a line's end), then put on the line if it fits, else on the
    next. A word wider than the terminal is left to the terminal."""

    def __init__(self, width: int):
        self.width = max(width, 8)
        self.column = 0
        self.word = ""

    def push(self, text: str) -> str:
        out = []
        for char in text:
            if char in " \n":
                out.append(self._place(self.word))
                self.word = ""
                if char == "\n":
                    out.append("\n")
                    self.column = 0
                elif self.column < self.width:
                    out.append(" ")
                    self.column += 1
            else:
                self.word += char
        return "".join(out)

    def flush(self) -> str:
        out, self.word = self._place(self.word), ""
        return out

    def new_line(self) -> None:
        """The line was ended apart from the text pushed: what follows starts a line."""
        self.column = 0

    def drop_word(self) -> None:
        """Forgets the word held (nothing more of it is shown)."""
        self.word = ""

    def _place(self, word: str) -> str:
        if not word:
            return ""
        size = _cells(word)
        if self.column and self.column + size > self.width:
            self.column = size % self.width
            return "\n" + word
        self.column = (self.column + size) % self.width if self.column + size > self.width else self.column + size
        return word


def _cells(text: str) -> int:
    """How many terminal columns `text` takes (wide East Asian characters take two)."""
    from prompt_toolkit.utils import get_cwidth

    return sum(get_cwidth(c) for c in text)


REPLY_MARK = "● "  # (before a chat's reply on a colour terminal: whose words follow)


class PlainRenderer:
    def __init__(self, term: Terminal, show_thinking: bool = True, marked: bool = False):
        import shutil

        self.term = term
        self.show_thinking = show_thinking
        self.mark = REPLY_MARK if marked and term.stdout_tty and term.color else ""
        self.last = ""  # an empty reply still ends its line, so replies stay one per line
        self.thinking = False
        # On a terminal, lines break between words; a pipe gets the text as it is.
        self.wrap = WordWrap(shutil.get_terminal_size().columns) if term.stdout_tty else None

    def _out(self, text: str, dim: bool = False) -> None:
        if self.mark:  # (the reply's first words come after its mark, on its line)
            self.term.out(Label(self.mark))
            if self.wrap is not None:
                self.wrap.column = _cells(self.mark)
            self.mark = ""
            text = text.lstrip(" ")  # (a reply continued begins with its space: the mark's is enough)
        if self.wrap is not None:
            text = self.wrap.push(text)
        if text:
            self.term.out(Dim(text) if dim else text)
            self.last = text[-1:]

    def _end_word(self, dim: bool) -> None:
        if self.wrap is not None:
            rest = self.wrap.flush()
            if rest:
                self.term.out(Dim(rest) if dim else rest)
                self.last = rest[-1:]

    def feed(self, text: str) -> None:
        if self.thinking:
            self._end_word(dim=True)
            self.thinking = False
            if self.last != "\n":
                self.term.out("\n")
                self.last = "\n"
                if self.wrap is not None:
                    self.wrap.new_line()
        self._out(text)

    def feed_reasoning(self, text: str) -> None:
        if self.show_thinking:
            self.thinking = True
            self._out(text, dim=True)

    def unshown(self) -> str:
        return self.wrap.word if self.wrap is not None and not self.thinking else ""

    def close(self, stopped: bool = False) -> None:
        if stopped and self.wrap is not None:
            self.wrap.drop_word()  # nothing shows after a Ctrl-C (the reply keeps the word)
        self._end_word(dim=self.thinking)
        if self.last != "\n":
            self.term.out("\n")
        else:
            self.term.out()


class MarkdownRenderer:
    """Re-renders the reply as Markdown while it streams (rich Live), at most ~12 times a second."""

    def __init__(self, term: Terminal, show_thinking: bool = True):
        self.show_thinking = show_thinking
        self.reasoning = ""
        self.text = ""
        self.mark = REPLY_MARK.strip() if term.color else ""  # (on a line of its own: a reply's Markdown begins freely)
        self.live, self.safe = term.live()  # (the model's text escaped before it is rendered)
        self.live.start()

    def feed(self, text: str) -> None:
        self.text += text
        self._update()

    def feed_reasoning(self, text: str) -> None:
        if self.show_thinking:
            self.reasoning += text
            self._update()

    def _update(self) -> None:
        from rich.console import Group
        from rich.markdown import Markdown
        from rich.text import Text

        parts = [Text(self.safe(self.reasoning.strip()), style="dim")] if self.reasoning.strip() else []
        mark = [Text(self.mark, style="bold")] if self.mark and self.text else []
        self.live.update(Group(*parts, *mark, Markdown(self.safe(self.text))))

    def unshown(self) -> str:
        return ""  # (all of it shows as the live view stops)

    def close(self, stopped: bool = False) -> None:
        self.live.stop()
