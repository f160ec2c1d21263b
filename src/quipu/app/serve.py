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
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from quipu.app.answer import Answer
from quipu.app.environment import Environment
from quipu.app.tooldefs import Tool
from quipu.app.tools import OpenTools, Toolbox, offer
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
NOT_YET = {"functions": "functions (the old name of tools: send tools)", "logprobs": "log probabilities",
           "top_logprobs": "log probabilities"}
FINISH = {"stop": "stop", "length": "length", "context_full": "length", "interrupted": "stop",
          "tool_calls": "tool_calls"}


class RequestError(UsageError):
    """A request the server refuses: its HTTP status, and the kind the API's error names."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


def chat_plan(body: Mapping[str, Any], base: TurnOptions) -> TurnOptions:
    """The plan of an OpenAI-style chat request: its sampling fields, reply length, stop strings
    and response format, by their names there (`Option.request`), over the server's own options
    (`base`)."""
    for field, what in NOT_YET.items():
        if body.get(field) not in (None, False, [], {}):
            raise RequestError(f"{field}: quipu serve does not take {what} yet")
    if body.get("n", 1) != 1:
        raise RequestError("n: quipu serve gives one choice a request")
    names = {name: o.request for name, o in OPTIONS.items() if o.request is not None}
    if body.get("max_completion_tokens") is not None:
        names["max_tokens"] = "max_completion_tokens"
    return plan_of(body, names, base, response_schema(body.get("response_format")))


def ollama_plan(body: Mapping[str, Any], base: TurnOptions) -> TurnOptions:
    """The plan of an Ollama-style request: its `options` by their names there (`Option.ollama`;
    others, such as the server's own `num_ctx`, are the server's), and its `format` ("json", or
    a JSON Schema), over the server's own options (`base`)."""
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise RequestError("options must be an object")
    form = body.get("format")
    if form in (None, ""):
        schema = None
    elif form == "json":
        schema = '{"type": "object"}'
    elif isinstance(form, dict):
        schema = json.dumps(form)
    else:
        raise RequestError('format must be "json" or a JSON Schema (an object)')
    names = {name: o.ollama for name, o in OPTIONS.items() if o.ollama is not None}
    opts = plan_of(options, names, base, schema, where="options.")
    think = body.get("think")  # (a switch, or how hard: low, medium, high)
    if think is None:
        return opts
    if not isinstance(think, (bool, str)):
        raise RequestError("think must be true, false, low, medium or high")
    return dataclasses.replace(opts, think=think is not False,
                               reasoning_effort=think if isinstance(think, str) else opts.reasoning_effort)


