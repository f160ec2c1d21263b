"""`quipu run --url` and `quipu chat --url`: a model on a server (see `engine/remote.py`).

llama.cpp's llama-server is driven by tokens, as a local model is (`app/served.py`). Any other
server (vLLM, Ollama, LM Studio, llama-cpp-python's) is spoken to through its OpenAI chat API:
a named session on it (`-S NAME --url`) keeps its transcript as the truth, and each turn sends
the whole conversation (servers keep their own prompt caches). Such a transcript holds no token
history or context state, so a session can move between servers and a local model: continued
elsewhere, it is read again from its messages.

What such a server cannot be asked through its chat API is refused before anything is sent,
never faked: grammars and schemas, logit biases, `--raw`, `--show-prompt`, `--continue`.
"""

from __future__ import annotations

from contextlib import closing
from typing import Callable

from quipu import __version__
from quipu.app.chat import SessionCommands
from quipu.app.environment import Environment, TurnOptions, max_tokens, system_prompt
from quipu.app.named import store_for
from quipu.app.served import open_served, run_served_turn
from quipu.app.turns import ReplyStream, StopFn, TextFn, TurnResult
from quipu.engine.base import ContextSettings
from quipu.store.store import validate_name
from quipu.store.transcript import Transcript, now_iso
from quipu.errors import BadInput, CapabilityError, UsageError
from quipu.sessions.inference import Stats


def beyond_chat_api(opts: TurnOptions) -> list[tuple[bool, str]]:
    """(given, what) for each option the chat API cannot carry, which llama-server takes by tokens."""
    return [
        (opts.continue_reply, "--continue"),
        (opts.raw, "--raw"),
        (opts.schema is not None or opts.grammar is not None, "--schema and --grammar"),
        (bool(opts.logit_bias), "--logit-bias"),
        (opts.chat_template is not None, "--chat-template (the server renders its own)"),
        (opts.think is not None, "--think/--no-think"),
    ]


def refuse_unsupported(opts: TurnOptions, *, show: bool = False) -> None:
    refused = [
        *beyond_chat_api(opts),
        (show, "--show-prompt"),
        (opts.kv_type is not None or opts.ctx is not None or opts.threads is not None,
         "--ctx, --threads and --kv-type (the server's own settings)"),
    ]
    for given, what in refused:
        if given:
            raise CapabilityError(f"{what} cannot be used with this server (only llama.cpp's llama-server takes it)")


def needs_tokens(opts: TurnOptions) -> bool:
    """Whether a turn needs llama-server driven by tokens: a session, or what the chat API lacks."""
    return opts.session is not None or any(given for given, _ in beyond_chat_api(opts))


def session_system(opts: TurnOptions, env: Environment, resumed: bool) -> str | None:
    """The system prompt a session takes: the one given, else (for a new one) the config's; None
    leaves a resumed session's as it is."""
    return opts.system if opts.system is not None else (None if resumed else system_prompt(opts, env))


def request_params(opts: TurnOptions, env: Environment) -> dict:
    """The sampling parameters given (command line, then config), under the names servers know;
    what is not given is left to the server."""
    given = {k: v for k, v in env.config.generation.items() if k in ("temperature", "top_k", "top_p", "min_p",
                                                                      "repeat_penalty", "seed")}
    given.update(opts.sampling())
    return given


def run_remote_turn(prompt: str | None, opts: TurnOptions, env: Environment, settings, *,
                    on_text: TextFn | None = None, on_reasoning: TextFn | None = None,
                    should_stop: StopFn | None = None,
                    on_result: Callable[[TurnResult], None] | None = None) -> TurnResult:
    # A plain one-shot goes through the chat API even on llama-server: one round trip before the
    # first token, where driving it by tokens first asks for /props and the model's BOS and
    # renders the template here, and nothing is kept that exact tokens would serve.
    served = open_served(settings) if needs_tokens(opts) else None
    if served is not None:
        with closing(served):
            return run_served_turn(served, prompt, opts, env, settings.url, on_text=on_text,
                                   on_reasoning=on_reasoning, should_stop=should_stop, on_result=on_result)
    refuse_unsupported(opts)
    if not prompt:
        raise BadInput("no prompt: give one as an argument or on standard input")
    if opts.session is not None:
        return _session_turn(validate_name(opts.session), prompt, opts, env, settings, on_text=on_text,
                             on_reasoning=on_reasoning, should_stop=should_stop, on_result=on_result)
    messages = []
    system = system_prompt(opts, env)
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": prompt})
    result, failure = _ask(messages, opts, env, settings, on_text, on_reasoning, should_stop)
    if on_result is not None:
        on_result(result)  # what came is shown, then a failure is said
    if failure is not None:
        raise failure
    return result


