"""The pool: every request a server holds, counted from its arrival to its reply's last byte
(`admit`: past `parallel` answered and `MAX_WAITING` waiting, refused as busy before any body),
the models it answers with, loaded at the first request that names one and unloaded after their
keep-alive (one at a time), and the slots a loaded model answers on (with `parallel`, sequences
of one context they share, decoded together: `engine/llama_shared.py`, `engine/scheduler.py`). Each request is answered
on a slot through the one turn path (`app/served.py`); after it, the conversation's context joins
the prompt cache, so the next request that goes on from it restores it. Nothing here runs on the
event loop: the HTTP side calls in from threads of its own."""

from __future__ import annotations

import dataclasses
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from quipu.app.answer import Answer
from quipu.app.environment import Environment
from quipu.app.served import Loaded, Slot, SlotHost, answer_request, count_request, session_request
from quipu.app.turn_options import TurnOptions
from quipu.serve.plan import FOREVER, ChatRequest, Keep, RequestError
from quipu.sessions.base import Message, ReplySink, common_prefix


MAX_WAITING = 8  # requests waiting for the model beside those it answers; past them: busy
MAX_PARALLEL = 64  # requests a model may answer at once (`--parallel`)
KEEP_ALIVE = 300.0  # seconds a model stays loaded after its last request, unless told (Ollama's too)
MAX_SAID = 1024  # lines the log says once (`say_once`); past them, no more are said
KEPT_WAIT_S = 120.0  # how long a request that goes on from a response waits for it to be kept


def busy() -> RequestError:
    return RequestError("the server is busy: too many requests wait; try again soon", 503, "server_busy")


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


