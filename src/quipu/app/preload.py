"""A one-shot's model loaded beside what the command does before it needs it. llama.cpp's load
and its context's making run in C, where Python's other thread runs on: a `quipu run` begins
them on a thread of its own as soon as it knows the model and its settings, and reads the rest
of itself (its modules, the prompt's template) meanwhile. The turn's `load_backend` takes what
was begun where it asks for the same model and settings; anything else closes it unused."""

from __future__ import annotations

import atexit
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quipu.engine.llama import LlamaBackend
    from quipu.engine.settings import ContextSettings, Offload


@dataclass
class _Begun:
    key: tuple[Any, ...]
    thread: threading.Thread
    cancel: threading.Event = field(default_factory=threading.Event)
    done: list[Any] = field(default_factory=list)  # the backend, or what its load raised

    def wait(self) -> LlamaBackend:
        self.thread.join()
        if isinstance(self.done[0], BaseException):
            raise self.done[0]
        backend: LlamaBackend = self.done[0]
        return backend

    def drop(self) -> None:
        """Given up: its load stops at the next tensor, and what was made is closed."""
        self.cancel.set()
        self.thread.join()
        if self.done and not isinstance(self.done[0], BaseException):
            self.done[0].close()


_begun: list[_Begun] = []
_lock = threading.Lock()


def _key(model_path: Path, settings: ContextSettings, verbose: bool, where: Offload) -> tuple[Any, ...]:
    return (Path(model_path).resolve(), settings, verbose, where)


def begin(model_path: Path, settings: ContextSettings, verbose: bool, where: Offload) -> None:
    """Begins loading `model_path` with these settings, for a turn that `take`s it."""
    begun = _Begun(_key(model_path, settings, verbose, where), threading.Thread())

    def load() -> None:
        from quipu.engine.llama import LlamaBackend

        try:
            begun.done.append(LlamaBackend(model_path, settings, verbose=verbose, offload=where,
                                           cancelled=begun.cancel.is_set))
        except BaseException as exc:  # (raised where the turn takes it)
            begun.done.append(exc)

    begun.thread = threading.Thread(target=load, name="quipu-preload", daemon=True)
    with _lock:
        _begun.append(begun)
    begun.thread.start()


def take(model_path: Path, settings: ContextSettings, verbose: bool, where: Offload) -> LlamaBackend | None:
    """The backend begun for this model and these settings (what its load raised is raised
    here), or None where none was begun or another was (which is closed unused)."""
    with _lock:
        if not _begun:
            return None
        begun = _begun.pop()
    if begun.key != _key(model_path, settings, verbose, where):
        begun.drop()
        return None
    return begun.wait()


@atexit.register
def _settle() -> None:
    """A load begun and never taken (the command ended before its turn) ends before the process
    does, not inside llama.cpp as the process's own teardown runs."""
    with _lock:
        left = list(_begun)
        _begun.clear()
    for begun in left:
        begun.drop()
