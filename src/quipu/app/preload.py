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
    from quipu.app.environment import Environment
    from quipu.app.turn_options import TurnOptions
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


def begin(opts: TurnOptions, env: Environment) -> None:
    """Begins loading the model a one-shot with `opts` runs on (none for a server's, or for a
    session's, whose settings its files hold), unless that cannot be said now: the turn then
    loads it as it always does, and says what went wrong."""
    from quipu.app.turn_options import context_settings, offload
    from quipu.errors import QuipuError

    if opts.server is not None or opts.session is not None:
        return
    try:
        settings, where = context_settings(opts, env), offload(opts, env)
        _, model_path = env.resolve_model(opts.model)
    except QuipuError:
        return
    begun = _Begun(_key(model_path, settings, opts.verbose, where), threading.Thread())

    def load() -> None:
        from quipu.engine.llama import LlamaBackend

        try:
            begun.done.append(LlamaBackend(model_path, settings, verbose=opts.verbose, offload=where,
                                           cancelled=begun.cancel.is_set))
        except BaseException as exc:  # (raised where the turn takes it)
            begun.done.append(exc)

    begun.thread = threading.Thread(target=load, name="quipu-preload", daemon=True)
    with _lock:
        _begun.append(begun)
    begun.thread.start()
    if not opts.raw:  # (meanwhile, what renders the prompt's template)
        from quipu.sessions.template import prepare

        prepare()


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
