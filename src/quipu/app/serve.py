"""`quipu serve`'s work, without HTTP: the models a server answers with, loaded at the first
request that names one and unloaded after its keep-alive (one at a time), and each request's
answer, one turn (`turn.Turn`) as `quipu run --messages` answers it. After each answer the
conversation's context joins the prompt cache, on disk: a request whose messages go on from an
earlier conversation restores it and reads only what is new, after a restart too, and its answer
is the one a fresh read gives. Requests are answered one at a time, or with `parallel` up to so
many at once, each on a slot of the model's (a sequence of one context they share, decoded
together: `engine/llama_shared.py`); a few more wait, and past them a request is refused as
busy. What a request asks is `serve_plan`'s; the bodies of the replies, `serve_bodies`'."""

from __future__ import annotations

import dataclasses
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from quipu.app.answer import Answer
from quipu.app.environment import Environment
from quipu.app.serve_plan import FOREVER, ChatRequest, Keep, RequestError
from quipu.app.tools import OpenTools, Toolbox, offer
from quipu.app.turn import Ask, Turn
from quipu.app.turn_options import TurnOptions, chat_template_source, max_tokens, stop_strings, template_variables
from quipu.sessions.base import ReplySink as ReplySink  # (the HTTP side's sinks are made of it)
from quipu.sessions.base import Stats, common_prefix
from quipu.sessions.conversation import Conversation, TurnSettings
from quipu.sessions.inference import InferenceSession

if TYPE_CHECKING:
    from quipu.app.local import LocalKeeper
    from quipu.engine.base import Backend
    from quipu.engine.llama import LlamaBackend

MAX_WAITING = 8  # requests waiting for the model beside those it answers; past them: busy
MAX_PARALLEL = 64  # requests a model may answer at once (`--parallel`)
KEEP_ALIVE = 300.0  # seconds a model stays loaded after its last request, unless told (Ollama's too)


def busy() -> RequestError:
    return RequestError("the server is busy: too many requests wait; try again soon", 503, "server_busy")


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


def said_of(asked: ChatRequest) -> tuple[tuple[str, str], ...]:
    """What a request says, as a slot keeps it: its messages (role, text), or its prompt."""
    if asked.prompt is not None:
        return (("prompt", asked.prompt),)
    return tuple((m.role, m.content if isinstance(m.content, str) else repr(m.content)) for m in asked.messages)


def affinity(slot: Slot, said: tuple[tuple[str, str], ...]) -> int:
    """How much of what a request says goes on from what a slot's last request said and was
    answered (its messages in common; a prompt's characters)."""
    if said and said[0][0] == "prompt":
        before = "".join(text for _, text in slot.said) if slot.said and slot.said[0][0] == "prompt" else ""
        return common_prefix(before, said[0][1])
    return common_prefix(slot.said, said)


