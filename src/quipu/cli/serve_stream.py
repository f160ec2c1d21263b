"""`quipu serve`'s replies streamed: the events of a reply as its turn makes them (on a thread of
its own, which a client that goes away stops at its next token), as the OpenAI API's server-sent
events and as Ollama's JSON lines."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import TYPE_CHECKING, Any, AsyncIterator

if TYPE_CHECKING:
    from quipu.app.answer import Answer
    from quipu.app.serve import Served
    from quipu.app.serve_plan import ChatRequest


async def events(served: Served, plan: ChatRequest) -> AsyncIterator[tuple[str, Any]]:
    """A reply's events as they come: ("content", piece), ("reasoning_content", piece), then
    ("done", its answer) or ("error", what failed); a client that goes away stops the reply at its
    next token."""
    from quipu.app.serve import ReplySink

    loop = asyncio.get_running_loop()
    pieces: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    gone = threading.Event()

    class Streamed(ReplySink):
        def text(self, piece: str) -> None:
            loop.call_soon_threadsafe(pieces.put_nowait, ("content", piece))

        def reasoning(self, piece: str) -> None:
            loop.call_soon_threadsafe(pieces.put_nowait, ("reasoning_content", piece))

        def stopped(self) -> bool:
            return gone.is_set()

    def work() -> None:
        try:
            done: tuple[str, Any] = ("done", served.chat(plan, Streamed()))
        except Exception as exc:  # (said in the stream: its head is out already)
            done = ("error", exc)
        loop.call_soon_threadsafe(pieces.put_nowait, done)

    threading.Thread(target=work, name="quipu-serve-turn", daemon=True).start()
    try:
        while True:
            event = await pieces.get()
            yield event
            if event[0] in ("done", "error"):
                break
    finally:
        gone.set()  # (the client went away, or the reply is over)


async def openai_stream(served: Served, plan: ChatRequest, head: dict[str, Any], plain: bool) -> AsyncIterator[str]:
    """A chat completion (or, `plain`, a completion) as server-sent events, each piece as it comes;
    the calls a reply ends with as one delta; the usage last where the request asked for it."""
    from quipu.app.serve_bodies import FINISH, chat_logprobs, error_body, openai_calls, text_logprobs
    from quipu.app.serve_bodies import usage as usage_of
    from quipu.app.serve_plan import choices

    options = head["body"].get("stream_options")
    usage = isinstance(options, dict) and options.get("include_usage") is True

    def chunk(choices: list[dict[str, Any]], **more: Any) -> str:
        return "data: " + json.dumps({"id": head["ident"], "object": "text_completion" if plain else
                                      "chat.completion.chunk", "created": head["created"], "model": plan.model,
                                      "choices": choices, **more}) + "\n\n"

    def choice(index: int, piece: dict[str, Any], finish: str | None = None, logprobs: Any = None
               ) -> list[dict[str, Any]]:
        if plain:
            return [{"index": index, "text": piece.get("content", ""), "logprobs": logprobs, "finish_reason": finish}]
        return [{"index": index, "delta": piece, "finish_reason": finish, "logprobs": logprobs}]

    answers: list[Answer] = []
    for index, each in enumerate(choices(plan)):  # (n answers: one after the other)
        if not plain:
            yield chunk(choice(index, {"role": "assistant", "content": ""}))
        async for kind, value in events(served, each):
            if kind == "done":
                answer: Answer = value
                answers.append(answer)
                calls = [] if plain else openai_calls(answer, streamed=True)
                if calls:
                    yield chunk(choice(index, {"tool_calls": calls}))
                # (each drawn token's log probability, where asked for, comes with the end)
                logprobs = text_logprobs(answer) if plain else chat_logprobs(answer)
                yield chunk(choice(index, {}, FINISH.get(answer.finish_reason, "stop"), logprobs))
            elif kind == "error":
                yield "data: " + json.dumps(error_body(value)[1]) + "\n\n"
                yield "data: [DONE]\n\n"
                return
            else:
                yield chunk(choice(index, {kind: value}))
    if usage:
        yield chunk([], usage=usage_of(answers))
    yield "data: [DONE]\n\n"


async def ollama_stream(served: Served, plan: ChatRequest, head: dict[str, Any], generate: bool) -> AsyncIterator[str]:
    """An Ollama-style reply as JSON lines, each piece as it comes, the calls it ends with on a
    line of their own, then its end and figures."""
    from quipu.app.serve_bodies import ollama_error, ollama_piece, ollama_reply, waiting_calls

    created = head["created_at"]
    async for kind, value in events(served, plan):
        if kind == "done":
            calls = waiting_calls(value)
            if calls:
                yield json.dumps(ollama_piece(plan.model, created, "", generate=generate, calls=calls)) + "\n"
            piece = ollama_piece(plan.model, created, "", generate=generate)
            yield json.dumps({**piece, **ollama_reply(value, created)}) + "\n"
        elif kind == "error":
            yield json.dumps(ollama_error(value)[1]) + "\n"
        else:
            text, reasoning = (value, "") if kind == "content" else ("", value)
            yield json.dumps(ollama_piece(plan.model, created, text, reasoning, generate=generate)) + "\n"
