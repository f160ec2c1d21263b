"""Threads that follow the machine's load. llama.cpp's threads wait for each other at every step
of a graph, so one thread whose core another program holds slows them all: on a busy machine
fewer threads go faster. A context computed with the threads quipu chooses (no `--threads`)
starts with the cores the machine leaves free, then times each step and tries another count now
and then, keeping the faster (llama.cpp takes a new count between decodes). Where the sums do not
depend on the thread count (flash attention off on the CPU: `llama_context.py`), no change of
threads changes a bit of what the model computes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

PROBE_FIRST = 8  # steps of a size between tries of another count, at first and after the load changed
PROBE_MOST = 256  # the most steps between tries, where every try found the count in use faster
BETTER = 0.9  # a count tried is taken where its steps take at most this share of the one in use
SLOWER = 1.5  # steps lately this many times slower (or faster) than the count's usual say the load changed
WEIGHT = 0.25  # of a step's time in a count's running mean of late
USUAL = 0.02  # of a step's time in a count's usual (a mean over many steps: a core shared in turns
# with another program makes single steps uneven, which says nothing by itself)


def running_elsewhere(path: str = "/proc/loadavg", own: str = "/proc/self/task") -> int | None:
    """How many threads of other programs are running now, as the kernel counts them (the
    fourth field of /proc/loadavg, less this process's threads that run: the one asking, and
    any other, such as the one that hashes a model file as it loads); None where it cannot be
    read."""
    try:
        with open(path) as f:
            running = int(f.read().split()[3].split("/")[0])
        mine = 0
        for task in os.listdir(own):
            try:
                with open(f"{own}/{task}/stat") as f:
                    mine += f.read().rpartition(")")[2].split()[0] == "R"
            except (OSError, IndexError):
                continue  # (a thread that ended meanwhile)
        return max(0, running - max(1, mine))
    except (OSError, IndexError, ValueError):
        return None


def free_cores(most: int, cpus: int, running: Callable[[], int | None] = running_elsewhere) -> int:
    """The threads to start with: `most` (one a physical core), fewer where other programs run
    on the `cpus` this process may use (at least one)."""
    busy = running()
    if busy is None:
        return most
    return max(1, min(most, cpus - busy))


@dataclass
class _Pace:
    """A thread count's running means of a step's seconds, for steps of one size: of late, and
    usual (over many steps)."""

    mean: float
    usual: float
    steps: int = 1

    def add(self, seconds: float) -> bool:
        """Counts a step in; whether its count's pace changed of late (the load changed)."""
        self.mean += WEIGHT * (seconds - self.mean)
        self.usual += USUAL * (seconds - self.usual)
        self.steps += 1
        if self.steps >= 16 and not 1 / SLOWER < self.mean / self.usual < SLOWER:
            self.usual = self.mean  # (the new pace is the usual one from now on)
            return True
        return False


class ThreadTuner:
    """Chooses the threads of each step from what steps took: `took(n, seconds)` after each step
    of `n` tokens, and `set_threads(count)` where it changes. A count is compared only on steps
    of the same size (a decode's token, a prompt's step), each with its own running mean."""

    def __init__(self, start: int, most: int, set_threads: Callable[[int], None], *,
                 free: Callable[[], int] | None = None):
        self.current, self.most, self._set, self._free = start, max(1, most), set_threads, free
        self._paces: dict[tuple[int, int], _Pace] = {}  # (step size, threads): its pace
        self._gap: dict[int, int] = {}  # step size: steps between tries
        self._since: dict[int, int] = {}  # step size: steps since the last try
        self._trying: tuple[int, int, list[float]] | None = None  # (step size, count it returns to, times)
        self._turn = 0  # which neighbour the next try takes

    def took(self, n: int, seconds: float) -> None:
        """A step of `n` tokens took `seconds` with the current count."""
        if self._trying is not None:
            self._tried(n, seconds)
            return
        pace = self._paces.get((n, self.current))
        if pace is None:
            self._paces[(n, self.current)] = _Pace(seconds, seconds)
        elif pace.add(seconds):  # (another program came, or went: the other counts are worth a try again)
            self._gap[n] = PROBE_FIRST
        since = self._since[n] = self._since.get(n, 0) + 1
        if since >= self._gap.setdefault(n, PROBE_FIRST) and self.most > 1:
            self._try(n)

    def _candidate(self) -> int:
        """The count to try: the machine's free cores, where they are not the count in use, else a
        neighbour of it, never more than the free cores (threads beyond them wait at every one
        of a step's hundreds of barriers for a core another program holds: a step of seconds)."""
        free = self._free() if self._free is not None else None
        most = self.most if free is None else max(1, min(self.most, free))
        if free is not None and most != self.current:
            return most
        self._turn += 1
        down, up = self.current - 1, self.current + 1
        if down < 1:
            return up if up <= most else self.current
        if up > most:
            return down
        return down if self._turn % 2 else up

    def _try(self, n: int) -> None:
        other = self._candidate()
        self._since[n] = 0
        if other == self.current:  # (nothing to try now: later)
            self._back_off(n)
            return
        self._trying = (n, self.current, [])
        self._switch(other)

    def _tried(self, n: int, seconds: float) -> None:
        assert self._trying is not None
        size, back, times = self._trying
        if n != size:  # (a step of another size between: the try goes on at the next of its size)
            return
        times.append(seconds)
        known = self._paces.get((size, self.current))
        if len(times) < 2 and (known is None or known.mean < 2 * self._paces[(size, back)].mean):
            return  # (two steps, unless this count is known to be far slower: one costs less)
        self._trying = None
        tried = sum(times) / len(times)
        pace = self._paces.setdefault((size, self.current), _Pace(tried, tried))
        pace.mean = pace.usual = tried
        if tried <= BETTER * self._paces[(size, back)].mean:
            self._gap[size] = PROBE_FIRST  # (better: stays, and tries again soon)
            return
        self._back_off(size)
        self._switch(back)

    def _back_off(self, n: int) -> None:
        """The next try for steps of `n` tokens twice as far off (at most PROBE_MOST steps)."""
        self._gap[n] = min(PROBE_MOST, 2 * self._gap.get(n, PROBE_FIRST))

    def _switch(self, count: int) -> None:
        self.current = count
        self._set(count)
