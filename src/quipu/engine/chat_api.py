"""The OpenAI chat completions API, on any server that speaks it (`ChatApiModel`): a reply
streamed as server-sent events, its tool calls, the server's counts and timings; and its
embeddings. The connection, its retries and its faults are `http.py`'s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from quipu.engine.base import UNTIL_IT_ENDS, Sink

from quipu.engine.http import MAX_EVENT_BYTES, ServerClient, ServerError, count_of
from quipu.errors import CapabilityError

# llama-server's timings (milliseconds), under the names quipu gives them in seconds
TIMINGS = {"prompt_ms": "prefill_s", "predicted_ms": "decode_s"}


@dataclass(frozen=True)
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
    # The calls the reply made, as streamed: [{"id", "name", "arguments": the JSON text}].
    tool_calls: list[dict[str, str]] = field(default_factory=list)


class ChatApiModel(ServerClient):
    """A model on a server that speaks the OpenAI API."""

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

    def chat(self, messages: list[dict[str, Any]], *, params: dict[str, Any], max_tokens: int,
             stop: tuple[str, ...] = (), sink: Sink | None = None, tools: list[dict[str, Any]] | None = None,
             tool_choice: Any = None) -> ChatReply:
        """Streams a reply to `messages` into `sink`, which may stop it; with `tools` (OpenAI's
        shape) the reply may call them (`ChatReply.tool_calls`)."""
        # No model named: most servers with one model take any name, so ask at once; a server that
        # wants a real one says so, and gets its first (one round trip spared in the common case).
        body = {"model": self._model or "", "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}, **params}
        if max_tokens < UNTIL_IT_ENDS:  # (none: the reply ends where the server's does)
            body["max_tokens"] = max_tokens
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
        stream = ChatStream(self.where(), body["model"], started, sink)
        try:
            for event in self.events(response, stream.reply, lambda event: False):
                stream.take(event)
                if stream.finish_reason == "interrupted":
                    break
            else:
                stream.ended()
        finally:
            response.close()
        reply = stream.reply()
        if reply.model:
            return reply
        try:  # the server echoed the empty name: ask it for its own, now that the reply is out
            return replace(reply, model=self.model_name())
        except ServerError:
            return replace(reply, model="?")


class ChatStream:
    """A reply as its events come: what it holds so far, taken from each event (`take`), and
    the reply it makes (`reply`; where the stream faults, what came before the fault)."""

    def __init__(self, where: str, model: str, started: float, sink: Sink | None):
        self.where = where  # the server, as an error names it
        self.started = started
        self.sink = sink
        self.pieces: list[str] = []
        self.finish_reason = ""
        self.model = model
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0
        self.timings: dict[str, float] = {}
        self.first_token_s = 0.0
        self.tool_calls: list[dict[str, str]] = []

    def ended(self) -> None:
        """The events ended: a reply that gave no reason stopped."""
        self.finish_reason = self.finish_reason or "stop"

    def reply(self) -> ChatReply:
        return ChatReply("".join(self.pieces), self.finish_reason, self.model, self.prompt_tokens, self.cached_tokens,
                         # (no usage in the stream, llama-cpp-python's server's: a piece a token)
                         self.completion_tokens or len(self.pieces), dict(self.timings), self.first_token_s,
                         [dict(call) for call in self.tool_calls])

    def take(self, event: dict[str, Any]) -> None:
        if isinstance(event.get("model"), str) and event["model"]:
            self.model = event["model"]  # the name the server answers to
        usage = event.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = count_of(usage.get("prompt_tokens"))
            self.completion_tokens = count_of(usage.get("completion_tokens"))
            details = usage.get("prompt_tokens_details") or {}
            self.cached_tokens = count_of(details.get("cached_tokens")) if isinstance(details, dict) else 0
        timings = event.get("timings")  # llama-server's own figures, in milliseconds
        if isinstance(timings, dict):
            self.timings = {ours: float(timings[theirs]) / 1000 for theirs, ours in TIMINGS.items()
                            if isinstance(timings.get(theirs), (int, float))}
            if "cache_n" in timings and not self.cached_tokens:
                self.cached_tokens = count_of(timings["cache_n"])
        choices = event.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta") or {}
            text = delta.get("content") if isinstance(delta, dict) else None
            if text is not None and not isinstance(text, str):
                raise ServerError(f"{self.where} sent a reply piece that is not text ({type(text).__name__})",
                                  partial=self.reply())
            if text:
                if not self.pieces:
                    self.first_token_s = time.perf_counter() - self.started
                self.pieces.append(text)
                if self.sink is not None:
                    self.sink.text(text)
                if self.sink is not None and self.sink.stopped():
                    self.finish_reason = "interrupted"
                    return
            calls = delta.get("tool_calls") if isinstance(delta, dict) else None
            for call in calls if isinstance(calls, list) else ():
                self._take_call(call)
            finish = choice.get("finish_reason")
            if finish and isinstance(finish, str):
                self.finish_reason = {"stop": "stop", "length": "length"}.get(finish, finish)

    def _take_call(self, call: Any) -> None:
        """A piece of a streamed call: its index says which call; name and arguments come in parts."""
        if not isinstance(call, dict):
            raise ServerError(f"{self.where} sent a tool call that is not an object", partial=self.reply())
        index = call.get("index", len(self.tool_calls))
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= len(self.tool_calls):
            raise ServerError(f"{self.where} sent a tool call out of order", partial=self.reply())
        if index == len(self.tool_calls):
            self.tool_calls.append({"id": "", "name": "", "arguments": ""})
        held = self.tool_calls[index]
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
                raise ServerError(f"{self.where} sent a tool call longer than {MAX_EVENT_BYTES >> 20} MB",
                                  partial=self.reply())
