"""Terminal facts and terminal plumbing: TTYs, colour, Ctrl-C, progress bars, and the one
writer of the command line's output (`Terminal.out`, `err`, `table`, `styled`): on a terminal,
every character it would act on escaped (`quipu.shown`), whoever wrote the text; to a pipe, the
text as it is."""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from typing import Any, Callable, TYPE_CHECKING, IO, Iterable, Mapping, Sequence

from quipu.errors import BadInput, tell_to_stop

if TYPE_CHECKING:
    from rich.console import Console

    from quipu.app.branches import BranchRow
    from rich.live import Live
    from rich.progress import Progress, TaskID


class Dim(str):
    """A part of a line to show dimmed on a colour terminal (reasoning, asides, headings)."""

    SGR = ("2", "22")  # (the terminal's codes that start the style and end it)


class Label(str):
    """The mark before a chat's reply, green and bold on a colour terminal (what you type
    follows a cyan one)."""

    SGR = ("1;32", "22;39")


def _safe(text: str) -> str:
    from quipu.shown import shown

    return shown(text.replace("\r\n", "\n"), lines=True)


@dataclass(frozen=True)
class Terminal:
    """What the CLI needs to know about where it runs; made once, passed down."""

    stdin: IO[str]
    stdout: IO[str]
    stderr: IO[str]
    stdin_tty: bool
    stdout_tty: bool
    stderr_tty: bool
    color: bool

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> "Terminal":
        environ = os.environ if environ is None else environ
        for stream in (sys.stdout, sys.stderr):
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(errors="replace")
        return cls(
            sys.stdin,
            sys.stdout,
            sys.stderr,
            _isatty(sys.stdin),
            _isatty(sys.stdout),
            _isatty(sys.stderr),
            color="NO_COLOR" not in environ and _isatty(sys.stderr),
        )

    def err_console(self) -> Console:
        """A console on stderr for quipu's own progress bars (their labels are quipu's words)."""
        from rich.console import Console

        return Console(file=self.stderr, no_color=not self.color, highlight=False, soft_wrap=True)

    def out(self, *parts: str) -> None:
        """`parts` to stdout, now; each escaped on a terminal (line breaks and tabs kept), a
        `Dim` or `Label` one styled after; to a pipe, exactly as given (a reply, JSON)."""
        self._write(self.stdout, self.stdout_tty, parts)

    def err(self, *parts: str) -> None:
        """`parts` to stderr, now, as `out` writes them."""
        self._write(self.stderr, self.stderr_tty, parts)

    def _write(self, stream: IO[str], tty: bool, parts: Sequence[str]) -> None:
        text = "".join(self._part(p) if tty else p for p in parts)
        if text:
            stream.write(text)
        stream.flush()

    def _part(self, part: str) -> str:
        safe = _safe(part)
        style = getattr(part, "SGR", None)
        return f"\x1b[{style[0]}m{safe}\x1b[{style[1]}m" if style and self.color and safe else safe

    def table(self, columns: Sequence[str], rows: Iterable[Sequence[str]]) -> None:
        """A table to stdout, each cell escaped (a pipe gets it unwrapped: 400 columns)."""
        from rich.table import Table
        from rich.text import Text

        from quipu.shown import shown

        table = Table(*columns, box=None, pad_edge=False)
        for row in rows:  # (Text: a cell's brackets are not rich's markup)
            table.add_row(*(Text(shown(cell)) for cell in row))
        self._console(wrap_to_terminal=True).print(table)

    def styled(self, text: str, style: str = "") -> None:
        """A line (or several) to stdout in a rich style, escaped (lines kept); on a terminal
        wrapped at words, in a pipe each line as it is."""
        from rich.text import Text

        self._console(wrap_to_terminal=False).print(Text(_safe(text), style=style))

    def live(self) -> tuple[Live, Callable[[str], str]]:
        """A live region of stdout (the chat's Markdown reply) and how outside text must be
        escaped before it is rendered there."""
        from rich.live import Live

        return Live(console=self._console(wrap_to_terminal=False, markup=True), refresh_per_second=12,
                    vertical_overflow="visible"), _safe

    def _console(self, wrap_to_terminal: bool, markup: bool = False) -> Console:
        from rich.console import Console

        if wrap_to_terminal:
            return Console(file=self.stdout, no_color=not self.color, highlight=False,
                           width=None if self.stdout_tty else 400)
        if markup:
            return Console(file=self.stdout, no_color=not self.color)
        return Console(file=self.stdout, no_color=not self.color, highlight=False, soft_wrap=not self.stdout_tty)

    def release_stdout(self) -> None:
        """Lets a reader of our piped output see its end now (anything later is discarded)."""
        if self.stdout_tty:
            return
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass  # not a real file (tests, embedding): nothing is waiting on it

    def warn(self, message: str) -> None:
        """A warning on stderr, escaped even in a pipe (it may name what came from outside)."""
        from quipu.shown import shown

        self.err(f"quipu: warning: {shown(message, lines=True)}\n")


