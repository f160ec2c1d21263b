"""`quipu run --url`: one prompt answered by a model on a server (see `engine/remote.py`).

A named session on a server (`-S NAME --url`) keeps its transcript as the truth, and each
turn sends the whole conversation (servers keep their own prompt caches). Such a transcript
holds no token history or context state, so a session can move between a server and a local
model: continued locally (with `--model`), it is read again from its messages.

What the server cannot be asked through its chat API is refused before anything is sent,
never faked: grammars and schemas, logit biases, `--raw`, `--show-prompt`.
"""

from __future__ import annotations

from typing import Callable

from quipu import __version__
from quipu.app.environment import Environment, TurnOptions, max_tokens, system_prompt
from quipu.app.named import store_for
from quipu.app.turns import ReplyStream, StopFn, TextFn, TurnResult
from quipu.engine.base import ContextSettings
from quipu.store.store import validate_name
from quipu.store.transcript import Transcript, now_iso
from quipu.errors import BadInput, CapabilityError
from quipu.sessions.inference import Stats


def refuse_unsupported(opts: TurnOptions, *, show: bool = False) -> None:
    refused = [
        (opts.continue_reply, "--continue"),
        (opts.raw, "--raw"),
        (show, "--show-prompt"),
        (opts.schema is not None or opts.grammar is not None, "--schema and --grammar"),
        (bool(opts.logit_bias), "--logit-bias"),
        (opts.chat_template is not None, "--chat-template (the server renders its own)"),
        (opts.think is not None, "--think/--no-think"),
        (opts.kv_type is not None or opts.ctx is not None or opts.threads is not None,
         "--ctx, --threads and --kv-type (the server's own settings)"),
    ]
    for given, what in refused:
        if given:
            raise CapabilityError(f"{what} cannot be used with a server yet")


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
    refuse_unsupported(opts)
    if not prompt:
        raise BadInput("no prompt: give one as an argument or on standard input")
    if opts.model:
        settings.model = opts.model
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
            reply = remote.chat(messages, params=params, max_tokens=max_tokens(opts, env), stop=tuple(opts.stop),
                                on_text=lambda text: stream.on_token(0, text))
        except RemoteError as exc:
            if exc.partial is None or not exc.partial.text:
                raise
            return remote_result(stream, exc.partial, params, "interrupted"), exc
    return remote_result(stream, reply, params, reply.finish_reason), None


def _session_turn(name: str, prompt: str, opts: TurnOptions, env: Environment, settings, *, on_text, on_reasoning,
                  should_stop, on_result) -> TurnResult:
    store = store_for(env)
    store.clean_temporaries()
    with store.lock(name):
        record = store.load_transcript(name) if store.exists(name) else None
        messages = [{"role": m["role"], "content": m["content"]} for m in record.messages] if record else []
        system = opts.system if opts.system is not None else (None if record else system_prompt(opts, env))
        if system is not None:
            messages = [m for m in messages if m["role"] != "system"]
            if system:
                messages.insert(0, {"role": "system", "content": system})
        messages.append({"role": "user", "content": prompt})
        result, failure = _ask(messages, opts, env, settings, on_text, on_reasoning, should_stop)
        # The turn is kept even when cut short, as a local one stopped by Ctrl-C is.
        messages.append({"role": "assistant", "content": result.text})
        params = {k: v for k, v in request_params(opts, env).items()}
        store.save(name, Transcript(
            model={"name": result.model, "url": settings.url}, params=params,
            context=ContextSettings().state_key(), messages=messages, tokens=[], n_decoded=0,
            draws=0, created=record.created if record else now_iso(), updated=now_iso(), quipu=__version__,
            build="server"), None)
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


def list_remote_models(env: Environment, settings) -> list[dict]:
    from quipu.engine.remote import RemoteModel

    with RemoteModel(settings) as remote:
        return [{"name": m["id"], "owned_by": m.get("owned_by"), "url": settings.url} for m in remote.models()]

