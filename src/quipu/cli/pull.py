"""Pulling a model from the Hugging Face Hub, as a person sees it: what will be fetched and how
big it is, then a progress bar (bytes, speed, time left) on stderr when it is a terminal."""

from __future__ import annotations

from typing import TYPE_CHECKING

from quipu.shown import shown
from quipu.cli.terminal import Terminal, human_size

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from quipu.app.environment import Environment
    from quipu.app.hub import PulledModel, PullPlan


def pull(text: str, env: Environment, term: Terminal) -> PulledModel:
    """Pulls OWNER/REPO[:QUANT] (or hf:...) into the Hugging Face cache; the pulled model."""
    from quipu.app.hub import HubRef
    from quipu.app.hub_pull import pull as pull_model

    ref = HubRef.parse(text)
    bar = DownloadBar(term)

    def on_plan(plan: PullPlan) -> None:
        names = ", ".join(f.path for f in plan.files)
        size = plan.size
        if plan.projector is not None:
            names += f" and its projector {plan.projector.path}"
            size += plan.projector.size
        others = f" (also there: {', '.join(plan.others)})" if plan.others else ""
        term.err(shown(f"pulling {plan.repo} {plan.quant}: {names}, {human_size(size)}{others}") + "\n")
        bar.expect(size)

    try:
        model = pull_model(ref, env.dirs, on_plan=on_plan, on_progress=bar, on_wait=term.warn)
    finally:
        bar.close()
    return model


def pull_if_needed(env: Environment, requested: str | None, term: Terminal) -> None:
    """`--model hf:OWNER/REPO[:QUANT]` or a short name (`gemma3:1b`; or QUIPU_MODEL, or the
    config's) pulls it on first use."""
    ref = env.hub_ref(env.requested_model(requested))
    if ref is None:
        return
    from quipu.app.hub import pulled

    if pulled(ref, env.dirs) is None:
        pull(str(ref), env, term)


class DownloadBar:
    """Bytes, speed and time left of a pull (all its files as one), on a terminal's stderr only."""

    def __init__(self, term: Terminal):
        self.term = term
        self.total = 0
        self._done: dict[str, int] = {}
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def expect(self, total: int) -> None:
        """The bytes the pull fetches in all (its plan's), before the first file's come."""
        self.total = total

    def __call__(self, name: str, done: int, total: int) -> None:
        self._done[name] = done
        if not self.term.stderr_tty:
            return
        if self._progress is None:
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)

            self._progress = Progress(TextColumn("downloading"), BarColumn(), DownloadColumn(),
                                      TransferSpeedColumn(), TimeRemainingColumn(), console=self.term.err_console(),
                                      transient=True)
            self._progress.start()
            self._task = self._progress.add_task("pull", total=self.total or total or None)
        assert self._task is not None
        self._progress.update(self._task, completed=sum(self._done.values()))

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
