"""One turn of `quipu run`, from the user's options to a finished generation, with or without
a named session."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from quipu.app.environment import Environment, TurnOptions, max_tokens, system_prompt
from quipu.app.named import NamedSession, open_session, store_for
from quipu.engine.base import ProgressFn
from quipu.errors import BadInput, ContextOverflow, UsageError
from quipu.sessions.conversation import Conversation
from quipu.sessions.inference import Stats, TokenFn
from quipu.store.store import validate_name

TextFn = Callable[[str], None]
StopFn = Callable[[], bool]


@dataclass
class TurnResult:
    text: str
    finish_reason: str
    model: str
    seed: int
    session: str | None
    stats: Stats = field(default_factory=Stats)
    notices: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "text": self.text,
            "finish_reason": self.finish_reason,
            "model": self.model,
            "seed": self.seed,
            "session": self.session,
            "usage": self.stats.usage(),
            "timings": self.stats.timings(),
        }


def run_turn(
    prompt: str | None,
    opts: TurnOptions,
    env: Environment,
    *,
    on_text: TextFn | None = None,
    on_progress: ProgressFn | None = None,
    should_stop: StopFn | None = None,
) -> TurnResult:
    """Runs one prompt to a reply; `on_text` receives text as it is generated."""
    on_token = token_callback(on_text, should_stop)
    progress = progress_callback(on_progress, should_stop)
    if opts.session is not None or opts.continue_reply:
        return run_session_turn(prompt, opts, env, on_token, progress)
    if not prompt:
        raise BadInput("no prompt: give one as an argument or on standard input")
    limit = max_tokens(opts, env)
    model_name, _, session = open_session(opts, env)
    backend = session.backend
    try:
        if opts.raw:
            session.check_text_fits(prompt)
            tokens = backend.tokenize(prompt, add_special=True, parse_special=False)
            gen = session.generate(tokens, limit, opts.stop, on_token, progress)
        else:
            conv = Conversation.start(session, system_prompt(opts, env))
            gen = conv.send(prompt, max_tokens=limit, stop=opts.stop, on_token=on_token, on_progress=progress)
        return TurnResult(gen.text, gen.finish_reason, model_name, session.params.seed, None, session.stats)
    finally:
        backend.close()


def token_callback(on_text: TextFn | None, should_stop: StopFn | None):
    """An on_token for InferenceSession.infer: passes text on, stops when asked."""

    def on_token(_token: int, text: str) -> bool:
        if text and on_text is not None:
            on_text(text)
        return not (should_stop is not None and should_stop())

    return on_token


def progress_callback(on_progress: ProgressFn | None, should_stop: StopFn | None) -> ProgressFn:
    """An on_progress for prefills: reports, and stops when asked."""

    def progress(done: int, total: int) -> bool:
        if on_progress is not None:
            on_progress(done, total)
        return not (should_stop is not None and should_stop())

    return progress


def run_session_turn(prompt: str | None, opts: TurnOptions, env: Environment, on_token: TokenFn,
                     progress: ProgressFn) -> TurnResult:
    """`quipu run --session NAME` (see run_turn): continue or create the session, run one turn, save it."""
    if opts.session is None:
        raise UsageError("--continue needs --session NAME")
    if opts.raw:
        raise UsageError("--raw cannot be used with --session: sessions are conversations")
    if opts.continue_reply and prompt:
        raise UsageError("--continue keeps generating the last reply; it takes no prompt")
    if not opts.continue_reply and not prompt:
        raise BadInput("no prompt: give one as an argument or on standard input")
    name = validate_name(opts.session)
    limit = max_tokens(opts, env)
    store = store_for(env)
    store.clean_temporaries()
    with store.lock(name):
        named = NamedSession.open(store, name, opts, env, progress)
        try:
            conv = named.conversation
            try:
                if opts.continue_reply:
                    gen = conv.continue_reply(max_tokens=limit, stop=opts.stop, on_token=on_token, on_progress=progress)
                else:
                    gen = conv.send(prompt, max_tokens=limit, stop=opts.stop, on_token=on_token, on_progress=progress)
            except ContextOverflow as exc:
                if len(named.session.tokens) < exc.n_ctx // 2:
                    raise  # the prompt alone is too long
                raise ContextOverflow(exc.prompt_tokens, exc.n_ctx, at_least=exc.at_least, hint=(
                    f"session '{name}' is full; continue it with a larger --ctx, or free room with /trim "
                    f"in `quipu chat -S {name}`"
                )) from None
            named.save()
        finally:
            named.close()
    stats = named.session.stats
    return TurnResult(gen.text, gen.finish_reason, named.model_name, named.session.params.seed, name, stats, named.notices)
