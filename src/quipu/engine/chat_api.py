"""A model behind an HTTP server: llama.cpp's `llama-server`, vLLM, Ollama, LM Studio,
llama-cpp-python's server, any OpenAI-compatible one.

`ChatApiModel` speaks the OpenAI chat completions API (server-sent events when streaming),
and turns everything that can go wrong on the way into one-line `ServerError`s: a server that
cannot be reached, a key refused (naming the variable that holds it), a model the server does
not have, the server's own message on 4xx and 5xx, a stream cut in the middle or an event that
is not JSON (what came before is kept: `ServerError.partial`). Requests that fail before the
first token are tried again, with growing pauses, when the failure may pass (connection
refused, 429, 502, 503, 504); never after, so nothing is generated twice.

httpx is imported only here, so local runs and `--version` do not pay for it. The API key is
read from the environment at the moment of the request and kept nowhere else.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol

from quipu.engine.base import Completion
from quipu.errors import CapabilityError, QuipuError

RETRY_STATUSES = (429, 502, 503, 504)
# llama-server's timings (milliseconds), under the names quipu gives them in seconds
TIMINGS = {"prompt_ms": "prefill_s", "predicted_ms": "decode_s"}
MAX_EVENT_BYTES = 8 << 20  # the longest line of a stream of events (a token's event is a few hundred bytes)


class Sink(Protocol):
    """Where a reply's text goes as it comes, and whether to stop (the session layer's ReplySink)."""

    def text(self, piece: str) -> None: ...
    def stopped(self) -> bool: ...


class ServerError(QuipuError):
    """The server could not be used, or failed mid-reply (`partial` holds what came first)."""

    def __init__(self, message: str, *, partial: "ChatReply | Completion | None" = None, status: int = 0):
        super().__init__(message)
        self.partial = partial
        self.status = status  # the HTTP status that said no, if one did


@dataclass
class ServerSettings:
    url: str
    model: str | None = None  # None: the server's only (or first) model
    api_key_env: str = "QUIPU_API_KEY"
    connect_timeout: float = 10.0
    read_timeout: float = 600.0  # the longest wait for the next event: a long prompt is read first
    retries: int = 3
    backoff: float = 0.5  # seconds before the first retry, doubled each time


@dataclass
class ChatReply:
    """One reply: its text, why it ended, and what the server counted and timed."""

    text: str = ""
    finish_reason: str = ""  # stop, length, interrupted, or the server's own word
    model: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)  # the server's, in seconds
    first_token_s: float = 0.0  # from the request's start, as measured here
    total_s: float = 0.0
    # The calls the reply made, as streamed: [{"id", "name", "arguments": the JSON text}].
    tool_calls: list[dict[str, str]] = field(default_factory=list)


class ChatApiModel:
    """A model on an OpenAI-compatible server."""

    def __init__(self, settings: ServerSettings):
        import httpx

        self.settings = settings
        self.base = settings.url.rstrip("/")
        if not self.base.startswith(("http://", "https://")):
            raise ServerError(f"the server address must start with http:// or https://, not '{settings.url}'")
        self._httpx = httpx
        self._client = self._connect()
        self._model = settings.model
        self._props: dict | None = None

    def _connect(self):
        httpx, settings = self._httpx, self.settings
        return httpx.Client(timeout=httpx.Timeout(settings.read_timeout, connect=settings.connect_timeout),
                            follow_redirects=True)

    def close(self) -> None:
        """Lets the connections go; a later request opens new ones."""
        self._client.close()

    def __enter__(self) -> "ChatApiModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- requests --------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        key = os.environ.get(self.settings.api_key_env)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def where(self) -> str:
        return f"the server at {self.base}"

    def request(self, method: str, path: str, body: dict | None = None, *, stream: bool = False):
        """The response (opened for streaming when asked), after the retries a failure may earn."""
        httpx = self._httpx
        pause = self.settings.backoff
        if self._client.is_closed:
            self._client = self._connect()
        for attempt in range(self.settings.retries + 1):
            last = attempt == self.settings.retries
            try:
                request = self._client.build_request(method, self.base + path, json=body, headers=self._headers())
                response = self._client.send(request, stream=stream)
            except httpx.ConnectError as exc:
                if last or "Name or service not known" in str(exc) or "nodename nor servname" in str(exc):
                    raise ServerError(f"cannot reach {self.where()}: {_reason(exc)}") from None
            except httpx.ConnectTimeout:
                raise ServerError(f"{self.where()} did not take the connection within "
                                  f"{self.settings.connect_timeout:g} s") from None
            except httpx.TimeoutException:
                raise ServerError(f"{self.where()} did not answer within {self._timeout_said()}") from None
            except httpx.HTTPError as exc:
                raise ServerError(f"the request to {self.where()} failed: {_reason(exc)}") from None
            else:
                if response.status_code < 400:
                    return response
                if last or response.status_code not in RETRY_STATUSES:
                    raise self._http_error(response)
                response.close()
            time.sleep(pause)
            pause *= 2
        raise AssertionError("unreachable")

    def _timeout_said(self) -> str:
        return f"{self.settings.read_timeout:g} s"

    def _http_error(self, response) -> ServerError:
        try:
            response.read()
            body = response.json()
        except Exception:  # a body that is not JSON (a proxy's page): its start is the message
            body = response.text[:200] if hasattr(response, "text") else ""
        finally:
            response.close()
        said = _server_message(body)
        code = response.status_code
        status = f"{code} {response.reason_phrase}".strip()
        if code in (401, 403):
            held = self.settings.api_key_env
            key = "the key in $" + held if os.environ.get(held) else f"no key (set ${held})"
            return ServerError(f"{self.where()} refused the request ({status}) with {key}"
                               f"{': ' + said if said else ''}", status=code)
        if code == 404:
            return ServerError(f"{self.where()} has no such model or endpoint ({status})"
                               f"{': ' + said if said else ''}", status=code)
        return ServerError(f"{self.where()} answered {status}{': ' + said if said else ''}", status=code)

    def request_json(self, method: str, path: str, body: dict | None = None) -> Any:
        response = self.request(method, path, body)
        try:
            return response.json()
        except ValueError:
            raise ServerError(f"{self.where()} did not answer {path} with JSON") from None

    # ---- what the server has --------------------------------------------------------------

    def models(self) -> list[dict]:
        """The server's models (`/v1/models`): each with at least an `id`."""
        data = self.request_json("GET", "/v1/models")
        items = data.get("data") if isinstance(data, dict) else None
        if not isinstance(items, list):
            raise ServerError(f"{self.where()} answered /v1/models with something else than a model list")
        return [m for m in items if isinstance(m, dict) and isinstance(m.get("id"), str)]

    def model_name(self) -> str:
        """The model asked for, else the server's first."""
        if self._model is None:
            models = self.models()
            if not models:
                raise ServerError(f"{self.where()} lists no model")
            self._model = models[0]["id"]
        return self._model

    # ---- llama.cpp's llama-server: slots whose context can be saved to a file and restored ----

    def props(self) -> dict | None:
        """llama.cpp's llama-server's `/props` (its slots, context, chat template, special tokens);
        None for any other server."""
        if self._props is None:
            try:
                props = self.request_json("GET", "/props")
            except ServerError:
                props = None
            ok = isinstance(props, dict) and isinstance(props.get("default_generation_settings"), dict)
            self._props = props if ok else {}
        return self._props or None

    def slots(self) -> int:
        """How many slots the server has when it is llama.cpp's llama-server; 0 for any other."""
        total = (self.props() or {}).get("total_slots")
        return total if isinstance(total, int) and total > 0 else 0

    def slot_look(self, slot: int) -> tuple | None:
        """What tells a slot's context changed (its last task, its prompt's size); None when the
        server does not say (`/slots` turned off)."""
        try:
            data = self.request_json("GET", "/slots")
        except ServerError:
            return None
        for item in data if isinstance(data, list) else ():
            if isinstance(item, dict) and item.get("id") == slot and item.get("id_task") is not None:
                return item.get("id_task"), item.get("n_prompt_tokens")
        return None

    def slot_file(self, slot: int, action: str, filename: str) -> int:
        """Saves a slot's context to `filename` (in the server's --slot-save-path) or restores it;
        the number of tokens saved or restored."""
        data = self.request_json("POST", f"/slots/{slot}?action={action}", {"filename": filename})
        count = data.get("n_saved" if action == "save" else "n_restored") if isinstance(data, dict) else None
        if not isinstance(count, int):
            raise ServerError(f"{self.where()} answered a slot {action} with something unexpected")
        return count

    def embed(self, texts: list[str]) -> list[list[float]]:
        """One vector per text (`/v1/embeddings`), pooled as the server was started to pool."""
        data = self.request_json("POST", "/v1/embeddings", {"model": self.model_name(), "input": list(texts)})
        items = data.get("data") if isinstance(data, dict) else None
        if not isinstance(items, list) or len(items) != len(texts):
            raise ServerError(f"{self.where()} answered /v1/embeddings with something else than one vector a text")
        ordered = sorted(items, key=lambda item: item.get("index", 0) if isinstance(item, dict) else 0)
        vectors = [item.get("embedding") if isinstance(item, dict) else None for item in ordered]
        usable = [[float(x) for x in v] for v in vectors
                  if isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v)]
        if len(usable) != len(vectors):
            raise CapabilityError(f"{self.where()} gave no usable embeddings (was it started with embeddings on?)")
        return usable

    # ---- generation -----------------------------------------------------------------------

    def chat(self, messages: list[dict[str, Any]], *, params: dict[str, Any], max_tokens: int,
             stop: tuple[str, ...] = (), sink: Sink | None = None, tools: list[dict] | None = None,
             tool_choice: Any = None) -> ChatReply:
        """Streams a reply to `messages` into `sink`, which may stop it; with `tools` (OpenAI's
        shape) the reply may call them (`ChatReply.tool_calls`)."""
        # No model named: most servers with one model take any name, so ask at once; a server that
        # wants a real one says so, and gets its first (one round trip spared in the common case).
        body = {"model": self._model or "", "messages": messages, "stream": True, "max_tokens": max_tokens,
                "stream_options": {"include_usage": True}, **params}
        if stop:
            body["stop"] = list(stop)
        if tools:
            body["tools"] = tools
            if tool_choice is not None:
                body["tool_choice"] = tool_choice
        started = time.perf_counter()
        try:
            response = self.request("POST", "/v1/chat/completions", body, stream=True)
        except ServerError as exc:
            if self._model is not None or exc.status not in (400, 404, 422):
                raise
            body["model"] = self.model_name()
            response = self.request("POST", "/v1/chat/completions", body, stream=True)
        reply = ChatReply(model=body["model"])
        pieces: list[str] = []
        try:
            for event in self._events(response, reply, pieces):
                self._take(event, reply, pieces, started, sink)
                if reply.finish_reason == "interrupted":
                    break
        finally:
            response.close()
            reply.text = "".join(pieces)
            reply.total_s = time.perf_counter() - started
        if not reply.completion_tokens:  # no usage in the stream (llama-cpp-python's server): a piece a token
            reply.completion_tokens = len(pieces)
        if not reply.model:  # the server echoed the empty name: ask it for its own, now that the reply is out
            try:
                reply.model = self.model_name()
            except ServerError:
                reply.model = "?"
        return reply

    def _events(self, response, reply: ChatReply, pieces: list[str]) -> Iterator[dict]:
        def partial() -> ChatReply:
            reply.text = "".join(pieces)
            return reply

        yield from self.events(response, partial, lambda event: False)
        reply.finish_reason = reply.finish_reason or "stop"

    def events(self, response, partial: Callable[[], Any], last: Callable[[dict], bool]) -> Iterator[dict]:
        """The JSON objects of a stream of server-sent events, to `[DONE]` or an event `last` says
        is the last. Every fault is a ServerError carrying `partial()`, what came before it."""
        httpx = self._httpx
        finished = False
        try:
            for line in self._lines(response, partial):
                if not line.startswith("data:"):
                    continue  # comments (pings), event names, blank separators
                data = line[5:].strip()
                if data == "[DONE]":
                    finished = True
                    break
                try:
                    event = json.loads(data)
                except ValueError:
                    raise ServerError(f"{self.where()} sent an event that is not JSON: {data[:80]!r}",
                                      partial=partial()) from None
                if not isinstance(event, dict):
                    raise ServerError(f"{self.where()} sent an event that is not an object", partial=partial())
                if "error" in event:
                    raise ServerError(f"{self.where()} failed mid-reply: {_server_message(event)}",
                                      partial=partial())
                yield event
                if last(event):
                    finished = True
                    break
        except httpx.TimeoutException:
            raise ServerError(f"{self.where()} sent nothing for {self._timeout_said()} mid-reply",
                              partial=partial()) from None
        except httpx.HTTPError as exc:
            raise ServerError(f"{self.where()} cut the reply short: {_reason(exc)}", partial=partial()) from None
        if not finished and not getattr(partial(), "finish_reason", ""):
            raise ServerError(f"{self.where()} closed the stream before the reply was over", partial=partial())

    def _lines(self, response, partial: Callable[[], Any]) -> Iterator[str]:
        """The stream's lines, each held only up to MAX_EVENT_BYTES: a server that never ends a
        line is an error, not a process that grows until it is killed."""
        held = b""
        for chunk in response.iter_bytes():
            held += chunk
            start = 0
            while (end := held.find(b"\n", start)) >= 0:
                yield held[start:end].rstrip(b"\r").decode("utf-8", "replace")
                start = end + 1
            held = held[start:]
            if len(held) > MAX_EVENT_BYTES:
                raise ServerError(f"{self.where()} sent an event longer than {MAX_EVENT_BYTES >> 20} MB",
                                  partial=partial())
        if held:
            yield held.rstrip(b"\r").decode("utf-8", "replace")

    def _take(self, event: dict, reply: ChatReply, pieces: list[str], started: float, sink: Sink | None) -> None:
        if isinstance(event.get("model"), str) and event["model"]:
            reply.model = event["model"]  # the name the server answers to
        usage = event.get("usage")
        if isinstance(usage, dict):
            reply.prompt_tokens = count_of(usage.get("prompt_tokens"))
            reply.completion_tokens = count_of(usage.get("completion_tokens"))
            details = usage.get("prompt_tokens_details") or {}
            reply.cached_tokens = count_of(details.get("cached_tokens")) if isinstance(details, dict) else 0
        timings = event.get("timings")  # llama-server's own figures, in milliseconds
        if isinstance(timings, dict):
            reply.timings = {ours: float(timings[theirs]) / 1000 for theirs, ours in TIMINGS.items()
                             if isinstance(timings.get(theirs), (int, float))}
            if "cache_n" in timings and not reply.cached_tokens:
                reply.cached_tokens = count_of(timings["cache_n"])
        choices = event.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta") or {}
            text = delta.get("content") if isinstance(delta, dict) else None
            if text is not None and not isinstance(text, str):
                reply.text = "".join(pieces)
                raise ServerError(f"{self.where()} sent a reply piece that is not text ({type(text).__name__})",
                                  partial=reply)
            if text:
                if not pieces:
                    reply.first_token_s = time.perf_counter() - started
                pieces.append(text)
                if sink is not None:
                    sink.text(text)
                if sink is not None and sink.stopped():
                    reply.finish_reason = "interrupted"
                    return
            calls = delta.get("tool_calls") if isinstance(delta, dict) else None
            for call in calls if isinstance(calls, list) else ():
                self._take_call(call, reply)
            finish = choice.get("finish_reason")
            if finish and isinstance(finish, str):
                reply.finish_reason = {"stop": "stop", "length": "length"}.get(finish, finish)

    def _take_call(self, call: Any, reply: ChatReply) -> None:
        """A piece of a streamed call: its index says which call; name and arguments come in parts."""
        if not isinstance(call, dict):
            raise ServerError(f"{self.where()} sent a tool call that is not an object", partial=reply)
        index = call.get("index", len(reply.tool_calls))
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= len(reply.tool_calls):
            raise ServerError(f"{self.where()} sent a tool call out of order", partial=reply)
        if index == len(reply.tool_calls):
            reply.tool_calls.append({"id": "", "name": "", "arguments": ""})
        held = reply.tool_calls[index]
        fn = call.get("function") or {}
        if isinstance(call.get("id"), str):
            held["id"] = call["id"]
        if isinstance(fn, dict):
            name = fn.get("name")
            if isinstance(name, str) and name != held["name"]:  # (some servers repeat the whole name each piece)
                held["name"] += name
            if isinstance(fn.get("arguments"), str):
                held["arguments"] += fn["arguments"]
            if len(held["arguments"]) > MAX_EVENT_BYTES:
                raise ServerError(f"{self.where()} sent a tool call longer than {MAX_EVENT_BYTES >> 20} MB",
                                  partial=reply)


def count_of(value: Any) -> int:
    """A count a server reported; what is not one counts as nothing (the figures are the server's)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _server_message(body: Any) -> str:
    """The message a server put in its error body (OpenAI's shape, and a few others)."""
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict):
            message = error.get("message") or error.get("detail") or ""
            return str(message)[:300]
        if isinstance(error, str):
            return error[:300]
        if "detail" in body:
            return str(body["detail"])[:300]
    if isinstance(body, str):
        return body.strip()[:200]
    return ""


def _reason(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    if "Connection refused" in text or "Errno 111" in text:
        return "connection refused"
    if "Name or service not known" in text or "nodename nor servname" in text or "Temporary failure in name" in text:
        return "the host name does not resolve"
    return text.splitlines()[0][:200]