def _ask(messages: list[dict], opts: TurnOptions, env: Environment, settings, on_text, on_reasoning,
         should_stop) -> tuple[TurnResult, Exception | None]:
    """The reply to `messages`; a failure mid-reply comes back beside what came before it."""
    from quipu.engine.remote import RemoteError, RemoteModel

    params = request_params(opts, env)
    stream = ReplyStream(on_text, should_stop, on_reasoning)
    with RemoteModel(settings) as remote:
        try:
            reply = remote.chat(messages, params=params, max_tokens=max_tokens(opts, env),
                                stop=tuple(opts.stop), on_text=lambda text: stream.on_token(0, text))
        except RemoteError as exc:
            if exc.partial is None or not exc.partial.text:
                raise
            return remote_result(stream, exc.partial, params, "interrupted"), exc
        result = remote_result(stream, reply, params, reply.finish_reason)
    return result, None


def _session_turn(name: str, prompt: str, opts: TurnOptions, env: Environment, settings, *, on_text, on_reasoning,
                  should_stop, on_result) -> TurnResult:
    store = store_for(env)
    store.clean_temporaries()
    with store.lock(name):
        record = store.load_transcript(name) if store.exists(name) else None
        messages = [{"role": m["role"], "content": m["content"]} for m in record.messages] if record else []
        system = session_system(opts, env, record is not None)
        if system is not None:
            messages = [m for m in messages if m["role"] != "system"]
            if system:
                messages.insert(0, {"role": "system", "content": system})
        messages.append({"role": "user", "content": prompt})
        result, failure = _ask(messages, opts, env, settings, on_text, on_reasoning, should_stop)
        # The turn is kept even when cut short, as a local one stopped by Ctrl-C is.
        messages.append({"role": "assistant", "content": result.text})
        save_transcript(store, name, messages, result.model, settings.url, request_params(opts, env),
                        record.created if record else None)
    result.session = name
    if on_result is not None:
        on_result(result)
    if failure is not None:
        raise failure
    return result


def remote_result(stream: ReplyStream, reply, params: dict, finish: str) -> TurnResult:
    stats = Stats(prompt_tokens=reply.prompt_tokens, cached_tokens=reply.cached_tokens,
                  completion_tokens=reply.completion_tokens, ttft_s=reply.first_token_s,
                  prefill_s=reply.timings.get("prompt_ms", 0.0), decode_s=reply.timings.get("predicted_ms", 0.0))
    stats.prefill_tokens = max(0, reply.prompt_tokens - reply.cached_tokens)
    stream.finish()
    return TurnResult("".join(stream.answer), finish, reply.model, params.get("seed"), None, stats, [],
                      "".join(stream.reasoning).strip())


def show_remote_prompt(prompt: str | None, opts: TurnOptions, env: Environment, settings):
    """`--show-prompt` on a server: llama-server's tokens; any other server renders its own prompt."""
    from quipu.app.served import show_served_prompt

    served = open_served(settings)
    if served is None:
        refuse_unsupported(opts, show=True)
    with closing(served):
        return show_served_prompt(served, prompt, opts, env, settings.url)


def list_remote_models(env: Environment, settings) -> list[dict]:
    from quipu.engine.remote import RemoteModel

    with RemoteModel(settings) as remote:
        return [{"name": m["id"], "owned_by": m.get("owned_by"), "url": settings.url} for m in remote.models()]



def save_transcript(store, name: str, messages: list[dict], model: str, url: str, params: dict,
                    created: str | None) -> None:
    """A session's transcript as a chat API turn leaves it: the messages, and no tokens or state
    (the server's context is not ours to keep)."""
    where = {"name": model, "url": url}
    store.save(name, Transcript(
        model=where, params=params, context=ContextSettings().state_key(),
        messages=messages, tokens=[], n_decoded=0, draws=0, created=created or now_iso(), updated=now_iso(),
        quipu=__version__, build="server"), None)