class Pool:
    """The models a server answers with: `models` (`-m`; none: the default model), the first
    the default of a request that names none, and any other this machine has by its name
    (`quipu models list`); `base`, the server's own options; `keep`, how long a model stays
    loaded after a request (seconds, or `FOREVER`); `say`, where a line for the server's log goes."""

    def __init__(self, env: Environment, base: TurnOptions, models: Sequence[str | None] = (),
                 keep: Keep = KEEP_ALIVE, parallel: int = 1, say: Callable[[str], None] = lambda line: None):
        self.env, self.base, self.keep, self.parallel, self.say = env, base, keep, parallel, say
        self.served: dict[str, Path] = {}
        self._aliases: dict[str, str] = {}  # what else names a served model: as -m gave it, its file
        for requested in models or [base.model]:
            name, path = env.resolve_model(requested)
            self.served.setdefault(name, path)
            for alias in (requested, str(path)):
                if alias:
                    self._aliases.setdefault(alias, name)
        self.model = next(iter(self.served))
        self.stopping = threading.Event()  # set as the server stops: every reply ends at its next token
        # Up to `parallel` requests on the model loaded at a time, each on a slot of its own; a
        # load or an unload alone.
        self._turns = threading.Condition()
        self._active = 0  # requests answered now
        self._switching = False  # a model is being loaded or unloaded
        self._loaded: Loaded | None = None
        self._timer: threading.Timer | None = None
        self._asked_keep: Keep = None  # the keep-alive the last request that gave one asked for
        self._counted = threading.Lock()
        self._requests = 0  # those held now: answered, waiting, or sending their reply
        # responses whose turn is being kept (`keeping`), each with what it is meanwhile
        self._keeping: dict[str, tuple[threading.Event, dict[str, Any] | None]] = {}
        self._said: set[str] = set()  # the log's lines said once: a model's name the default answered, ...

    # ---- admission --------------------------------------------------------------------------

    @property
    def requests(self) -> int:
        """How many requests are held now, from their arrival to their reply's last byte."""
        return self._requests

    def admit(self) -> Callable[[], None]:
        """Counts a request in, or refuses it as busy where `parallel` are answered and
        `MAX_WAITING` wait already; what counts it out, called once (the HTTP side's `Place` calls
        it when the reply's last byte is out and its turn is done)."""
        with self._counted:
            if self._requests >= self.parallel + MAX_WAITING:
                raise busy()
            self._requests += 1

        def release() -> None:
            with self._counted:
                self._requests -= 1
        return release

    # ---- which model ----------------------------------------------------------------------

    def known(self) -> dict[str, Path]:
        """Every model a request may name: those served first, then the others found here."""
        known = self._every()
        first = self._first_names(known)  # (a file found two ways is listed once: by its first name)
        return {name: path for name, path in known.items() if first[path.resolve()] == name}

    def _every(self) -> dict[str, Path]:
        """Every model a request may name, by each of its names: those served, then the others."""
        from quipu.models import discover

        env = self.env
        found = {e.name: e.path for e in discover(env.dirs.models, env.environ, env.config.models)}
        return {**self.served, **{k: v for k, v in found.items() if k not in self.served}}

    @staticmethod
    def _first_names(known: dict[str, Path]) -> dict[Path, str]:
        """Each model file (resolved) by the first of its names in `known`."""
        first: dict[Path, str] = {}
        for name, path in known.items():
            first.setdefault(path.resolve(), name)
        return first

    def digest(self, path: Path) -> str:
        """A model file's digest: its fingerprint's hash (the whole file's, once, remembered)."""
        from quipu.app.local import model_fingerprint
        from quipu.models import WHOLE

        try:
            return model_fingerprint(path, self.env).split(WHOLE)[-1]
        except OSError:
            return ""

    def settings(self) -> list[tuple[str, Any]]:
        """The server's own sampling settings, stop strings and context, by Ollama's names."""
        from quipu.app.turn_options import sampling_params, stop_strings
        from quipu.serve.wire import parameters

        loaded, ctx = self._loaded, self.base.ctx
        n_ctx = loaded.backend.n_ctx if loaded is not None else ctx if ctx is not None and ctx > 0 else None
        return parameters(sampling_params(self.base, self.env), stop_strings(self.base, self.env), n_ctx)

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
        known = self._every()
        for wanted in (name, name.removesuffix(":latest")):
            if wanted in known:  # (answered under the name the file is listed by)
                listed = self._first_names(known)[known[wanted].resolve()]
                return listed, known[listed]
        raise RequestError(f"model '{name[:200]}' is not a model here (the default is '{self.model}'; "
                           "`quipu models list` names the others)", 404, "model_not_found")

    def plan(self, body: Mapping[str, Any], make: Callable[[Mapping[str, Any], TurnOptions], ChatRequest],
             any_name: bool = False) -> ChatRequest:
        """What a request asks (`make` reads it: `plan.chat_request`, ...), for the model it
        names; checked before anything is loaded (`RequestError`). `any_name`: a name this machine
        does not know is answered by the default model (an agent's own model names, such as
        `claude-opus-4-8`), said once a name in the server's log."""
        try:
            name, _ = self.pick(body.get("model"))
        except RequestError as exc:
            if not any_name or exc.status != 404:
                raise
            name = self.model
            self.say_once(f"model '{body['model'][:200]}' is not a model here: '{name}' answers it")
        return dataclasses.replace(make(body, self.base), model=name)

    def loaded(self) -> Loaded | None:
        """The model loaded now, if any."""
        return self._loaded

    # ---- answers --------------------------------------------------------------------------

    def chat(self, asked: ChatRequest, sink: ReplySink, ident: str = "",
             took: Callable[[Answer], bool] = lambda answer: True,
             kept: Callable[[Answer, Sequence[Message]], None] | None = None,
             taken: Callable[[], None] = lambda: None) -> Answer:
        """Answers a request (`asked`, with its model: `ChatRequest.model`) into `sink` (which
        says when its client has gone), once the model has room, on a slot of its; what the turn
        says goes to the server's log with the request's id (`ident`; once, a notice every request
        would repeat), and the answer is logged unless the server was told not to. A session's
        turn is kept once `took` says the client has the whole answer (never, `asked.unkept`), and
        then `kept` is told. `taken` is told once it has its slot (its turn no longer waits for
        others)."""
        self._say_unenforced(asked)
        with self._held(asked.model or self.model, asked.keep, asked.opts) as (loaded, load_s, notices):
            with self._slot(loaded, asked) as slot:
                taken()
                host = SlotHost(slot.backend, loaded.backend, loaded.keeper, load_s, notices, slot.held)
                slot.held, slot.said = [], ()  # (until this request is answered: what the context holds is this one's)
                if asked.session is not None:  # (what the slot's context holds then is the session's: not kept)
                    answer = session_request(host, asked.session, asked, self.base, self.env, sink,
                                             (lambda a: took(a) and False) if asked.unkept else took,
                                             asked.follows, kept, asked.whole_read)
                else:
                    answer = answer_request(host, asked, self.env, sink)
                    session = host.session
                    if asked.gives_context and session is not None:
                        answer.context = list(session.tokens)
                    if session is not None and session.backend.memory.positions() == session.n_decoded:
                        slot.held = session.tokens[:session.n_decoded]
                        slot.said = said_of(asked) + (("assistant", answer.text),)
        from quipu.app.answer_log import log_answer

        said = asked.prompt or next((m.content for m in reversed(asked.messages) if m.role == "user"), "")
        _, unlogged = log_answer(self.env, asked.opts.logged, "serve", said, answer, system=answer.system,
                                 unkept=sum(m.role != "system" for m in asked.messages) > 1)
        if unlogged:
            answer.notices.append(unlogged)
        for notice in answer.notices:  # (a notice that every request would repeat is said once)
            self.say_once(f"{ident}: {notice}" if ident else notice, notice)
        return answer

    def _say_unenforced(self, asked: ChatRequest) -> None:
        """Says once a tool which keywords of its parameters its calls are not held to."""
        from quipu.app.tool_files import unenforced

        for tool in asked.tools:
            missed = unenforced(tool)
            if missed:
                self.say_once(f"tool {tool.spec.name}: its calls are held to its parameters but "
                              f"{', '.join(missed)} (the client checks them)")

    def say_once(self, line: str, key: str | None = None) -> None:
        """Says `line` in the server's log, unless it (or what `key` names) was said before."""
        key = line if key is None else key
        with self._counted:
            first = key not in self._said and len(self._said) < MAX_SAID
            if first:
                self._said.add(key)
        if first:
            self.say(line)

    def count(self, asked: ChatRequest) -> int:
        """The tokens a request's prompt would be, on a slot of its model."""
        with self._held(asked.model or self.model, asked.keep, asked.opts) as (loaded, load_s, notices):
            with self._slot(loaded, asked) as slot:
                return count_request(SlotHost(slot.backend, loaded.backend, loaded.keeper, load_s, notices),
                                     asked, self.env)

    # ---- responses kept -------------------------------------------------------------------

    def keeping(self, ident: str, shown: dict[str, Any] | None = None) -> Callable[[], None]:
        """Marks response `ident` as being kept (its turn not yet over; `shown`, what a request for
        it meanwhile is given); what says it is over."""
        done = threading.Event()
        with self._counted:
            self._keeping[ident] = (done, shown)

        def over() -> None:
            with self._counted:
                self._keeping.pop(ident, None)
            done.set()
        return over

    def delivered(self, ident: str) -> None:
        """Response `ident`'s client has it whole: a request for it now waits for it to be kept
        (a moment), and is given it as kept."""
        with self._counted:
            found = self._keeping.get(ident)
            if found is not None:
                self._keeping[ident] = (found[0], None)

    def in_progress(self, ident: str) -> dict[str, Any] | None:
        """What response `ident` is while its turn is not over (its status "in_progress"); None
        where it is not being made."""
        with self._counted:
            found = self._keeping.get(ident)
        return found[1] if found is not None else None

    def kept_wait(self, ident: str) -> None:
        """Waits (a while) for response `ident`'s turn to be over, where it is being kept: a
        client that goes on from a response at once finds it kept."""
        with self._counted:
            found = self._keeping.get(ident)
        if found is not None:
            found[0].wait(KEPT_WAIT_S)

    def embed(self, model: str, texts: list[str | list[int]], keep: Keep = None) -> tuple[list[list[float]], int, float]:
        """Each text's embedding by `model` (or its tokens': pooled by the mean, as `quipu embed`
        does), how many tokens they were, and how long loading the model took (0 where it was loaded)."""
        from quipu.errors import InvalidParameter

        with self._held(model, keep, self.base) as (loaded, load_s, _):
            backend = loaded.backend
            if not backend.supports_embeddings:
                raise RequestError(f"{model} cannot compute embeddings")
            try:
                vectors = backend.embed(texts, "mean")  # (on a context of its own)
            except InvalidParameter as exc:
                raise RequestError(str(exc)) from None
            tokens = sum(len(backend.vocab.tokenize(t, add_special=True, parse_special=False)) if isinstance(t, str)
                         else len(t) for t in texts)
        return vectors, tokens, load_s

    def load(self, model: str, keep: Keep = None) -> bool:
        """Loads `model` (Ollama's request with nothing to answer); unloads it instead where
        `keep` is 0: now, or, while it answers requests, once they are done (the request does not
        wait for them). Whether it stays loaded."""
        if keep == 0:
            with self._turns:
                if self._active or self._switching:
                    self._asked_keep = 0
                else:
                    self._kept(0)
            return False
        with self._held(model, keep, self.base) as (_, _, notices):
            for notice in notices:  # (what loading it says: where it runs, a --ctx past its training)
                self.say(notice)
        return self._loaded is not None

    @contextmanager
    def _held(self, model: str | None, keep: Keep, opts: TurnOptions) -> Iterator[tuple[Any, float, list[str]]]:
        """`model` loaded and held for one request (counted in already: `admit`), once it has
        room; with it, how long loading it took and what loading said. None: no model, the one
        loaded held as it is (if any). Then the model stays loaded for the keep-alive the last
        request that gave one asked for (else the server's) after the last request it answers."""
        loaded, load_s, notices = self._enter(model, opts)
        try:
            yield loaded, load_s, notices
        finally:
            with self._turns:
                self._active -= 1
                if keep is not None:
                    self._asked_keep = keep
                if self._active == 0:
                    self._kept(self.keep if self._asked_keep is None else self._asked_keep)
                    self._asked_keep = None
                self._turns.notify_all()

    def _enter(self, model: str | None, opts: TurnOptions) -> tuple[Any, float, list[str]]:
        """Waits for room on `model` (another model loaded: for its requests to be done, then
        loads this one), and takes it."""
        with self._turns:
            while True:
                loaded = self._loaded
                if self.stopping.is_set():
                    raise RequestError("the server is stopping", 503, "server_busy")
                if not self._switching:
                    room = len(loaded.slots) if loaded is not None else self.parallel
                    if (model is None or (loaded is not None and loaded.name == model)) and self._active < room:
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

    # ---- loading and unloading (the lock held) ----------------------------------------------

    def _load(self, model: str | None, opts: TurnOptions) -> tuple[Loaded, float, list[str]]:
        """`model` loaded (none loaded before: `_unload`), with a slot for each request it may
        answer at once; how long loading it took; what to say of where it runs."""
        from quipu.app.local import LocalHost, hashing
        from quipu.app.placing import placement_notices, sequences_capped
        from quipu.app.turn_options import context_settings, load_backend, offload

        name, path = self.pick(model)
        hashed = hashing(path, self.env)  # (a file quipu has not met is hashed while it loads)
        started = time.perf_counter()
        n_seq, capped = sequences_capped(path, self.parallel)
        settings = dataclasses.replace(context_settings(opts, self.env), n_seq=n_seq)
        backend = load_backend(path, settings, opts.verbose, offload(opts, self.env))
        load_s = time.perf_counter() - started
        try:
            model_fp = hashed()
            backend.vocab.controls()  # (the vocabulary's table a prompt's reading asks for: made now, not in a request)
        except BaseException:
            backend.close()
            raise
        keeper = LocalHost.keeper(name, path, model_fp, opts, self.env, None)
        loaded = Loaded(name, path, backend, keeper, slots=[Slot(b) for b in [backend, *backend.sequences()]])
        self._loaded = loaded
        return loaded, load_s, [*([capped] if capped else []),
                                *placement_notices(backend, ctx_given=opts.ctx is not None, verbose=opts.verbose)]

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

    def stop(self) -> None:
        """The server is stopping: every reply ends at its next token, and no request waits on."""
        self.stopping.set()
        with self._turns:
            self._turns.notify_all()

    def close(self, wait_s: float = 2.0) -> None:
        """Frees the model once the requests it answers are done (the server is stopping; each
        ends at its next token): one still busy after `wait_s` (a load) leaves it to the process's end."""
        self.stop()
        deadline = time.monotonic() + wait_s
        with self._turns:
            if self._timer is not None:
                self._timer.cancel()
            while (self._active or self._switching) and time.monotonic() < deadline:
                self._turns.wait(max(0.0, deadline - time.monotonic()))
            if not self._active and not self._switching:
                self._unload()
