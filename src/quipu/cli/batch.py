"""`quipu run --batch FILE`: rows in, JSON lines out in input order, a progress bar on stderr."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import json
import time

from quipu.cli.terminal import StopOnCtrlC, Terminal, read_stdin
from quipu.errors import BadInput, ExitCode

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from quipu.app.batch import RowOutcome
    from quipu.app.environment import Environment
    from quipu.app.turn_options import TurnOptions


def run_batch_file(source: str, opts: TurnOptions, env: Environment, term: Terminal, parallel: int | None,
                   fill: Callable[[str], str] = lambda text: text) -> int:
    from quipu.app.batch import run_batch
    from quipu.app.user_files import read_text_file

    if source == "-":
        text = read_stdin(term)
        if text is None:
            raise BadInput("--batch - reads the rows from standard input, and nothing is piped in")
    else:
        text = read_text_file(source, "batch file")
        if "\x00" in text:
            raise BadInput(f"the batch file {source} is binary data, not text")
    progress = BatchProgress(term)

    def on_row(outcome: RowOutcome) -> None:
        term.out(json.dumps(outcome.to_json(), ensure_ascii=False) + "\n")

    try:
        with StopOnCtrlC() as stopper:
            run_batch(text, opts, env, parallel=parallel, on_row=on_row, on_progress=progress, should_stop=stopper,
                      on_notice=term.warn, fill=fill)
    finally:
        progress.close()
    return ExitCode.INTERRUPTED if stopper.requested else ExitCode.OK


class BatchProgress:
    """Rows done and tokens per second, on stderr, only on a terminal."""

    def __init__(self, terminal: Terminal):
        self.terminal = terminal
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._started = time.perf_counter()

    def __call__(self, done: int, total: int, tokens: int) -> None:
        if not self.terminal.stderr_tty:
            return
        if self._progress is None:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
            )

            self._progress = Progress(TextColumn("rows"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[rate]}"), console=self.terminal.err_console(),
                                      transient=True)
            self._progress.start()
            self._task = self._progress.add_task("rows", total=total, rate="")
        rate = tokens / max(time.perf_counter() - self._started, 1e-9)
        assert self._task is not None
        self._progress.update(self._task, completed=done, rate=f"{rate:.0f} tok/s")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