class RemoteChatSession(SessionCommands):
    """`quipu chat --url`: the chat's library side on a server; every turn is saved, and each
    sends the whole conversation. What only a local model can do is refused, one line each."""

    def __init__(self, env: Environment, opts: TurnOptions, settings):
        from contextlib import ExitStack

        self.env, self.opts, self.settings = env, opts, settings
        self.store = store_for(env)
        self._stack = ExitStack()
        self.name = ""
        self.messages: list = []
        self.created: str | None = None
        self.resumed = False
        self.last_stats = None
        self.model_name = settings.model or "?"
        self._notices: list[str] = []
        self._used = 0

    @classmethod
    def open(cls, env: Environment, opts: TurnOptions, settings, *, name: str | None = None,
             resume_latest: bool = False):
        """The chat on a server: on llama-server the local chat itself (`ChatSession`), driven by
        tokens; on any other, this one."""
        from quipu.app.chat import ChatSession
        from quipu.app.served import ServedNamedSession

        served = open_served(settings)
        if served is not None:
            return ChatSession.open(env, opts, name=name, resume_latest=resume_latest,
                                    opener=ServedNamedSession.opener(served, settings.url))
        refuse_unsupported(opts)
        chat = cls(env, opts, settings)
        chat._switch(chat._name_to_open(name, resume_latest), opts)
        return chat

    def _switch(self, name: str, opts: TurnOptions) -> None:
        from contextlib import ExitStack

        from quipu.sessions.conversation import Message

        validate_name(name)
        stack = ExitStack()
        try:
            stack.enter_context(self.store.lock(name))
            record = self.store.load_transcript(name) if self.store.exists(name) else None
        except BaseException:
            stack.close()
            raise
        self.close()
        self._stack, self.name, self.resumed = stack, name, record is not None
        self.messages = [Message(m["role"], m["content"]) for m in record.messages] if record else []
        self.created = record.created if record else None
        system = session_system(opts, self.env, record is not None)
        if system is not None:
            self.set_system(system or None, save=False)
        self.last_stats = None
        self._used = 0

    def close(self) -> None:
        self._stack.close()

    @property
    def notices(self) -> list[str]:
        out, self._notices[:] = list(self._notices), []
        return out

    # ---- turns -----------------------------------------------------------------------------

    def send(self, text: str, on_text=None, should_stop=None, on_progress=None, on_reasoning=None):
        from quipu.sessions.conversation import Message

        self.messages.append(Message("user", text))
        return self._reply(on_text, should_stop, on_reasoning)

    def retry(self, on_text=None, should_stop=None, on_progress=None, on_reasoning=None):
        if not self.messages or self.messages[-1].role != "assistant":
            raise UsageError("there is no reply to retry")
        self.messages.pop()
        return self._reply(on_text, should_stop, on_reasoning)

    def continue_reply(self, *args, **kwargs):
        raise CapabilityError("/continue cannot be used with this server (only llama.cpp's llama-server takes it)")

    def _reply(self, on_text, should_stop, on_reasoning):
        from quipu.app.chat import TurnOutcome
        from quipu.sessions.conversation import Message
        from quipu.sessions.inference import Generation

        wire = [{"role": m.role, "content": m.content} for m in self.messages]
        try:
            result, failure = _ask(wire, self.opts, self.env, self.settings, on_text, on_reasoning, should_stop)
        except BaseException:
            self.messages.pop()  # nothing came: the message is not part of the conversation
            raise
        self.messages.append(Message("assistant", result.text))
        self._notices += result.notices
        self.model_name = result.model or self.model_name
        self.last_stats = result.stats
        self._used = result.stats.prompt_tokens + result.stats.completion_tokens
        self.save()
        if failure is not None:
            raise failure
        return TurnOutcome(Generation(result.text, [], result.finish_reason), result.stats)

    # ---- the conversation --------------------------------------------------------------------

    def undo(self) -> bool:
        if not any(m.role == "user" for m in self.messages):
            return False
        while self.messages and self.messages[-1].role != "user":
            self.messages.pop()
        self.messages.pop()
        self.save()
        return True

    def reset(self) -> None:
        self.messages = [m for m in self.messages if m.role == "system"]
        self.save()

    def set_system(self, text: str | None, save: bool = True) -> None:
        from quipu.sessions.conversation import Message

        self.messages = [m for m in self.messages if m.role != "system"]
        if text:
            self.messages.insert(0, Message("system", text))
        if save:
            self.save()

    def drop_oldest(self, for_message: str | None = None) -> int:
        """Drops the oldest exchange (the server's context size is its own)."""
        first = next((i for i, m in enumerate(self.messages) if m.role == "user"), None)
        if first is None:
            return 0
        end = next((i for i in range(first + 1, len(self.messages)) if self.messages[i].role == "user"),
                   len(self.messages))
        del self.messages[first:end]
        self.save()
        return end - first

    def new_session_with_system(self, on_progress=None) -> str:
        from quipu.app.chat import generate_name

        system = next((m.content for m in self.messages if m.role == "system"), "")
        self.save()
        name = generate_name(set(self.store.names()))
        self._switch(name, TurnOptions(**{**self.opts.__dict__, "system": system}))
        self.save()
        return name

    def set_option(self, key: str, value: str):
        import dataclasses

        key, parsed = self.parse_setting(key, value)
        self.opts = dataclasses.replace(self.opts, **{key: parsed})
        max_tokens(self.opts, self.env)  # checked as the command line's would be
        return parsed

    def constrain(self, schema=None, grammar=None) -> bool:
        raise CapabilityError("/schema and /grammar cannot be used with this server (only llama.cpp's llama-server takes them)")

    def set_thinking(self, on: bool) -> bool:
        raise CapabilityError("/think cannot be used with this server (only llama.cpp's llama-server takes it)")

    # ---- saving and switching ----------------------------------------------------------------

    def save(self) -> None:
        save_transcript(self.store, self.name, [{"role": m.role, "content": m.content} for m in self.messages],
                        self.model_name, self.settings.url, request_params(self.opts, self.env), self.created)
        self.created = self.created or now_iso()

    def load(self, name: str, on_progress=None) -> None:
        self._check_load(name)
        self.save()
        self._switch(name, TurnOptions())

    # ---- figures: the server's, as far as it tells ---------------------------------------------

    @property
    def context_used(self) -> int:
        return self._used

    @property
    def context_size(self) -> int:
        return 0  # unknown: the server's own

    @property
    def context_nearly_full(self) -> bool:
        return False
