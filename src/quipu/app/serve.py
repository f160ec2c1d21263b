"""`quipu serve`'s work, without HTTP: an OpenAI-style chat request made a plan (its fields read by
the registry's request names, `quipu.options`, over the server's own options) and a
conversation, answered by one turn (`turn.Turn`) as `quipu run --messages` answers it. After each
answer the conversation's context joins the prompt cache, on disk: a request whose messages go on
from an earlier conversation restores it and reads only what is new, after a restart too, and
its answer is the one a fresh read gives. The model is loaded at the first request and kept,
each request a fresh context on it. Requests are answered one at a time; a few more wait, and
past them a request is refused as busy."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
import math
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from quipu.app.answer import Answer
from quipu.app.environment import Environment
from quipu.app.turn import Ask, Turn
from quipu.app.turn_options import (TurnOptions, chat_template_source, max_tokens, stop_strings,
                                    template_variables)
from quipu.errors import QuipuError, UsageError
from quipu.options import OPTIONS, SAMPLING, Option
from quipu.sessions.base import Message, Stats
from quipu.sessions.base import ReplySink as ReplySink  # (the HTTP side's sinks are made of it)
from quipu.sessions.conversation import Conversation, TurnSettings
from quipu.sessions.inference import InferenceSession

if TYPE_CHECKING:
    from quipu.app.local import LocalKeeper
    from quipu.engine.base import Backend

MAX_WAITING = 8  # requests waiting for the model beside the one it answers; past them: busy
# What a chat request may ask that this server does not do yet: refused, never dropped silently.
NOT_YET = {"tools": "tools", "functions": "tools", "logprobs": "log probabilities",
           "top_logprobs": "log probabilities"}
FINISH = {"stop": "stop", "length": "length", "context_full": "length", "interrupted": "stop"}


class RequestError(UsageError):
    """A request the server refuses: its HTTP status, and the kind the API's error names."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


def chat_plan(body: Mapping[str, Any], base: TurnOptions) -> TurnOptions:
    """The plan of a chat request: its sampling fields, reply length and stop strings, by their
    names in a request (`quipu.options`), each checked against its type and bounds, over the
    server's own options (`base`)."""
    for field, what in NOT_YET.items():
        if body.get(field) not in (None, False, [], {}):
            raise RequestError(f"{field}: quipu serve does not take {what} yet")
    if body.get("n", 1) != 1:
        raise RequestError("n: quipu serve gives one choice a request")
    given: dict[str, Any] = {}
    for name, option in OPTIONS.items():
        if option.request is None:
            continue
        field, value = option.request, body.get(option.request)
        if name == "max_tokens" and body.get("max_completion_tokens") is not None:
            field, value = "max_completion_tokens", body["max_completion_tokens"]
        if value is not None:
            given[name] = _checked(field, option, value)
    schema = response_schema(body.get("response_format"))
    if schema is not None:
        given["schema"] = schema
    sampling = {k: v for k, v in given.items() if k in SAMPLING}
    rest = {k: v for k, v in given.items() if k not in SAMPLING}
    return dataclasses.replace(base, sampling={**base.sampling, **sampling}, **rest)