def say_error(message: str) -> None:
    """`quipu: error: ...` on stderr, escaped even in a pipe: for where no `Terminal` is made."""
    from quipu.shown import shown

    sys.stderr.write(f"quipu: error: {shown(message, lines=True)}\n")
    sys.stderr.flush()


def say_plainly(text: str, stream: IO[str] | None = None) -> None:
    """quipu's own words (a version, a closing line), where no `Terminal` is made."""
    where = sys.stderr if stream is None else stream
    where.write(text)
    where.flush()


def _isatty(stream: IO[str] | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (ValueError, OSError):
        return False


class StopOnCtrlC:
    """While active, the first Ctrl-C asks the work to stop at the next token; a second one
    interrupts at once, unless `hard_second` is off (the chat never dies of Ctrl-C)."""

    def __init__(self, hard_second: bool = True, quit_too: bool = False) -> None:
        self.requested = False
        self.hard_second = hard_second
        self.quit_too = quit_too  # Ctrl-\ (SIGQUIT) stops too (the chat)
        self.ended = False  # SIGTERM or SIGHUP came: the reply stops, is saved, and quipu leaves
        self._previous: "signal._HANDLER" = None
        self._previous_quit: "signal._HANDLER" = None
        self._previous_ends: list[Any] = []

    def __call__(self) -> bool:
        return self.requested

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested and self.hard_second:
            raise KeyboardInterrupt
        self.requested = True
        tell_to_stop()

    def _quit(self, signum: int, frame: object) -> None:
        self.requested = True
        tell_to_stop()

    def _end(self, signum: int, frame: object) -> None:
        self.requested = self.ended = True
        tell_to_stop()

    def __enter__(self) -> "StopOnCtrlC":
        tell_to_stop(False)
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
            if self.quit_too and hasattr(signal, "SIGQUIT"):
                self._previous_quit = signal.signal(signal.SIGQUIT, self._quit)
            for name in ("SIGTERM", "SIGHUP"):
                if hasattr(signal, name):
                    signum = getattr(signal, name)
                    self._previous_ends.append((signum, signal.signal(signum, self._end)))
        except ValueError:  # not the main thread
            self._previous = None
        return self

    def __exit__(self, *exc: object) -> None:
        tell_to_stop(False)
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        if self._previous_quit is not None:
            signal.signal(signal.SIGQUIT, self._previous_quit)
        for signum, previous in self._previous_ends:
            signal.signal(signum, previous)


class HeldKeys:
    """While a reply streams: what is typed is not echoed into the reply but kept, in the
    terminal's own input buffer, for the next prompt, which shows it below the reply. (Ctrl-C
    and Ctrl-\\ still reach quipu; a question asked meanwhile reads its keys as it always does.)"""

    def __init__(self, term: Terminal) -> None:
        self.on = term.stdin_tty
        self._saved: list[Any] | None = None

    def __enter__(self) -> "HeldKeys":
        if not self.on:
            return self
        try:
            import termios
        except ImportError:  # (no termios here: keys echo as they always did)
            return self
        try:
            fd = sys.stdin.fileno()
            self._saved = termios.tcgetattr(fd)
            quiet = termios.tcgetattr(fd)
            quiet[3] &= ~termios.ECHO  # (the local modes: no echo; lines and signals as they were)
            termios.tcsetattr(fd, termios.TCSANOW, quiet)  # (TCSANOW: what was typed already stays)
        except (termios.error, OSError, ValueError):  # a terminal it cannot set
            self._saved = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            import termios

            try:
                termios.tcsetattr(sys.stdin.fileno(), termios.TCSANOW, self._saved)
            except (termios.error, OSError, ValueError):
                pass


class PrefillProgress:
    """A progress bar on stderr for long prompts, shown only on a terminal."""

    MIN_TOKENS = 1024

    def __init__(self, terminal: Terminal, label: str = "reading the prompt"):
        self.terminal = terminal
        self.label = label
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def __call__(self, done: int, total: int) -> None:
        if not self.terminal.stderr_tty or total < self.MIN_TOKENS:
            return
        if self._progress is None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn(self.label),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                console=self.terminal.err_console(),
                transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task(self.label, total=total)
        assert self._task is not None
        self._progress.update(self._task, completed=done)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


MAX_STDIN_BYTES = 64 * 1024 * 1024


def gather_prompt(prompt: str | None, term: Terminal, *, allow_empty: bool = False) -> str | None:
    """Piped stdin, then a blank line, then the argument; binary stdin is refused."""
    piped = read_stdin(term)
    piped = piped.rstrip("\n") or None if piped is not None else None
    # The piped text first: questions about one document then share it as a cached beginning.
    parts = [p for p in (piped, prompt) if p]
    if not parts:
        if allow_empty:
            return None
        raise BadInput("no prompt: give one as an argument or pipe it on standard input")
    return "\n\n".join(parts)


def read_stdin(term: Terminal) -> str | None:
    """Piped standard input as text (None on a terminal): binary data is refused, and bytes
    that are not UTF-8 are replaced, with a warning."""
    if term.stdin_tty or term.stdin is None:
        return None
    try:
        data = term.stdin.buffer.read(MAX_STDIN_BYTES + 1)  # type: ignore[attr-defined]  # (its bytes; caught below where it has none)
    except (OSError, ValueError, AttributeError):
        data = b""
    if len(data) > MAX_STDIN_BYTES:
        raise BadInput(f"standard input is larger than {MAX_STDIN_BYTES // (1024 * 1024)} MB")
    if b"\x00" in data:
        raise BadInput("standard input is binary data, not text")
    try:
        return str(data.decode("utf-8"))
    except UnicodeDecodeError:
        term.warn("standard input is not valid UTF-8; undecodable bytes were replaced")
        return str(data.decode("utf-8", errors="replace"))


def local_time(when: float | str) -> str:
    """A moment (seconds since the epoch, or an ISO 8601 text with its offset) in this machine's
    time, to the minute: the one way quipu shows a time."""
    import time
    from datetime import datetime

    if isinstance(when, str):
        try:
            seconds = datetime.fromisoformat(when).timestamp()
        except ValueError:
            return when[:16].replace("T", " ")  # (a time quipu did not write so: shown as it is)
    else:
        seconds = when
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(seconds))


def tree_lines(rows: "Sequence[BranchRow]", columns: int) -> list[str]:
    """A conversation's branches, one a line, as deep as each hangs, to fit `columns`: the
    current one marked `*`; each with where it leaves the branch it hangs under, its first
    words, its turns, tokens and when it was last used."""
    from quipu.shown import shown

    out = []
    for r in rows:
        mark = "*" if r.current else " "
        head = f"{mark} {'  ' * r.depth}{'└ ' if r.depth else ''}{r.id}"
        where = f"from exchange {r.leaves_at}: " if r.under is not None else ""
        tail = f"  {r.turns} turn{'' if r.turns == 1 else 's'}, {r.tokens} tokens, {local_time(r.updated)}"
        room = max(12, columns - len(head) - len(tail) - 4)
        said = where + '"' + r.first + '"'
        out.append(f"{head}  {fit(shown(said), room)}{tail}")
    return out


def fit(text: str, width: int) -> str:
    """`text` in at most `width` characters, cut with an ellipsis."""
    return text if len(text) <= width else text[:width - 1] + "…"


def human_size(n: float) -> str:
    """A size in bytes as people read it (KB, MB, GB of 1,024)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
