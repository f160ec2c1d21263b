"""Typed errors whose messages are written for users, and the exit codes they map to."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILURE = 1
    USAGE = 2
    INTERRUPTED = 130


class QuipuError(Exception):
    """Base of every error quipu reports to a user; `str(err)` is the one-line message."""

    exit_code: ExitCode = ExitCode.FAILURE


class Interrupted(QuipuError):
    """The user stopped the work (Ctrl-C) before there was anything to show."""

    exit_code = ExitCode.INTERRUPTED


class Ended(KeyboardInterrupt):
    """quipu was told to end (SIGTERM, SIGHUP): it stops as at Ctrl-C, and a chat leaves even
    at its prompt, where a Ctrl-C would not."""


# Whether quipu was told to stop (Ctrl-C, SIGTERM, SIGHUP) while a handler that only notes it is
# in place (a reply in progress: the terminal's `StopOnCtrlC`), for what waits on something
# outside, which no exception reaches (a file that is a FIFO without a writer: `waited`).
_TOLD_TO_STOP: list[bool] = [False]


def told_to_stop() -> bool:
    return _TOLD_TO_STOP[0]


def tell_to_stop(told: bool = True) -> None:
    """Notes that quipu was told to stop (False: forgets it, a new piece of work begins)."""
    _TOLD_TO_STOP[0] = told


class UsageError(QuipuError):
    """The user asked for something that cannot be done as asked (exit 2)."""

    exit_code = ExitCode.USAGE


class ModelNotFound(UsageError):
    """No model file could be resolved from the name, path, environment or config."""


class InvalidParameter(UsageError):
    """An option value is out of its range."""


class ContextOverflow(UsageError):
    """The prompt does not fit in the context window."""

    def __init__(self, prompt_tokens: int, n_ctx: int, *, at_least: bool = False, hint: str | None = None):
        size = f"more than {prompt_tokens}" if at_least else f"{prompt_tokens}"
        super().__init__(
            f"the prompt is {size} tokens but the context holds {n_ctx}; {hint or 'shorten it or raise --ctx'}"
        )
        self.prompt_tokens = prompt_tokens
        self.n_ctx = n_ctx
        self.at_least = at_least


class BadInput(UsageError):
    """Input that cannot be used as a prompt (binary data, nothing at all)."""


class ModelLoadError(QuipuError):
    """The model file exists but llama.cpp could not load it."""


class EngineError(QuipuError):
    """llama.cpp failed at run time (decode error, out of memory)."""


class CapabilityError(QuipuError):
    """The backend cannot do what was asked (embeddings, images)."""


class TemplateError(QuipuError):
    """The model's chat template failed to render."""


class SessionNameError(UsageError):
    """A session name that is not allowed (it could escape the sessions folder)."""


class SessionNotFound(UsageError):
    """The named session does not exist."""


class SessionExists(UsageError):
    """The target session name is taken."""


class SnapshotError(QuipuError):
    """A session file is damaged or unreadable."""


class SessionSaveError(QuipuError):
    """A session could not be written (disk full, read-only folder); the previous save stands."""


class SessionLocked(QuipuError):
    """Another quipu process is writing this session."""


class ModelMismatch(UsageError):
    """A session is continued with a model other than the one it was made with."""


def came_of_interrupt(exc: BaseException) -> bool:
    """Whether an error was raised because of a Ctrl-C: Python turns a KeyboardInterrupt that
    lands in some of its own machinery (a class being made while a module is imported) into
    another error caused by it."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False
