"""One turn of `quipu run`, from the user's options to a finished generation, with or without
a named session; and what such a turn would feed the model (`--show-prompt`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from quipu.app.environment import (
    Environment,
    TurnOptions,
    chat_template_source,
    max_tokens,
    system_prompt,
    template_variables,
)
from quipu.app.named import FOLD_NOTICE, NamedSession, open_session, store_for
from quipu.engine.base import Backend, ProgressFn
from quipu.errors import BadInput, ContextOverflow, EngineError, UsageError
from quipu.models import fingerprint
from quipu.sessions.conversation import Conversation, Message
from quipu.sessions.inference import Generation, InferenceSession, Stats, common_prefix
from quipu.sessions.thinking import ThinkingSplitter
from quipu.store.cache import MIN_TOKENS, PromptCache
from quipu.store.store import validate_name

TextFn = Callable[[str], None]
StopFn = Callable[[], bool]
# opener(store, name, opts, env, on_progress) -> a named session, open (NamedSession.open's shape)
Opener = Callable[..., NamedSession]


@dataclass
class TurnResult:
    text: str  # the answer; a thinking model's reasoning is apart
    finish_reason: str
    model: str
    seed: int
    session: str | None
    stats: Stats = field(default_factory=Stats)
    notices: list[str] = field(default_factory=list)
    reasoning: str = ""
    failure: Exception | None = None  # a server failing mid-reply: raised once the result is out

    def to_json(self) -> dict:
        return {
            "text": self.text,
            "reasoning": self.reasoning or None,
            "finish_reason": self.finish_reason,
            "model": self.model,
            "seed": self.seed,
            "session": self.session,
            "usage": self.stats.usage(),
            "timings": self.stats.timings(),
        }


class ReplyStream:
    """Passes a reply's text on as it is generated, a thinking model's reasoning apart from its
    answer, and stops the generation when asked. One per turn."""

    def __init__(self, on_text: TextFn | None = None, should_stop: StopFn | None = None,
                 on_reasoning: TextFn | None = None, starts_thinking: Callable[[], bool] = lambda: False):
        self._on_text, self._on_reasoning = on_text, on_reasoning
        self._should_stop = should_stop
        self._starts_thinking = starts_thinking
        self._splitter: ThinkingSplitter | None = None
        self.answer: list[str] = []
        self.reasoning: list[str] = []

    def on_token(self, _token: int, text: str) -> bool:
        if self._splitter is None:  # the prompt is rendered by now, and may have opened a block
            self._splitter = ThinkingSplitter(self._starts_thinking())
        if text:
            self._emit(self._splitter.feed(text))
        return not (self._should_stop is not None and self._should_stop())

    def finish(self) -> None:
        if self._splitter is not None:
            self._emit(self._splitter.flush())
            self._splitter = None

    def _emit(self, pieces: list[tuple[bool, str]]) -> None:
        for is_reasoning, text in pieces:
            (self.reasoning if is_reasoning else self.answer).append(text)
            callback = self._on_reasoning if is_reasoning else self._on_text
            if callback is not None:
                callback(text)

    def result(self, gen: Generation, model: str, session: InferenceSession, name: str | None,
               notices: list[str] | None = None) -> TurnResult:
        self.finish()
        return TurnResult("".join(self.answer), gen.finish_reason, model, session.params.seed, name, session.stats,
                          notices or [], "".join(self.reasoning).strip(), gen.error)


@dataclass
class PromptView:
    """What `--show-prompt` shows: the exact context a turn would feed, without generating."""

    text: str
    tokens: list[int]
    reused: int  # how many of them need not be read: a session's context, or the prompt cache
    model: str
    session: str | None

    def to_json(self) -> dict:
        return {"text": self.text, "tokens": self.tokens, "reused_tokens": self.reused, "model": self.model,
                "session": self.session}


def run_turn(
    prompt: str | None,
    opts: TurnOptions,
    env: Environment,
    *,
    on_text: TextFn | None = None,
    on_reasoning: TextFn | None = None,
    on_progress: ProgressFn | None = None,
    should_stop: StopFn | None = None,
    on_result: Callable[[TurnResult], None] | None = None,
) -> TurnResult:
    """Runs one prompt to a reply; `on_text` receives the answer as it is generated and
    `on_reasoning` a thinking model's reasoning; `on_result` the result, before the prompt
    cache is written (so a reader of the answer does not wait for it)."""
    progress = progress_callback(on_progress, should_stop)
    if opts.session is not None or opts.continue_reply:
        result = run_session_turn(prompt, opts, env, progress, on_text=on_text, on_reasoning=on_reasoning,
                                  should_stop=should_stop)
        if on_result is not None:
            on_result(result)  # a session's turn is saved before its answer ends
        if result.failure is not None:
            raise result.failure
        return result
    if not prompt:
        raise BadInput("no prompt: give one as an argument or on standard input")
    limit = max_tokens(opts, env)
    source = chat_template_source(opts)
    model_name, model_path, session = open_session(opts, env)
    try:
        session.check_text_fits(prompt)
        if opts.raw:
            stream = ReplyStream(on_text, should_stop)
            tokens = session.backend.tokenize(prompt, add_special=True, parse_special=False)
            cached = cache_lookup(session, tokens, model_path, opts, env)
            gen = session.generate(tokens, limit, opts.stop, stream.on_token, progress)
            result = stream.result(gen, model_name, session, None)
        else:
            conv = Conversation.start(session, system_prompt(opts, env), template=source,
                                      variables=template_variables(opts))
            conv.messages.append(Message("user", prompt))
            tokens = conv.context_tokens()
            conv.messages.pop()
            cached = cache_lookup(session, tokens, model_path, opts, env)
            stream = ReplyStream(on_text, should_stop, on_reasoning, lambda: conv.reply_starts_thinking)
            gen = conv.send(prompt, max_tokens=limit, stop=opts.stop, on_token=stream.on_token, on_progress=progress)
            result = stream.result(gen, model_name, session, None,
                                   [FOLD_NOTICE] if conv.template.folds_system else [])
        if on_result is not None:
            on_result(result)  # the answer is out before the cache is written
        if cached is not None:
            cache_save(session, tokens, cached)
            if opts.verbose:  # a damaged entry is dropped quietly, and said only when asked
                result.notices += cached.cache.notes
        return result
    finally:
        session.backend.close()


@dataclass
class CacheUse:
    cache: PromptCache
    key: dict
    reused: int


def cache_lookup(session: InferenceSession, tokens: list[int], model_path, opts: TurnOptions,
                 env: Environment) -> CacheUse | None:
    """Restores the longest cached beginning of `tokens` into the session, if any; None when the
    cache is off for this run."""
    if opts.no_cache:
        return None
    cache = PromptCache(env.dirs.prompt_cache, env.cache_max_bytes)
    key = cache_key(session, model_path)
    hit = cache.lookup(key, tokens)
    reused = 0
    if hit is not None:
        keep = min(hit.reuse, len(tokens) - 1)  # the last token is read again, for its logits
        try:
            session.restore_prefix(hit.state, hit.tokens, keep)
            reused = keep
        except EngineError as exc:
            cache.drop(hit.path, str(exc))
    return CacheUse(cache, key, reused)


def cache_key(session: InferenceSession, model_path) -> dict:
    """What a cache entry's state bytes are valid under: the model, the native build, the context."""
    backend = session.backend
    return {"fingerprint": fingerprint(model_path), "build": backend.build, "context": backend.context.state_key()}


