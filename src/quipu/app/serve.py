"""`quipu serve`'s work, without HTTP: the models a server answers with, loaded at the first
request that names one and unloaded after its keep-alive (one at a time), and each request's
answer, one turn (`turn.Turn`) as `quipu run --messages` answers it. After each answer the
conversation's context joins the prompt cache, on disk: a request whose messages go on from an
earlier conversation restores it and reads only what is new, after a restart too, and its answer
is the one a fresh read gives. Requests are answered one at a time; a few more wait, and past
them a request is refused as busy. What a request asks is `serve_plan`'s; the bodies of the
replies, `serve_bodies`'."""

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
from quipu.sessions.base import Stats
from quipu.sessions.conversation import Conversation, TurnSettings
from quipu.sessions.inference import InferenceSession

if TYPE_CHECKING:
    from quipu.app.local import LocalKeeper
    from quipu.engine.base import Backend

MAX_WAITING = 8  # requests waiting for the model beside the one it answers; past them: busy
KEEP_ALIVE = 300.0  # seconds a model stays loaded after its last request, unless told (Ollama's too)


def busy() -> RequestError:
    return RequestError("the server is busy: too many requests wait; try again soon", 503, "server_busy")


@dataclass
class Loaded:
    """A model loaded, and until when (`time.monotonic`; None: for good) it stays so."""

    name: str
    path: Path
    backend: Backend
    keeper: LocalKeeper
    until: float | None = None

    @property
    def expires(self) -> float | None:
        """`until` as wall-clock time (what /api/ps shows)."""
        return None if self.until is None else time.time() + (self.until - time.monotonic())
    held: list[int] = field(default_factory=list)  # what its context holds, the last request's, for the next


