"""The APIs a model answers through, one class each: how a request of it is read (`make`, into
the one plan, `plan.ChatRequest`), whether its reply streams, and its reply and failures in its
own shape, whole or as its stream: OpenAI's chat completions and completions, Ollama's chat and
generate, Anthropic's Messages, OpenAI's Responses. The HTTP side (`http.py`) runs every one of
them the same way."""

from __future__ import annotations

import secrets
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, AsyncIterator, Mapping

if TYPE_CHECKING:
    from quipu.app.answer import Answer
    from quipu.app.turn_options import TurnOptions
    from quipu.serve.plan import ChatRequest
    from quipu.serve.pool import Pool
    from quipu.serve.stream import Event, Kept, Reply


class Api:
    """OpenAI's chat completions (`plain`: its completions, a prompt continued as it is)."""

    media_type = "text/event-stream"
    any_model = False  # a model name the server does not know is answered by its default (agents' APIs)

    def __init__(self, plain: bool = False):
        self.plain = plain

    def make(self, body: Mapping[str, Any], base: TurnOptions) -> ChatRequest:
        from quipu.serve.plan import chat_request, completion_request

        return (completion_request if self.plain else chat_request)(body, base)

    def error(self, exc: BaseException) -> tuple[int, dict[str, Any]]:
        from quipu.serve.wire import error_body

        return error_body(exc)

    def streams(self, body: Mapping[str, Any]) -> bool:
        return body.get("stream") is True

    def head(self) -> dict[str, Any]:
        return {"ident": f"{'cmpl' if self.plain else 'chatcmpl'}-{secrets.token_hex(12)}",
                "created": int(time.time())}

    def whole(self, answers: list[Answer], head: dict[str, Any], plan: ChatRequest) -> dict[str, Any]:
        from quipu.serve import wire

        return (wire.text_completion if self.plain else wire.chat_completion)(answers, head["ident"], head["created"])

    def stream(self, reply: Reply, first: Event | None, plan: ChatRequest, head: dict[str, Any]) -> AsyncIterator[str]:
        from quipu.serve.stream import openai_stream

        return openai_stream(reply, first, plan, head, plain=self.plain)

    def plan(self, pool: Pool, body: Mapping[str, Any], session: str | None, head: dict[str, Any]) -> ChatRequest:
        """What a request asks, checked before anything is loaded (`session`: its X-Quipu-Session)."""
        from quipu.serve.plan import as_session_turn

        return as_session_turn(pool.plan(body, self.make, self.any_model), session)

    def kept(self, pool: Pool, plan: ChatRequest, head: dict[str, Any]) -> Kept | None:
        """What keeps the reply once its turn is kept, where the API keeps replies."""
        return None

    def shown(self, plan: ChatRequest, head: dict[str, Any]) -> dict[str, Any] | None:
        """What a reply the API keeps is while it is made (a request for it meanwhile is given it)."""
        return None


class Ollama(Api):
    """Ollama's chat (`generate`: its generate, a prompt and a system prompt)."""

    media_type = "application/x-ndjson"

    def __init__(self, generate: bool = False):
        super().__init__()
        self.generate = generate

    def make(self, body: Mapping[str, Any], base: TurnOptions) -> ChatRequest:
        from quipu.serve.plan import ollama_request

        return ollama_request(body, base, generate=self.generate)

    def error(self, exc: BaseException) -> tuple[int, dict[str, Any]]:
        from quipu.serve.wire import ollama_error

        return ollama_error(exc)

    def streams(self, body: Mapping[str, Any]) -> bool:
        return body.get("stream", True) is not False  # (Ollama's stream unless told not to)

    def head(self) -> dict[str, Any]:
        return {"created_at": datetime.now(timezone.utc).isoformat(), "ident": f"req-{secrets.token_hex(6)}"}

    def whole(self, answers: list[Answer], head: dict[str, Any], plan: ChatRequest) -> dict[str, Any]:
        from quipu.serve import wire

        [answer] = answers  # (Ollama's API asks for one)
        piece = wire.ollama_piece(answer.model, head["created_at"], answer.text, answer.reasoning,
                                  generate=self.generate, calls=wire.waiting_calls(answer))
        return {**piece, **wire.ollama_reply(answer, head["created_at"])}

    def stream(self, reply: Reply, first: Event | None, plan: ChatRequest, head: dict[str, Any]) -> AsyncIterator[str]:
        from quipu.serve.stream import ollama_stream

        return ollama_stream(reply, first, plan, head, generate=self.generate)


