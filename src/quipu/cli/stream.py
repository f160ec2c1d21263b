"""A reply of `quipu run` on the terminal, as it streams."""

from __future__ import annotations

import json
import time
from typing import Callable

from quipu.app.answer import Answer
from quipu.app.turns import ReplySink
from quipu.cli.render import Renderer
from quipu.cli.terminal import Dim, PrefillProgress, Terminal


class TerminalStream(ReplySink):
    """Where `quipu run` sends a reply: the answer to stdout as it comes (or one JSON object at
    the end), a thinking model's reasoning dimmed on a terminal's stderr (unless `quiet`), the
    prompt's progress; `stopper` says when Ctrl-C asked the reply to stop."""

    def __init__(self, term: Terminal, as_json: bool, quiet: bool, stopper: Callable[[], bool],
                 threads: int | None = None) -> None:
        self.term, self.as_json, self.quiet, self._stopper = term, as_json, quiet, stopper
        self.progress_bar = PrefillProgress(term)
        self.wrote: list[str] = []
        self.thought = False
        self.finished = False
        self.pace = Pace(threads=threads)

    def text(self, piece: str) -> None:
        self.pace.took()
        if self.as_json:
            return
        term = self.term
        if self.thought and not self.wrote:
            term.err("\n")  # the reasoning ends its line before the answer starts
        term.out(piece)
        self.wrote.append(piece[-1:])

    def reasoning(self, piece: str) -> None:
        # Reasoning is for a person watching: stderr, dimmed, and only on a terminal; pipes get the answer.
        term = self.term
        if not self.as_json and not self.quiet and term.stderr_tty:
            term.err(Dim(piece))
            self.thought = True

    def progress(self, done: int, total: int) -> None:
        self.progress_bar(done, total)

    def stopped(self) -> bool:
        return self._stopper()

    def end_line(self) -> None:
        if self.wrote and self.wrote[-1] != "\n" and not self.finished:
            self.term.out("\n")

    def finish(self, result: Answer) -> None:
        """The answer's end: out, and the pipe let go, before anything else is written to disk."""
        term = self.term
        self.finished = True
        self.progress_bar.close()
        if self.as_json:
            term.out(json.dumps(result.to_json(), ensure_ascii=False) + "\n")
        elif self.wrote and self.wrote[-1] != "\n" or not self.wrote:
            term.out("\n")
        term.release_stdout()
        slowed = self.pace.slowed()
        if slowed is not None:
            term.warn(slowed)


class Pace:
    """When each piece of a reply came: a reply whose pieces come far slower at its end than at
    its start (another program took the cores its threads wait for) is said once it is out, with
    what to try where the thread count was fixed (`threads`; None: quipu follows the load)."""

    EARLY, LATE = 16, 32  # pieces the pace is measured over, at the start and at the end
    SLOWER = 3.0  # as many times slower as says something took the cores
    LEAST_S = 2.0  # a reply shorter than this says nothing

    def __init__(self, clock: Callable[[], float] = time.perf_counter, threads: int | None = None) -> None:
        self.clock, self.threads = clock, threads
        self.at: list[float] = []

    def took(self) -> None:
        self.at.append(self.clock())

    def slowed(self) -> str | None:
        """What to say of a reply that slowed down (None: it kept its pace)."""
        at = self.at
        if len(at) < 1 + self.EARLY + self.LATE or at[-1] - at[1] < self.LEAST_S:
            return None
        early = self.EARLY / (at[1 + self.EARLY] - at[1])  # (the first piece waits for the prompt)
        late = self.LATE / (at[-1] - at[-1 - self.LATE])
        if late * self.SLOWER > early:
            return None
        slowed = f"the reply slowed from {early:.0f} to {late:.1f} tokens a second: another program may be using the cores"
        if self.threads is None:
            return slowed + " (quipu gives it fewer threads as the load comes)"
        if self.threads <= 1:
            return slowed + " its one thread waits for"
        fewer = ", ".join(str(k) for k in range(1, min(self.threads, 3)))
        return (f"{slowed} its {self.threads} threads wait for; fewer (--threads {fewer}), or none given (quipu then "
                "follows the machine's load), may keep it fast")


class ChatStream(ReplySink):
    """A reply's sink in the chat: `renderer` shows it, `stopper` says Ctrl-C stops it; the
    prompt's reading shows on `progress`. Once Ctrl-C is pressed nothing more is shown, and
    what the reply keeps is what showed (`seen`)."""

    def __init__(self, renderer: Renderer, stopper: Callable[[], bool], progress: Callable[[int, int], None]):
        self.renderer, self._stopper, self._progress = renderer, stopper, progress
        self.fed: list[str] = []  # the answer's pieces given the renderer

    def text(self, piece: str) -> None:
        if not self._stopper():
            self.fed.append(piece)
            self.renderer.feed(piece)

    def seen(self, answer: str) -> str:
        """What of a stopped reply's answer showed: what the renderer was given, but the word it
        held back (a Ctrl-C shows nothing more)."""
        fed = "".join(self.fed)
        shown = fed[:len(fed) - len(self.renderer.unshown())]
        return shown if answer.startswith(shown) else answer

    def reasoning(self, piece: str) -> None:
        if not self._stopper():
            self.renderer.feed_reasoning(piece)

    def progress(self, done: int, total: int) -> None:
        self._progress(done, total)

    def stopped(self) -> bool:
        return self._stopper()