class Served:
    """The models a server answers with: `models` (`-m`; none: the default model), the first
    the default of a request that names none, and any other this machine has by its name
    (`quipu models list`); `base`, the server's own options; `keep`, how long a model stays
    loaded after a request (seconds, or `FOREVER`)."""

    def __init__(self, env: Environment, base: TurnOptions, models: Sequence[str | None] = (),
                 keep: Keep = KEEP_ALIVE):
        self.env, self.base, self.keep = env, base, keep
        self.served: dict[str, Path] = {}
        self._aliases: dict[str, str] = {}  # what else names a served model: as -m gave it, its file
        for requested in models or [base.model]:
            name, path = env.resolve_model(requested)
            self.served.setdefault(name, path)
            for alias in (requested, str(path)):
                if alias:
                    self._aliases.setdefault(alias, name)
        self.model = next(iter(self.served))
        self._turns = threading.Lock()  # one request on a model at a time; loads and unloads too
        self._loaded: Loaded | None = None
        self._timer: threading.Timer | None = None
        self._counted = threading.Lock()
        self._requests = 0  # those held now: the one answered and those waiting

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
        says when its client has gone), once the model is free; the answer is logged unless the
        server was told not to."""
        with self._held(asked.keep):
            answer = self._answer(asked, sink)
        from quipu.app.answer_log import log_answer

        said = asked.prompt or next((m.content for m in reversed(asked.messages) if m.role == "user"), "")
        unlogged = log_answer(self.env, asked.opts.logged, "serve", said, answer, system=answer.system)
        if unlogged:
            answer.notices.append(unlogged)
        return answer

    def embed(self, model: str, texts: list[str], keep: Keep = None) -> tuple[list[list[float]], int, float]:
        """Each text's embedding by `model` (pooled by the mean, as `quipu embed` does), how many
        tokens they were, and how long loading the model took (0 where it was loaded)."""
        from quipu.errors import InvalidParameter

        with self._held(keep):
            loaded, load_s, _ = self._load(model, self.base)
            backend = loaded.backend
            if not backend.supports_embeddings:
                raise RequestError(f"{model} cannot compute embeddings")
            try:
                vectors = backend.embed(texts, "mean")
            except InvalidParameter as exc:
                raise RequestError(str(exc)) from None
            tokens = sum(len(backend.tokenize(t, add_special=True, parse_special=False)) for t in texts)
        return vectors, tokens, load_s

    def load(self, model: str, keep: Keep = None) -> bool:
        """Loads `model` (Ollama's request with nothing to answer); unloads it instead where
        `keep` is 0. Whether it is loaded now."""
        with self._held(keep):
            if keep != 0:
                self._load(model, self.base)
        return self._loaded is not None

    @property
    def requests(self) -> int:
        """How many requests are held now: the one answered, and those waiting."""
        return self._requests

    def room(self) -> None:
        """Refuses a request at once, before its reply begins, where it would be refused as busy
        (`_held`): `MAX_WAITING` requests wait already."""
        if self._requests > MAX_WAITING:
            raise busy()

    @contextmanager
    def _held(self, keep: Keep) -> Iterator[None]:
        """The models held for one request, once free (past `MAX_WAITING` waiting: busy); then
        the model loaded stays so for `keep` (None: the server's keep-alive)."""
        with self._counted:
            if self._requests > MAX_WAITING:
                raise busy()
            self._requests += 1
        try:
            with self._turns:
                try:
                    yield
                finally:
                    self._kept(self.keep if keep is None else keep)
        finally:
            with self._counted:
                self._requests -= 1

    def _answer(self, asked: ChatRequest, sink: ReplySink) -> Answer:
        if asked.session is not None:
            return self._session_turn(asked, asked.session, sink)
        opts = asked.opts
        session, keeper, notices = self._session(asked.model or self.model, opts)
        loaded = self._loaded
        assert loaded is not None  # (`_session` loaded it)
        loaded.held = []  # (until this request is answered: what the context holds is this one's)
        answer = self._turn(asked, session, keeper, notices, sink)
        if session.backend.positions() == session.n_decoded:
            loaded.held = session.tokens[:session.n_decoded]
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

    def _session_turn(self, asked: ChatRequest, name: str, sink: ReplySink) -> Answer:
        """A turn of the quipu session `name`: its context restored exactly, the messages the
        request sends past the session's added (it must begin with them), the reply, and the
        session saved; `quipu chat -S NAME` goes on from there, and a request from that."""
        from quipu.app.local import LocalHost
        from quipu.app.named import NamedSession, store_for
        from quipu.app.serve_plan import going_on

        if asked.media:
            raise RequestError("X-Quipu-Session: a session's turn over the API takes no images or recordings yet")
        loaded, _, notices = self._load(asked.model or self.model, asked.opts)  # (its context: one of its own)
        store = store_for(self.env)
        # (a new session's system prompt is the request's own first message)
        opts = dataclasses.replace(asked.opts, model=str(loaded.path), session=name,
                                   system=asked.opts.system if store.exists(name) else "")
        with store.lock(name):
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
        answer.notices[:0] = notices
        return answer

    @staticmethod
    def _offered(conv: Conversation, asked: ChatRequest) -> OpenTools | None:
        """The request's tools, offered to the conversation (its reasoning effort set too)."""
        conv.set_reasoning(effort=asked.opts.reasoning_effort)
        tools = OpenTools(Toolbox({t.spec.name: t for t in asked.tools})) if asked.tools else None
        offer(conv, tools, asked.opts.tool_options)
        return tools

    def _session(self, model: str, opts: TurnOptions) -> tuple[InferenceSession, LocalKeeper, list[str]]:
        """A fresh session on `model`, as a lone run's, but that its context still holds the last
        request's, which the prompt may take (the prompt cache's memory: `PromptCache.warm`); its
        keeper; what loading it said."""
        from quipu.app.placing import placement_of
        from quipu.app.turn_options import sampling_params, with_logit_biases

        loaded, load_s, notices = self._load(model, opts)
        backend = loaded.backend
        params = with_logit_biases(sampling_params(opts, self.env), backend, opts)
        stats = Stats(load_s=load_s, placement=placement_of(backend))
        return InferenceSession(backend, params, stats=stats, held=loaded.held), loaded.keeper, notices

    # ---- loading and unloading (the lock held) ----------------------------------------------

    def _load(self, model: str, opts: TurnOptions) -> tuple[Loaded, float, list[str]]:
        """`model`, loaded (another model loaded is unloaded first); how long loading it took;
        what to say of where it runs."""
        from quipu.app.local import LocalHost, model_fingerprint
        from quipu.app.placing import placement_notices
        from quipu.app.turn_options import context_settings, load_backend, offload

        if self._loaded is not None and self._loaded.name == model:
            return self._loaded, 0.0, []
        self._unload()
        name, path = self.pick(model)
        started = time.perf_counter()
        backend = load_backend(path, context_settings(opts, self.env), opts.verbose, offload(opts, self.env))
        load_s = time.perf_counter() - started
        keeper = LocalHost.keeper(name, path, model_fingerprint(path, self.env), opts, self.env, None)
        self._loaded = Loaded(name, path, backend, keeper)
        return self._loaded, load_s, placement_notices(backend, ctx_given=opts.ctx is not None, verbose=opts.verbose)

    def _kept(self, keep: Keep) -> None:
        """After a request: the model loaded stays so for `keep` seconds (0: unloaded now)."""
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
            if loaded is not None and loaded.until is not None and time.monotonic() >= loaded.until:
                self._unload()

    def _unload(self) -> None:
        if self._loaded is not None:
            self._loaded.backend.close()
            self._loaded = None

    def close(self) -> None:
        """Frees the model (the server is stopping)."""
        with self._turns:
            if self._timer is not None:
                self._timer.cancel()
            self._unload()
