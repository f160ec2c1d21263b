"""A server's request answered through the one turn path (`turns.py`), on a slot of the model the
server holds (`SlotHost`): as a one-shot with the request's messages (or, a plain completion, its
prompt), or as a turn of a named session (`X-Quipu-Session`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from quipu.app.answer import Answer
from quipu.app.environment import Environment
from quipu.app.hosts import Opened
from quipu.app.local import LocalHost, LocalKeeper
from quipu.app.local_media import given_projector, with_projector
from quipu.app.tools import OpenTools, Toolbox
from quipu.app.turn_options import TurnOptions, sampling_params, with_logit_biases
from quipu.app.turns import Following, Given, SessionRequest, _one_shot, _one_shot_turn, run_session_turn
from quipu.engine.base import Backend, ProgressFn
from quipu.sessions.base import LOCAL, Message, ReplySink, Stats
from quipu.sessions.inference import InferenceSession

if TYPE_CHECKING:
    from quipu.app.attachments import Attachment
    from quipu.engine.llama import LlamaBackend
    from quipu.app.tooldefs import Tool
    from quipu.store.store import SessionStore
    from quipu.store.transcript import Transcript


class SlotHost:
    """A host of one request, on a slot of the model a server holds: a new session is a session
    on the slot's context (`backend`), which may take what the slot's last request left there
    (`held`: the prompt cache's memory); a named session, new or resumed, is opened on a context
    of its own settings on the loaded model (`model`), as `LocalHost` does."""

    capabilities = LOCAL

    def __init__(self, backend: Backend, model: Backend, keeper: LocalKeeper, load_s: float = 0.0,
                 notices: Sequence[str] = (), held: Sequence[int] = ()):
        self.backend, self.model, self.keeper = backend, model, keeper
        self.load_s, self.notices, self.held = load_s, list(notices), list(held)
        self.session: InferenceSession | None = None  # the last one `create` made

    def create(self, opts: TurnOptions, env: Environment, name: str | None = None,
               media: Sequence[Attachment] = ()) -> Opened[InferenceSession]:
        from quipu.app.placing import placement_of

        # A named session's first turn runs on a context of its own, as its next ones resume on, so
        # that the state it saves is one they can restore (a shared context's sequence's is not).
        if name is not None:
            return LocalHost(self.model).create(opts, env, name, media)
        backend = self.backend
        params = with_logit_biases(sampling_params(opts, env), backend.vocab, opts)
        session = InferenceSession(backend, params, stats=Stats(load_s=self.load_s, placement=placement_of(backend)),
                                   held=self.held, borrowed=True)
        marks = with_projector(backend, backend.model_path, given_projector(opts.mmproj), list(media),
                               env.dirs.checked_projectors) if media else []
        self.session = session
        return Opened(session, self.keeper, list(self.notices), media_marks=marks)

    def resume(self, store: SessionStore, name: str, record: Transcript, opts: TurnOptions, env: Environment,
               on_progress: ProgressFn | None = None) -> Opened[InferenceSession]:
        return LocalHost(self.model).resume(store, name, record, opts, env, on_progress)

    def close(self) -> None:
        pass  # (the slot's context is the server's)


@dataclass(eq=False)
class Slot:
    """Where a request is answered: a context of the model loaded (with `--parallel`, a sequence
    of the one they share), what it holds (the last request's prompt and answer, for the next:
    `held`), and what that request said (`said`: its messages and its answer, by which the next
    request that goes on from them is sent back here)."""

    backend: LlamaBackend
    held: list[int] = field(default_factory=list)
    said: tuple[tuple[str, str], ...] = ()
    busy: bool = False
    used: float = 0.0  # when it was last taken (`time.monotonic`)


@dataclass
class Loaded:
    """A model loaded, its slots (the first on `backend`), and until when (`time.monotonic`;
    None: for good) it stays so."""

    name: str
    path: Path
    backend: Backend
    keeper: LocalKeeper
    until: float | None = None
    slots: list[Slot] = field(default_factory=list)

    @property
    def expires(self) -> float | None:
        """`until` as wall-clock time (what /api/ps shows)."""
        return None if self.until is None else time.time() + (self.until - time.monotonic())

    def close(self) -> None:
        for slot in self.slots[1:]:  # (the sequences before the context they share)
            slot.backend.close()
        self.backend.close()


@dataclass(frozen=True)
class Request:
    """What a request gives a turn: its plan (`opts`), its messages and the media they hold, or a
    plain completion's `prompt`; the client's tools; the log probabilities it asks for."""

    opts: TurnOptions
    messages: Sequence[Message] = ()
    prompt: str | None = None
    tools: Sequence[Tool] = ()  # the client's: a reply that calls one ends there, the call in it
    media: Sequence[Attachment] = ()  # the images and recordings its messages hold
    logprobs: int | None = None  # each drawn token's log probability, with so many likeliest beside it
    context: Sequence[int] = ()  # the tokens of an exchange before, which it goes on from (Ollama's `context`)


def listed_name(env: Environment, path: Path) -> str:
    """The name `quipu models list` gives a model file (as a session made at the command line
    records its model), else its path: either finds it again."""
    from quipu.models import discover

    where = path.resolve()
    found = next((e.name for e in discover(env.dirs.models, env.environ, env.config.models)
                  if e.path.resolve() == where), None)
    return found or str(path)


def session_name(given: str) -> str:
    """A session's name as a request gives it (`X-Quipu-Session`), checked as the store checks one."""
    from quipu.store.store import validate_name

    return validate_name(given)


def answer_request(host: SlotHost, asked: Request, env: Environment, sink: ReplySink) -> Answer:
    """A request's answer on `host`, as `quipu run --messages` (or, a prompt, `--raw`) answers it."""
    tools = OpenTools(Toolbox({t.spec.name: t for t in asked.tools})) if asked.tools else None
    if asked.prompt is not None:
        return _one_shot(asked.prompt, replace(asked.opts, raw=True), env, host, sink, None, logprobs=asked.logprobs)
    if asked.context:
        n_vocab = host.backend.n_vocab
        wrong = next((t for t in asked.context if not 0 <= t < n_vocab), None)
        if wrong is not None:
            from quipu.errors import UsageError

            raise UsageError(f"context holds token {wrong}, which is not one of the model's {n_vocab}")
    return _one_shot(None, asked.opts, env, host, sink, None, tools,
                     given=Given(asked.messages, asked.media, asked.context), logprobs=asked.logprobs)


def count_request(host: SlotHost, asked: Request, env: Environment) -> int:
    """The tokens a request's prompt would be (its conversation, tools offered, rendered by the
    model's template), nothing read."""
    tools = OpenTools(Toolbox({t.spec.name: t for t in asked.tools})) if asked.tools else None
    turn, ask = _one_shot_turn(None, asked.opts, env, host, (), (), (), tools, given=Given(asked.messages, asked.media))
    try:
        return len(turn.tokens(ask))
    finally:
        turn.session.close()


def session_request(host: SlotHost, name: str, asked: Request, own: TurnOptions, env: Environment,
                    sink: ReplySink, took: Callable[[Answer], bool], follows: Following | None = None,
                    kept: Callable[[Answer, Sequence[Message]], None] | None = None, whole_read: bool = False
                    ) -> Answer:
    """A request as a turn of the named session `name` (opened with the server's options, `own`):
    its messages go on from the session's (or, `follows`, from a kept response's conversation in
    it); kept only once `took` says its client has the whole answer, so that a client that went
    (or a server that stopped) leaves the session as it was, and the client's retry asks the same
    turn again; `kept` is told once it is kept. `whole_read`: answered as a whole read of the
    conversation is (`SessionRequest.whole_read`)."""
    if asked.media:
        from quipu.errors import UsageError

        raise UsageError("a session's turn over the API takes no images or recordings yet")
    tools = OpenTools(Toolbox({t.spec.name: t for t in asked.tools})) if asked.tools else None
    opts = replace(asked.opts, model=listed_name(env, host.model.model_path), session=name)
    from quipu.app.named import store_for

    # (a new session's system prompt is the request's own first message)
    own = replace(own, model=opts.model, session=name, system=own.system if store_for(env).exists(name) else "")
    return run_session_turn(None, opts, env, host, sink, tools,
                            request=SessionRequest(own, asked.messages, asked.logprobs, took, follows, kept,
                                                   whole_read))
