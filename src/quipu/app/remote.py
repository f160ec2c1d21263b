"""`quipu run --url`: one prompt answered by a model on a server (see `engine/remote.py`).

What the server cannot be asked through its chat API is refused before anything is sent,
never faked: grammars and schemas, logit biases, `--raw`, `--show-prompt`, named sessions.
"""

from __future__ import annotations

from typing import Callable

from quipu.app.environment import Environment, TurnOptions, max_tokens, system_prompt
from quipu.app.turns import ReplyStream, StopFn, TextFn, TurnResult
from quipu.errors import BadInput, CapabilityError
from quipu.sessions.inference import Stats


def refuse_unsupported(opts: TurnOptions, *, show: bool = False) -> None:
    refused = [
        (opts.session is not None or opts.continue_reply, "named sessions (--session)"),
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
    from quipu.engine.remote import RemoteError, RemoteModel

    refuse_unsupported(opts)
    if not prompt:
        raise BadInput("no prompt: give one as an argument or on standard input")
    limit = max_tokens(opts, env)
    params = request_params(opts, env)
    if opts.model:
        settings.model = opts.model
    messages = []
    system = system_prompt(opts, env)
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": prompt})
    stream = ReplyStream(on_text, should_stop, on_reasoning)
    with RemoteModel(settings) as remote:
        try:
            reply = remote.chat(messages, params=params, max_tokens=limit, stop=tuple(opts.stop),
                                on_text=lambda text: stream.on_token(0, text))
        except RemoteError as exc:
            if exc.partial is not None and exc.partial.text:
                result = remote_result(stream, exc.partial, params, "interrupted")
                if on_result is not None:
                    on_result(result)  # what came is shown, then the error said
            raise
    result = remote_result(stream, reply, params, reply.finish_reason)
    if on_result is not None:
        on_result(result)
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