def response_schema(form: Any) -> str | None:
    """The JSON Schema (its text) a request's `response_format` holds the answer to: `json_schema`'s
    schema, any JSON object for `json_object`; None for text."""
    if form is None:
        return None
    kind = form.get("type") if isinstance(form, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return '{"type": "object"}'
    if kind == "json_schema":
        given = form.get("json_schema")
        schema = given.get("schema") if isinstance(given, dict) else None
        if not isinstance(schema, dict):
            raise RequestError("response_format.json_schema.schema must be a JSON Schema (an object)")
        return json.dumps(schema)
    raise RequestError("response_format.type must be text, json_object or json_schema")


def _checked(field: str, option: Option, value: Any) -> Any:
    """A request's value of `option` (named `field` there), of its type and within its bounds."""
    if option.multiple:  # (stop: a text, or a list of texts)
        texts = [value] if isinstance(value, str) else value
        if not isinstance(texts, list) or not all(isinstance(t, str) and t for t in texts):
            raise RequestError(f"{field} must be a text or a list of texts that are not empty")
        return tuple(texts)
    kind = option.kind
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or (isinstance(value, float) and not math.isfinite(value)) or (kind is int and value != int(value)):
        raise RequestError(f"{field} must be {'an integer' if kind is int else 'a finite number'}, not {value!r}")
    value = kind(value)
    if option.bounds is not None and not option.bounds.holds(value):
        raise RequestError(f"{field} {option.bounds.rule}, got {value}")
    return value


def chat_messages(body: Mapping[str, Any]) -> list[Message]:
    """The request's messages (`sessions.base.Message`), each field checked."""
    from quipu.app.tool_files import messages_of

    if "messages" not in body:
        raise RequestError("messages: a chat request needs its messages")
    media: list[Any] = []
    try:
        messages = messages_of(body["messages"], Path("the request"), media)
    except UsageError as exc:
        raise RequestError(str(exc)) from None
    if media:
        raise RequestError("messages: quipu serve does not take images or recordings yet")
    return messages


@dataclass(frozen=True)
class ChatRequest:
    """A chat request, checked: its plan and its messages."""

    opts: TurnOptions
    messages: list[Message]


class Served:
    """The model a server answers with (`base`: the server's own options, `-m` among them): one
    request at a time, a few more waiting."""

    def __init__(self, env: Environment, base: TurnOptions):
        self.env, self.base = env, base
        self.model, self.path = env.resolve_model(base.model)
        self._turns = threading.Lock()
        self._loaded: tuple[Backend, LocalKeeper] | None = None  # the model, once loaded, and its keeper
        self._waiting = threading.BoundedSemaphore(MAX_WAITING + 1)

    def models(self) -> list[dict[str, Any]]:
        return [{"id": self.model, "object": "model", "created": int(self.path.stat().st_mtime), "owned_by": "quipu"}]

    def check_model(self, name: Any) -> None:
        if name is not None and name not in (self.model, self.base.model, str(self.path)):
            raise RequestError(f"model '{str(name)[:200]}' is not served here (this server has '{self.model}')",
                               404, "model_not_found")

    def plan(self, body: Mapping[str, Any]) -> ChatRequest:
        """What a chat request asks, checked before anything is loaded (`RequestError`)."""
        self.check_model(body.get("model"))
        opts = chat_plan(body, self.base)
        if opts.schema is not None:
            from quipu.app.turn_options import grammar_of

            grammar_of(opts)  # (a schema the engine cannot keep to is refused before anything is loaded)
        messages = chat_messages(body)
        if messages[-1].role == "system":
            raise RequestError("messages: the last message is the system prompt; nothing to reply to")
        return ChatRequest(opts, messages)

    def chat(self, asked: ChatRequest, sink: ReplySink) -> Answer:
        """Answers a chat request into `sink` (which says when its client has gone), once the
        model is free; the answer is logged unless the server was told not to."""
        if not self._waiting.acquire(blocking=False):
            raise RequestError("the server is busy: too many requests wait; try again soon", 503, "server_busy")
        try:
            with self._turns:
                answer = self._answer(asked.opts, asked.messages, sink)
        finally:
            self._waiting.release()
        from quipu.app.answer_log import log_answer

        said = next((m.content for m in reversed(asked.messages) if m.role == "user"), "")
        unlogged = log_answer(self.env, asked.opts.logged, "serve", said, answer, system=answer.system)
        if unlogged:
            answer.notices.append(unlogged)
        return answer

    def _answer(self, opts: TurnOptions, messages: list[Message], sink: ReplySink) -> Answer:
        limit, stop = max_tokens(opts, self.env), stop_strings(opts, self.env)
        session, keeper, notices = self._session(opts)
        conv = Conversation.start(session, None, template=chat_template_source(opts), messages=messages,
                                  settings=TurnSettings().but(variables=template_variables(opts)))
        turn = Turn(session, keeper, conv, opts.tool_options, notices=notices)
        answer = turn.answer(Ask("continue" if messages[-1].role == "assistant" else "answer"), limit, stop, sink)
        return turn.remember(answer)

    def _session(self, opts: TurnOptions) -> tuple[InferenceSession, LocalKeeper, list[str]]:
        """A fresh session (an empty context, as a lone run's) on the model, loaded at the first
        request and kept; its keeper; what loading it said."""
        from quipu.app.local import LocalHost, model_fingerprint
        from quipu.app.placing import placement_notices, placement_of
        from quipu.app.turn_options import context_settings, load_backend, offload, sampling_params, with_logit_biases

        notices, load_s = [], 0.0
        if self._loaded is None:
            started = time.perf_counter()
            loaded = load_backend(self.path, context_settings(opts, self.env), opts.verbose, offload(opts, self.env))
            load_s = time.perf_counter() - started
            self._loaded = loaded, LocalHost.keeper(self.model, self.path, model_fingerprint(self.path, self.env),
                                                    opts, self.env, None)
            notices = placement_notices(loaded, ctx_given=opts.ctx is not None, verbose=opts.verbose)
        backend, keeper = self._loaded
        params = with_logit_biases(sampling_params(opts, self.env), backend, opts)
        stats = Stats(load_s=load_s, placement=placement_of(backend))
        return InferenceSession(backend, params, stats=stats), keeper, notices

    def close(self) -> None:
        """Frees the model (the server is stopping)."""
        if self._loaded is not None:
            self._loaded[0].close()
            self._loaded = None


def chat_completion(answer: Answer, ident: str, created: int) -> dict[str, Any]:
    """The OpenAI chat completion of an answer, whole."""
    message: dict[str, Any] = {"role": "assistant", "content": answer.text}
    if answer.reasoning:
        message["reasoning_content"] = answer.reasoning
    return {"id": ident, "object": "chat.completion", "created": created, "model": answer.model,
            "choices": [{"index": 0, "message": message, "finish_reason": FINISH.get(answer.finish_reason, "stop")}],
            "usage": usage(answer), "system_fingerprint": answer.fingerprint}


def usage(answer: Answer) -> dict[str, Any]:
    """The usage an answer reports, the tokens restored rather than read among its prompt's."""
    s = answer.stats
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
            "total_tokens": s.prompt_tokens + s.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": s.cached_tokens}}


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The status and OpenAI-shaped body of a failure (one line, never a traceback)."""
    if isinstance(exc, RequestError):
        status, kind = exc.status, exc.kind
    elif isinstance(exc, UsageError):
        status, kind = 400, "invalid_request_error"
    elif isinstance(exc, QuipuError):
        status, kind = 500, "server_error"
    else:
        status, kind = 500, "server_error"
        exc = QuipuError(f"the server failed: {type(exc).__name__}")
    return status, {"error": {"message": str(exc), "type": kind, "param": None, "code": None}}