def cached_count(session: InferenceSession, tokens: list[int], model_path, opts: TurnOptions,
                 env: Environment) -> int:
    """How many of `tokens` a run would restore from the prompt cache (`--show-prompt`)."""
    if opts.no_cache:
        return 0
    found = PromptCache(env.dirs.prompt_cache, env.cache_max_bytes).peek(cache_key(session, model_path), tokens)
    return min(found, len(tokens) - 1) if found else 0


def first_prompt_from_cache(named: NamedSession, text: str, opts: TurnOptions, env: Environment) -> None:
    """A new conversation's first prompt begins, perhaps, as earlier runs' did (a long system
    prompt): the cached beginning is restored, and the turn reads only the rest."""
    conv = named.conversation
    if named.model_path is None:  # a session on a server: the prompt cache holds local models' states
        return
    if named.session.n_decoded or any(m.role != "system" for m in conv.messages):
        return
    conv.messages.append(Message("user", text))
    try:
        tokens = conv.context_tokens()
    finally:
        conv.messages.pop()
    cache_lookup(named.session, tokens, named.model_path, opts, env)


def cache_save(session: InferenceSession, tokens: list[int], use: CacheUse) -> None:
    """Keeps the state of the prompt `tokens` (not the reply), unless the cache had nearly all of
    it already: questions after one long beginning share one entry."""
    if len(tokens) - use.reused < MIN_TOKENS or session.n_decoded < len(tokens):
        return
    try:
        session.rewind(len(tokens))
        use.cache.save(use.key, tokens, session.backend.snapshot_bytes())
    except (EngineError, OSError):
        pass  # a cache never fails a run