def plan_of(fields: Mapping[str, Any], names: Mapping[str, str], base: TurnOptions, schema: str | None = None,
            where: str = "") -> TurnOptions:
    """`base` with the options `fields` gives under `names` (option: its name there), each
    checked against its type and bounds, and the answer held to `schema` where there is one."""
    given: dict[str, Any] = {}
    for name, field in names.items():
        if fields.get(field) is not None:
            given[name] = _checked(where + field, OPTIONS[name], fields[field])
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
    if kind is str:
        if not isinstance(value, str):
            raise RequestError(f"{field} must be a text, not {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or (isinstance(value, float) and not math.isfinite(value)) or (kind is int and value != int(value)):
        raise RequestError(f"{field} must be {'an integer' if kind is int else 'a finite number'}, not {value!r}")
    value = kind(value)
    if option.bounds is not None and not option.bounds.holds(value):
        raise RequestError(f"{field} {option.bounds.rule}, got {value}")
    return value


def request_tools(body: Mapping[str, Any], opts: TurnOptions) -> tuple[tuple[Tool, ...], TurnOptions]:
    """The tools a request offers (OpenAI's shape, which Ollama's shares), each checked as
    `--tools` checks a file's, which the client runs; and the plan with its `tool_choice`
    ("auto", "none", "required", or `{"type": "function", "function": {"name": NAME}}`)."""
    from quipu.app.tool_files import check_tool_schemas, tools_from_json
    from quipu.app.tools import Toolbox

    given, choice = body.get("tools"), body.get("tool_choice")
    if given in (None, []):
        if choice not in (None, "auto", "none"):
            raise RequestError("tool_choice: the request offers no tools to choose from")
        return (), opts
    if not isinstance(given, list):
        raise RequestError("tools must be a list of tools ({\"type\": \"function\", \"function\": ...})")
    if opts.schema is not None:
        raise RequestError("give tools or a response format, not both: a call is held to its tool's schema")
    try:
        box = Toolbox()
        box.add(tools_from_json("the request", given))
        check_tool_schemas(box.tools.values())
    except UsageError as exc:
        raise RequestError(str(exc).replace("the request: ", "")) from None
    if isinstance(choice, dict):
        fn = choice.get("function")
        choice = fn.get("name") if isinstance(fn, dict) else None
        if choice not in box.tools:
            raise RequestError("tool_choice must name one of the request's tools "
                               "({\"type\": \"function\", \"function\": {\"name\": NAME}})")
    elif choice not in (None, "auto", "none", "required"):
        raise RequestError("tool_choice must be auto, none, required, or a tool by name")
    return tuple(box.tools.values()), dataclasses.replace(opts, tool_choice=choice)


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
    """A request, checked: its plan and its messages, or, a plain completion's, its prompt."""

    opts: TurnOptions
    messages: list[Message]
    prompt: str | None = None
    tools: tuple[Tool, ...] = ()  # the client's: a reply that calls one ends there, the call in it


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
        """What an OpenAI-style chat request asks, checked before anything is loaded (`RequestError`)."""
        self.check_model(body.get("model"))
        tools, opts = request_tools(body, chat_plan(body, self.base))
        return self._asked(opts, chat_messages(body), tools)

    def completion(self, body: Mapping[str, Any]) -> ChatRequest:
        """What an OpenAI-style completion request (`/v1/completions`) asks: its prompt continued
        as it is, without the chat template (`quipu run --raw`)."""
        self.check_model(body.get("model"))
        for field in ("echo", "suffix"):
            if body.get(field):
                raise RequestError(f"{field}: quipu serve does not take it yet")
        if body.get("best_of", 1) != 1:
            raise RequestError("best_of: quipu serve gives one choice a request")
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("prompt must be a text that is not empty (one prompt a request)")
        opts = chat_plan({k: v for k, v in body.items() if k != "response_format"}, self.base)
        return ChatRequest(opts, [], prompt)

    def ollama(self, body: Mapping[str, Any], generate: bool = False) -> ChatRequest:
        """What an Ollama-style request asks (`/api/chat`, or `/api/generate`: a prompt and a
        system prompt), checked before anything is loaded."""
        self.check_model(body.get("model"))
        if body.get("images") or body.get("raw"):
            raise RequestError("images and raw prompts: quipu serve does not take them yet")
        if not generate:
            messages = body.get("messages")
            if isinstance(messages, list):  # (a tool's result names its tool as `tool_name` there)
                if any(isinstance(m, dict) and m.get("images") for m in messages):
                    raise RequestError("images: quipu serve does not take them yet")
                body = {**body, "messages": [{**m, "name": m.get("name") or m.get("tool_name")}
                                             if isinstance(m, dict) and m.get("role") == "tool" else m
                                             for m in messages]}
            tools, opts = request_tools(body, ollama_plan(body, self.base))
            return self._asked(opts, chat_messages(body), tools)
        prompt, system = body.get("prompt"), body.get("system")
        if not isinstance(prompt, str) or not prompt or not isinstance(system, (str, type(None))):
            raise RequestError("a generate request needs its prompt (a text), and its system prompt is a text")
        messages = ([Message("system", system)] if system else []) + [Message("user", prompt)]
        return self._asked(ollama_plan(body, self.base), messages)

    def _asked(self, opts: TurnOptions, messages: list[Message], tools: tuple[Tool, ...] = ()) -> ChatRequest:
        if opts.schema is not None:
            from quipu.app.turn_options import grammar_of

            grammar_of(opts)  # (a schema the engine cannot keep to is refused before anything is loaded)
        if messages[-1].role == "system":
            raise RequestError("messages: the last message is the system prompt; nothing to reply to")
        return ChatRequest(opts, messages, tools=tools)

    def chat(self, asked: ChatRequest, sink: ReplySink) -> Answer:
        """Answers a chat request into `sink` (which says when its client has gone), once the
        model is free; the answer is logged unless the server was told not to."""
        if not self._waiting.acquire(blocking=False):
            raise RequestError("the server is busy: too many requests wait; try again soon", 503, "server_busy")
        try:
            with self._turns:
                answer = self._answer(asked, sink)
        finally:
            self._waiting.release()
        from quipu.app.answer_log import log_answer

        said = asked.prompt or next((m.content for m in reversed(asked.messages) if m.role == "user"), "")
        unlogged = log_answer(self.env, asked.opts.logged, "serve", said, answer, system=answer.system)
        if unlogged:
            answer.notices.append(unlogged)
        return answer

    def _answer(self, asked: ChatRequest, sink: ReplySink) -> Answer:
        opts, messages = asked.opts, asked.messages
        limit, stop = max_tokens(opts, self.env), stop_strings(opts, self.env)
        session, keeper, notices = self._session(opts)
        if asked.prompt is not None:  # (a plain completion)
            turn = Turn(session, keeper, None, opts.tool_options, notices=notices)
            return turn.remember(turn.answer(Ask("raw", asked.prompt), limit, stop, sink))
        conv = Conversation.start(session, None, template=chat_template_source(opts), messages=messages,
                                  settings=TurnSettings().but(variables=template_variables(opts)))
        conv.set_reasoning(effort=opts.reasoning_effort)
        tools = OpenTools(Toolbox({t.spec.name: t for t in asked.tools})) if asked.tools else None
        offer(conv, tools, opts.tool_options)
        turn = Turn(session, keeper, conv, opts.tool_options, tools=tools, notices=notices)
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
    calls = openai_calls(answer)
    message: dict[str, Any] = {"role": "assistant", "content": answer.text or (None if calls else "")}
    if answer.reasoning:
        message["reasoning_content"] = answer.reasoning
    if calls:
        message["tool_calls"] = calls
    return {"id": ident, "object": "chat.completion", "created": created, "model": answer.model,
            "choices": [{"index": 0, "message": message, "finish_reason": FINISH.get(answer.finish_reason, "stop")}],
            "usage": usage(answer), "system_fingerprint": answer.fingerprint}


def waiting_calls(answer: Answer) -> list[Any]:
    """The calls a reply ended with, which the client runs (`app.tools.CallRecord`s)."""
    if answer.finish_reason != "tool_calls":
        return []
    return [c for c in answer.tool_calls if c.result is None and c.error is None]


def openai_calls(answer: Answer, streamed: bool = False) -> list[dict[str, Any]]:
    """The calls a reply ended with, in OpenAI's shape (the arguments a JSON text; `streamed`:
    as a stream's delta, each with its index)."""
    return [{**({"index": i} if streamed else {}), "id": call.id or f"call_{i}", "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
            for i, call in enumerate(waiting_calls(answer))]


def text_completion(answer: Answer, ident: str, created: int) -> dict[str, Any]:
    """The OpenAI completion of a plain answer, whole."""
    return {"id": ident, "object": "text_completion", "created": created, "model": answer.model,
            "choices": [{"index": 0, "text": answer.text, "logprobs": None,
                         "finish_reason": FINISH.get(answer.finish_reason, "stop")}], "usage": usage(answer)}


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


def ollama_error(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The status and Ollama-shaped body of a failure."""
    status, shaped = error_body(exc)
    return status, {"error": shaped["error"]["message"]}


def ollama_reply(answer: Answer, created: str) -> dict[str, Any]:
    """The last line of an Ollama-style reply (the whole reply, where it is not streamed, with
    `text`): why it ended, and its figures (`prompt_eval_count`: the prompt's tokens read, not
    restored)."""
    s = answer.stats
    return {"model": answer.model, "created_at": created, "done": True,
            "done_reason": "length" if FINISH.get(answer.finish_reason) == "length" else "stop",
            "total_duration": int((s.load_s + s.restore_s + s.prefill_s + s.decode_s) * 1e9),
            "load_duration": int(s.load_s * 1e9), "prompt_eval_count": s.prompt_tokens - s.cached_tokens,
            "prompt_eval_duration": int(s.prefill_s * 1e9), "eval_count": s.completion_tokens,
            "eval_duration": int(s.decode_s * 1e9)}


def ollama_piece(model: str, created: str, text: str, reasoning: str = "", *, generate: bool,
                 calls: Sequence[Any] = ()) -> dict[str, Any]:
    """A line of an Ollama-style reply: a piece of its text (or of its reasoning), or the calls
    it ended with (`app.tools.CallRecord`s), which the client runs."""
    if generate:
        return {"model": model, "created_at": created, "response": text,
                **({"thinking": reasoning} if reasoning else {}), "done": False}
    message = {"role": "assistant", "content": text, **({"thinking": reasoning} if reasoning else {}),
               **({"tool_calls": [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls]}
                  if calls else {})}
    return {"model": model, "created_at": created, "message": message, "done": False}


def ollama_models(served: Served) -> dict[str, Any]:
    """`/api/tags`: the model served."""
    from datetime import datetime, timezone

    stat = served.path.stat()
    return {"models": [{"name": served.model, "model": served.model,
                        "modified_at": datetime.fromtimestamp(stat.st_mtime, timezone.utc).isoformat(),
                        "size": stat.st_size, "digest": "", "details": {"format": "gguf"}}]}