class Served:
    """The models a server answers with: `models` (`-m`; none: the default model), the first
    the default of a request that names none, and any other this machine has by its name
    (`quipu models list`); `base`, the server's own options; `keep`, how long a model stays
    loaded after a request (seconds, or `FOREVER`)."""

    def __init__(self, env: Environment, base: TurnOptions, models: Sequence[str | None] = (),
                 keep: Keep = KEEP_ALIVE, parallel: int = 1):
        self.env, self.base, self.keep, self.parallel = env, base, keep, parallel
        self.served: dict[str, Path] = {}
        self._aliases: dict[str, str] = {}  # what else names a served model: as -m gave it, its file
        for requested in models or [base.model]:
            name, path = env.resolve_model(requested)
            self.served.setdefault(name, path)
            for alias in (requested, str(path)):
                if alias:
                    self._aliases.setdefault(alias, name)
        self.model = next(iter(self.served))
        # Up to `parallel` requests on the model loaded at a time, each on a slot of its own; a
        # load or an unload alone.
        self._turns = threading.Condition()
        self._active = 0  # requests answered now
        self._switching = False  # a model is being loaded or unloaded
        self._loaded: Loaded | None = None
        self._timer: threading.Timer | None = None
        self._counted = threading.Lock()
        self._requests = 0  # those held now: those answered and those waiting

    # ---- which model ----------------------------------------------------------------------

    def known(self) -> dict[str, Path]:
        """Every model a request may name: those served first, then the others found here."""
        from quipu.models import discover

        env = self.env
        found = {e.name: e.path for e in discover(env.dirs.models, env.environ, env.config.models)}
        return {**self.served, **{k: v for k, v in found.items() if k not in self.served}}

    def pick(self, name: Any) -> tuple[str, Path]:
        """The model a request names (none: the default), by a name this machine knows it by
        (never a path: a client loads only the models `quipu models list` shows)."""
        if name is None or name == "":
            return self.model, self.served[self.model]
        if not isinstance(name, str):
            raise RequestError("model must be a text (a model's name)")
        for wanted in dict.fromkeys((name, name.removesuffix(":latest"))):  # (Ollama's clients add a tag)
            if wanted in self.served:
                return wanted, self.served[wanted]
            if wanted in self._aliases:
                return self._aliases[wanted], self.served[self._aliases[wanted]]
        known = self.known()
        for wanted in (name, name.removesuffix(":latest")):
            if wanted in known:
                return wanted, known[wanted]
        raise RequestError(f"model '{name[:200]}' is not a model here (the default is '{self.model}'; "
                           "`quipu models list` names the others)", 404, "model_not_found")

    def plan(self, body: Mapping[str, Any], make: Callable[[Mapping[str, Any], TurnOptions], ChatRequest]) -> ChatRequest:
        """What a request asks (`make` reads it: `serve_plan.chat_request`, ...), for the model it
        names; checked before anything is loaded (`RequestError`)."""
        name, _ = self.pick(body.get("model"))
        return dataclasses.replace(make(body, self.base), model=name)

    def loaded(self) -> Loaded | None:
        """The model loaded now, if any."""
        return self._loaded

    # ---- answers --------------------------------------------------------------------------

    def chat(self, asked: ChatRequest, sink: ReplySink) -> Answer:
        """Answers a request (`asked`, with its model: `ChatRequest.model`) into `sink` (which
        says when its client has gone), once the model has room; the answer is logged unless
        the server was told not to."""
        with self._held(asked.model or self.model, asked.keep, asked.opts) as (loaded, load_s, notices):
            if asked.session is not None:
                answer = self._session_turn(asked, loaded, asked.session, sink)
            else:
                with self._slot(loaded, asked) as slot:
                    answer = self._answer(asked, loaded, slot, load_s, sink)
            answer.notices[:0] = notices
        from quipu.app.answer_log import log_answer

        said = asked.prompt or next((m.content for m in reversed(asked.messages) if m.role == "user"), "")
        _, unlogged = log_answer(self.env, asked.opts.logged, "serve", said, answer, system=answer.system,
                              unkept=sum(m.role != "system" for m in asked.messages) > 1)
        if unlogged:
            answer.notices.append(unlogged)
        return answer

    def embed(self, model: str, texts: list[str], keep: Keep = None) -> tuple[list[list[float]], int, float]:
        """Each text's embedding by `model` (pooled by the mean, as `quipu embed` does), how many
        tokens they were, and how long loading the model took (0 where it was loaded)."""
        from quipu.errors import InvalidParameter

        with self._held(model, keep, self.base) as (loaded, load_s, _):
            backend = loaded.backend
            if not backend.supports_embeddings:
                raise RequestError(f"{model} cannot compute embeddings")
            try:
                vectors = backend.embed(texts, "mean")  # (on a context of its own)
            except InvalidParameter as exc:
                raise RequestError(str(exc)) from None
            tokens = sum(len(backend.tokenize(t, add_special=True, parse_special=False)) for t in texts)
        return vectors, tokens, load_s

    def load(self, model: str, keep: Keep = None) -> bool:
        """Loads `model` (Ollama's request with nothing to answer); unloads it instead where
        `keep` is 0 (once the requests it answers are done). Whether it is loaded now."""
        with self._held(None if keep == 0 else model, keep, self.base):
            pass
        return self._loaded is not None

    @property
    def requests(self) -> int:
        """How many requests are held now: those answered, and those waiting."""
        return self._requests

    def room(self) -> None:
        """Refuses a request at once, before its reply begins, where it would be refused as busy
        (`_held`): `MAX_WAITING` requests wait already."""
        if self._requests >= self.parallel + MAX_WAITING:
            raise busy()

    @contextmanager
    def _held(self, model: str | None, keep: Keep, opts: TurnOptions) -> Iterator[tuple[Any, float, list[str]]]:
        """`model` loaded and held for one request, once it has room (past `MAX_WAITING`
        waiting: busy); with it, how long loading it took and what loading said. None: no model,
        the one loaded held as it is (if any). Then the model stays loaded for `keep` (None: the
        server's keep-alive) after the last request it answers."""
        with self._counted:
            if self._requests >= self.parallel + MAX_WAITING:
                raise busy()
            self._requests += 1
        try:
            loaded, load_s, notices = self._enter(model, opts)
            try:
                yield loaded, load_s, notices
            finally:
                with self._turns:
                    self._active -= 1
                    if self._active == 0:
                        self._kept(self.keep if keep is None else keep)
                    self._turns.notify_all()
        finally:
            with self._counted:
                self._requests -= 1

    def _enter(self, model: str | None, opts: TurnOptions) -> tuple[Any, float, list[str]]:
        """Waits for room on `model` (another model loaded: for its requests to be done, then
        loads this one), and takes it."""
        with self._turns:
            while True:
                loaded = self._loaded
                if not self._switching:
                    if (model is None or (loaded is not None and loaded.name == model)) and self._active < self.parallel:
                        self._active += 1
                        return loaded, 0.0, []
                    if self._active == 0:
                        self._switching = True
                        break
                self._turns.wait()
        try:
            self._unload()
            loaded, load_s, notices = self._load(model, opts)
        except BaseException:
            with self._turns:
                self._switching = False
                self._turns.notify_all()
            raise
        with self._turns:  # (taken as the switch ends: a request waiting meanwhile finds it taken)
            self._switching = False
            self._active += 1
            self._turns.notify_all()
        return loaded, load_s, notices

    @contextmanager
    def _slot(self, loaded: Loaded, asked: ChatRequest) -> Iterator[Slot]:
        """A free slot of `loaded` for a request: the one whose last request it goes on from the
        furthest, else the one used least lately."""
        said = said_of(asked)
        with self._turns:
            free = [slot for slot in loaded.slots if not slot.busy]
            slot = max(free, key=lambda slot: (affinity(slot, said), -slot.used))
            slot.busy, slot.used = True, time.monotonic()
        try:
            yield slot
        finally:
            slot.backend.done_reading()
            with self._turns:
                slot.busy = False

    def _answer(self, asked: ChatRequest, loaded: Loaded, slot: Slot, load_s: float, sink: ReplySink) -> Answer:
        session = self._session(asked.opts, slot, load_s)
        slot.held, slot.said = [], ()  # (until this request is answered: what the context holds is this one's)
        answer = self._turn(asked, session, loaded.keeper, [], sink)
        if session.backend.positions() == session.n_decoded:
            slot.held = session.tokens[:session.n_decoded]
            slot.said = said_of(asked) + (("assistant", answer.text),)
        return answer

    def _turn(self, asked: ChatRequest, session: InferenceSession, keeper: LocalKeeper, notices: list[str],
              sink: ReplySink) -> Answer:
        if asked.logprobs is None:
            return self._reply(asked, session, keeper, notices, sink)
        from quipu.app.logprobs import Logprobs

        recorder = Logprobs(asked.logprobs)
        session.logits_processors.insert(0, recorder)  # (first: the model's own logits)
        answer = self._reply(asked, session, keeper, notices, sink)
        recorder.done(session.tokens)
        answer.logprobs = recorder.entries(session.backend)
        return answer

    def _reply(self, asked: ChatRequest, session: InferenceSession, keeper: LocalKeeper, notices: list[str],
               sink: ReplySink) -> Answer:
        opts, messages = asked.opts, asked.messages
        limit, stop = max_tokens(opts, self.env), stop_strings(opts, self.env)
        if asked.prompt is not None:  # (a plain completion)
            turn = Turn(session, keeper, None, opts.tool_options, notices=notices)
            return turn.remember(turn.answer(Ask("raw", asked.prompt), limit, stop, sink))
        if asked.media:  # (the projector is loaded into the model's context once, and kept)
            from quipu.app.local_media import with_projector
            from quipu.app.tool_files import placed

            marks = with_projector(session.backend, session.backend.model_path, opts.mmproj, list(asked.media),
                                   self.env.dirs.checked_projectors)
            messages = placed(messages, marks)
        conv = Conversation.start(session, None, template=chat_template_source(opts), messages=messages,
                                  settings=TurnSettings().but(variables=template_variables(opts)))
        tools = self._offered(conv, asked)
        turn = Turn(session, keeper, conv, opts.tool_options, tools=tools, notices=notices)
        answer = turn.answer(Ask("continue" if messages[-1].role == "assistant" else "answer"), limit, stop, sink)
        return turn.remember(answer)

    def _session_turn(self, asked: ChatRequest, loaded: Loaded, name: str, sink: ReplySink) -> Answer:
        """A turn of the quipu session `name`: its context restored exactly, the messages the
        request sends past the session's added (it must begin with them), the reply, and the
        session saved; `quipu chat -S NAME` goes on from there, and a request from that."""
        from quipu.app.local import LocalHost
        from quipu.app.named import NamedSession, store_for
        from quipu.app.serve_plan import going_on

        if asked.media:
            raise RequestError("X-Quipu-Session: a session's turn over the API takes no images or recordings yet")
        store = store_for(self.env)
        # (a new session's system prompt is the request's own first message)
        opts = dataclasses.replace(asked.opts, model=str(loaded.path), session=name,
                                   system=asked.opts.system if store.exists(name) else "")
        with store.lock(name):  # (its context: one of its own, on the model loaded)
            named = NamedSession.open(store, name, opts, self.env, LocalHost(loaded.backend))
            try:
                conv = named.conversation
                new = going_on(conv.messages, asked.messages, name)
                tools = self._offered(conv, asked)
                conv.messages.extend(new)
                turn = Turn(named.session, named.keeper, conv, opts.tool_options, named=named, tools=tools)
                limit, stop = named.reply_limits(opts, self.env)
                answer = turn.answer(Ask("continue" if new[-1].role == "assistant" else "answer"), limit, stop, sink)
                named.save()
            finally:
                named.close()
        return answer

    @staticmethod
    def _offered(conv: Conversation, asked: ChatRequest) -> OpenTools | None:
        """The request's tools, offered to the conversation (its reasoning effort set too)."""
        conv.set_reasoning(effort=asked.opts.reasoning_effort)
        tools = OpenTools(Toolbox({t.spec.name: t for t in asked.tools})) if asked.tools else None
        offer(conv, tools, asked.opts.tool_options)
        return tools

    def _session(self, opts: TurnOptions, slot: Slot, load_s: float) -> InferenceSession:
        """A fresh session on a slot, as a lone run's, but that its context still holds the last
        request's, which the prompt may take (the prompt cache's memory: `PromptCache.warm`)."""
        from quipu.app.placing import placement_of
        from quipu.app.turn_options import sampling_params, with_logit_biases

        backend = slot.backend
        params = with_logit_biases(sampling_params(opts, self.env), backend, opts)
        stats = Stats(load_s=load_s, placement=placement_of(backend))
        return InferenceSession(backend, params, stats=stats, held=slot.held)

    # ---- loading and unloading (the lock held) ----------------------------------------------

    def _load(self, model: str | None, opts: TurnOptions) -> tuple[Loaded, float, list[str]]:
        """`model` loaded (none loaded before: `_unload`), with a slot for each request it may
        answer at once; how long loading it took; what to say of where it runs."""
        from quipu.app.local import LocalHost, model_fingerprint
        from quipu.app.placing import placement_notices
        from quipu.app.turn_options import context_settings, load_backend, offload

        name, path = self.pick(model)
        started = time.perf_counter()
        settings = dataclasses.replace(context_settings(opts, self.env), parallel=self.parallel)
        backend = load_backend(path, settings, opts.verbose, offload(opts, self.env))
        load_s = time.perf_counter() - started
        keeper = LocalHost.keeper(name, path, model_fingerprint(path, self.env), opts, self.env, None)
        loaded = Loaded(name, path, backend, keeper, slots=[Slot(b) for b in [backend, *backend.sequences()]])
        self._loaded = loaded
        return loaded, load_s, placement_notices(backend, ctx_given=opts.ctx is not None, verbose=opts.verbose)

    def _kept(self, keep: Keep) -> None:
        """After the last request it answers (the condition held): the model loaded stays so for
        `keep` seconds (0: unloaded now)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        loaded = self._loaded
        if loaded is None:
            return
        if keep == FOREVER or keep is None:
            loaded.until = None
        elif keep == 0:
            self._unload()
        else:
            seconds = float(keep)
            loaded.until = time.monotonic() + seconds
            self._timer = threading.Timer(seconds, self._expire)
            self._timer.daemon = True
            self._timer.start()

    def _expire(self) -> None:
        with self._turns:  # (a request that came meanwhile has moved `until` on)
            loaded = self._loaded
            if loaded is not None and loaded.until is not None and time.monotonic() >= loaded.until \
                    and self._active == 0 and not self._switching:
                self._unload()

    def _unload(self) -> None:
        if self._loaded is not None:
            self._loaded.close()
            self._loaded = None

    def close(self) -> None:
        """Frees the model (the server is stopping)."""
        with self._turns:
            if self._timer is not None:
                self._timer.cancel()
            self._unload()