def progress_callback(on_progress: ProgressFn | None, should_stop: StopFn | None) -> ProgressFn:
    """An on_progress for prefills: reports, and stops when asked."""

    def progress(done: int, total: int) -> bool:
        if on_progress is not None:
            on_progress(done, total)
        return not (should_stop is not None and should_stop())

    return progress


def run_session_turn(prompt: str | None, opts: TurnOptions, env: Environment, progress: ProgressFn, *,
                     on_text: TextFn | None = None, on_reasoning: TextFn | None = None,
                     should_stop: StopFn | None = None, opener: Opener | None = None) -> TurnResult:
    """`quipu run --session NAME` (see run_turn): continue or create the session, run one turn, save
    it. `opener` opens the named session (a local model's by default)."""
    name = check_session_turn(prompt, opts)
    opener = opener or NamedSession.open
    limit = max_tokens(opts, env)
    store = store_for(env)
    store.clean_temporaries()
    with store.lock(name):
        named = opener(store, name, opts, env, progress)
        try:
            conv = named.conversation
            stream = ReplyStream(on_text, should_stop, on_reasoning, lambda: conv.reply_starts_thinking)
            try:
                if opts.continue_reply:
                    gen = conv.continue_reply(max_tokens=limit, stop=opts.stop, on_token=stream.on_token,
                                              on_progress=progress)
                else:
                    first_prompt_from_cache(named, prompt, opts, env)
                    gen = conv.send(prompt, max_tokens=limit, stop=opts.stop, on_token=stream.on_token,
                                    on_progress=progress)
            except ContextOverflow as exc:
                if len(named.session.tokens) < exc.n_ctx // 2:
                    raise  # the prompt alone is too long
                raise ContextOverflow(exc.prompt_tokens, exc.n_ctx, at_least=exc.at_least, hint=(
                    f"session '{name}' is full; continue it with a larger --ctx, or free room with /trim "
                    f"in `quipu chat -S {name}`"
                )) from None
            named.note_template()
            named.save()
        finally:
            named.close()
    return stream.result(gen, named.model_name, named.session, name, named.notices)


def check_session_turn(prompt: str | None, opts: TurnOptions) -> str:
    """The session's name, once the options make sense for a session turn."""
    if opts.session is None:
        raise UsageError("--continue needs --session NAME")
    if opts.raw:
        raise UsageError("--raw cannot be used with --session: sessions are conversations")
    if opts.continue_reply and prompt:
        raise UsageError("--continue keeps generating the last reply; it takes no prompt")
    if not opts.continue_reply and not prompt:
        raise BadInput("no prompt: give one as an argument or on standard input")
    return validate_name(opts.session)


def show_prompt(prompt: str | None, opts: TurnOptions, env: Environment, opener: Opener | None = None) -> PromptView:
    """The context `run_turn` would feed for this prompt (a session's included), without
    generating or saving anything."""
    if opts.session is not None or opts.continue_reply:
        name = check_session_turn(prompt, opts)
        store = store_for(env)
        with store.lock(name):
            named = (opener or NamedSession.open)(store, name, opts, env)
            try:
                conv = named.conversation
                if opts.continue_reply:
                    if not conv.messages or conv.messages[-1].role != "assistant":
                        raise UsageError("there is no reply to continue")
                    tokens = conv.context_tokens(True, conv.messages.pop().content)
                else:
                    conv.messages.append(Message("user", prompt or ""))
                    tokens = conv.context_tokens()
                reused = common_prefix(tokens, named.session.tokens)
                return PromptView(spell(named.backend, tokens), tokens, reused, named.model_name, name)
            finally:
                named.close()
    if not prompt:
        raise BadInput("no prompt: give one as an argument or on standard input")
    source = chat_template_source(opts)
    model_name, model_path, session = open_session(opts, env)
    try:
        if opts.raw:
            tokens = session.backend.tokenize(prompt, add_special=True, parse_special=False)
        else:
            conv = Conversation.start(session, system_prompt(opts, env), template=source,
                                      variables=template_variables(opts))
            conv.messages.append(Message("user", prompt))
            tokens = conv.context_tokens()
        reused = cached_count(session, tokens, model_path, opts, env)
        return PromptView(spell(session.backend, tokens), tokens, reused, model_name, None)
    finally:
        session.backend.close()


def spell(backend: Backend, tokens: list[int]) -> str:
    """Tokens as text, control tokens written out: what the model sees."""
    if hasattr(backend, "detokenize"):  # a server's vocabulary: one request for them all
        return backend.detokenize(tokens)
    return b"".join(backend.token_text(t) for t in tokens).decode("utf-8", "replace")