class Messages(Api):
    """Anthropic's Messages API."""

    any_model = True

    def make(self, body: Mapping[str, Any], base: TurnOptions) -> ChatRequest:
        from quipu.serve.anthropic import messages_request

        return messages_request(body, base)

    def error(self, exc: BaseException) -> tuple[int, dict[str, Any]]:
        from quipu.serve.anthropic import error_body

        return error_body(exc)

    def head(self) -> dict[str, Any]:
        return {"ident": f"msg_{secrets.token_hex(12)}", "created": int(time.time())}

    def whole(self, answers: list[Answer], head: dict[str, Any], plan: ChatRequest) -> dict[str, Any]:
        from quipu.serve.anthropic import message

        return message(answers[0], head["ident"])

    def stream(self, reply: Reply, first: Event | None, plan: ChatRequest, head: dict[str, Any]) -> AsyncIterator[str]:
        from quipu.serve.anthropic import message_stream

        return message_stream(reply, first, plan, head)


class Responses(Api):
    """OpenAI's Responses API: a response kept (`store`) is a turn of the session its
    conversation goes on in (`plan.ChatRequest.session`)."""

    any_model = True

    def plan(self, pool: Pool, body: Mapping[str, Any], session: str | None, head: dict[str, Any]) -> ChatRequest:
        """A request read with the kept response it goes on from (`previous_response_id`, waited
        for while its turn is being kept); kept (`store`), a turn of that response's session, or
        of a new one named by this response."""
        import dataclasses

        from quipu.app.responses import following, kept_response
        from quipu.serve.plan import RequestError
        from quipu.serve.responses import responses_request

        if session is not None:
            raise RequestError("X-Quipu-Session: a Responses request goes on from a response (previous_response_id)")
        previous_id, store = body.get("previous_response_id"), body.get("store", True)
        previous = None
        if previous_id is not None:
            if not isinstance(previous_id, str):
                raise RequestError("previous_response_id must be a response's id")
            pool.kept_wait(previous_id)
            previous = kept_response(pool.env, previous_id)
            if previous is None:
                raise RequestError(f"previous_response_id: no response '{previous_id[:80]}' is kept here", 404,
                                   "previous_response_not_found")
        asked = pool.plan(body, lambda given, base: responses_request(given, base, previous), self.any_model)
        if asked.media and (store or previous is not None):
            raise RequestError("input: a kept conversation takes no images yet (send store: false, and no "
                               "previous_response_id)")
        if not store:  # (a response not stored is kept nowhere: not in the log of answers either)
            asked = dataclasses.replace(asked, opts=dataclasses.replace(asked.opts, no_log=True))
        # (each turn answered as the whole conversation read at once, as the chat API answers it)
        if previous is not None:
            return dataclasses.replace(asked, session=previous.session, unkept=not store, whole_read=True,
                                       follows=following(previous, body.get("instructions")))
        return dataclasses.replace(asked, session=head["ident"], whole_read=True) if store else asked

    def head(self) -> dict[str, Any]:
        return {"ident": f"resp_{secrets.token_hex(24)}", "created": int(time.time())}

    def whole(self, answers: list[Answer], head: dict[str, Any], plan: ChatRequest) -> dict[str, Any]:
        from quipu.serve.responses import response

        return response(head, plan.model, answers[0])

    def stream(self, reply: Reply, first: Event | None, plan: ChatRequest, head: dict[str, Any]) -> AsyncIterator[str]:
        from quipu.serve.responses import response_stream

        return response_stream(reply, first, plan, head)

    def kept(self, pool: Pool, plan: ChatRequest, head: dict[str, Any]) -> Kept | None:
        from quipu.serve.responses import kept_by

        if plan.session is None or not head["body"].get("store", True):
            return None
        return kept_by(pool.env, head, plan.model, head["body"].get("input"), plan.session)

    def shown(self, plan: ChatRequest, head: dict[str, Any]) -> dict[str, Any] | None:
        from quipu.serve.responses import response

        return response(head, plan.model, None)


def apis() -> dict[str, Api]:
    """The routes that answer, by path."""
    return {"/v1/chat/completions": Api(), "/v1/completions": Api(plain=True), "/api/chat": Ollama(),
            "/api/generate": Ollama(generate=True), "/v1/messages": Messages(), "/v1/responses": Responses()}
