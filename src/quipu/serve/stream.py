"""A request's reply as events, whole or streamed: its turns run on a thread of their own (one
after the other for `n` answers), and their events reach the event loop through a bounded queue
(`Reply`): a client that reads slowly holds its turn back, one that goes away (or a server that
stops) ends it at its next token. The events made the OpenAI API's server-sent events and
Ollama's JSON lines (`openai_stream`, `ollama_stream`)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from functools import partial
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Sequence

from quipu.sessions.base import ReplySink

if TYPE_CHECKING:
    from quipu.app.answer import Answer
    from quipu.sessions.base import Message
    from quipu.serve.plan import ChatRequest
    from quipu.serve.pool import Pool

QUEUED = 256  # events a reply may have made that its client has not taken yet
SLOW_S = 60.0  # how long a reply waits for a client that takes none of them before it counts as gone
FIRST_S = 1.0  # how long a stream's head waits for its turn to begin (a refusal is then a 4xx) before it goes
PING_S = 5.0  # how often a stream with nothing to say (its prompt read, its turn awaited) says it is alive
PROGRESS_S = 30.0  # how often the server's log says how far a long prompt's reading has come
# A stream's word that it is alive, where its API has no event for it: a comment of server-sent events,
# which every client's reader passes over.
ALIVE = ": reading\n\n"

# (kind, which answer, value): prompt (its tokens and those restored: its reading begins), content,
# reasoning_content, logprobs, done, error
Event = tuple[str, int, Any]
Kept = Callable[["Answer", Sequence["Message"]], None]  # what keeps a reply once its turn is kept (an API's)


class Reply:
    """The events of a request's answers (`plan`'s `choices`) as they come, on a thread of
    their own: ("content" | "reasoning_content", index, piece), ("logprobs", index, entries), then
    ("done", index, answer) for each, or ("error", index, what failed) and no more."""

    def __init__(self, pool: Pool, plan: ChatRequest, ident: str, ended: Callable[[], None] = lambda: None,
                 kept: Kept | None = None, shown: dict[str, Any] | None = None):
        from quipu.serve.plan import choices

        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.room = threading.Semaphore(QUEUED)
        self.gone = threading.Event()  # the client went away, or the reply is over
        self.delivered = threading.Event()  # the client has the whole reply (`sent`)
        self.settled = threading.Event()  # delivered, or never to be
        self.handed: set[int] = set()  # the answers given out before their turn ended (`took`)
        self.answers: list[Answer] = []  # those made so far (what the server's log says of the request)
        self.taken = threading.Event()  # its turn has begun: it waits for no other request
        self.pool, self.plans, self.ident, self.ended, self.kept = pool, choices(plan), ident, ended, kept
        # (kept, or not, once its turn is over; `shown` meanwhile, to a request for it)
        self.over = pool.keeping(ident, shown) if kept is not None else lambda: None
        threading.Thread(target=self._work, name="quipu-serve-reply", daemon=True).start()

    def stopped(self) -> bool:
        return self.gone.is_set() or self.pool.stopping.is_set()

    def _put(self, event: Event) -> None:
        while not self.room.acquire(timeout=SLOW_S):  # (a client that reads slowly holds the reply back)
            if self.stopped():
                return
            self.gone.set()  # (nothing taken for a minute: the client is as good as gone)
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def _work(self) -> None:
        try:
            self._answers()
        finally:
            self.over()
            self.ended()

    def _answers(self) -> None:
        reply = self

        class Streamed(ReplySink):
            def __init__(self, index: int):
                self.index, self.said = index, time.monotonic()

            def text(self, piece: str) -> None:
                reply._put(("content", self.index, piece))

            def reasoning(self, piece: str) -> None:
                reply._put(("reasoning_content", self.index, piece))

            def logprobs(self, entries: list[dict[str, Any]]) -> None:
                reply._put(("logprobs", self.index, entries))

            def begins(self, prompt_tokens: int, cached_tokens: int) -> None:
                self.said = time.monotonic()
                reply._put(("prompt", self.index, (prompt_tokens, cached_tokens)))

            def progress(self, done: int, total: int) -> None:
                if time.monotonic() - self.said >= PROGRESS_S:  # (a long read, said as it goes)
                    self.said = time.monotonic()
                    reply.pool.say(f"{reply.ident}: {done:,} of {total:,} prompt tokens read")

            def stopped(self) -> bool:
                return reply.stopped()

        for index, each in enumerate(self.plans):
            try:
                answer = self.pool.chat(each, Streamed(index), self.ident, partial(self.took, index), self.kept,
                                        self.taken.set)
            except Exception as exc:  # (said as an event: the HTTP side shapes it)
                self.loop.call_soon_threadsafe(self.events.put_nowait, ("error", index, exc))
                return
            if index not in self.handed:
                self.answers.append(answer)
                self.loop.call_soon_threadsafe(self.events.put_nowait, ("done", index, answer))
            if self.stopped():
                return

    def took(self, index: int, answer: Answer) -> bool:
        """Gives answer `index` out before its turn ends (a session's, kept only when this says
        so), and waits until the client has the whole reply, or has gone: whether it has it, and
        it is the whole answer (not one cut as the client went or the server stopped)."""
        self.handed.add(index)
        self.answers.append(answer)
        self.loop.call_soon_threadsafe(self.events.put_nowait, ("done", index, answer))
        self.settled.wait(SLOW_S)
        return self.delivered.is_set() and answer.finish_reason != "interrupted"

    def sent(self) -> None:
        """The whole reply is out to its client (unless it went first)."""
        if not self.gone.is_set():
            self.delivered.set()
            self.pool.delivered(self.ident)
        self.settled.set()

    async def next(self) -> Event:
        event = await self.events.get()
        if event[0] not in ("done", "error"):
            self.room.release()
        return event

    async def first(self) -> Event | None:
        """The first event, once its turn has begun and laid its prompt out (or failed); None
        where its turn has not begun within `FIRST_S` (it waits for other requests)."""
        while True:
            event = await self.within(FIRST_S)
            if event is not None or not self.taken.is_set():
                return event

    async def within(self, seconds: float) -> Event | None:
        """The next event, or None where none comes within `seconds`."""
        try:
            return await asyncio.wait_for(self.next(), seconds)
        except TimeoutError:
            return None

    async def whole(self) -> list[Answer]:
        """Every answer, once done (the pieces let by); what failed raised."""
        answers: list[Answer] = []
        while len(answers) < len(self.plans):
            kind, _, value = await self.next()
            if kind == "error":
                raise value
            if kind == "done":
                answers.append(value)
        return answers

    def close(self) -> None:
        self.gone.set()
        self.settled.set()


async def openai_stream(reply: Reply, first: Event | None, plan: ChatRequest, head: dict[str, Any], plain: bool
                        ) -> AsyncIterator[str]:
    """A chat completion (or, `plain`, a completion) as server-sent events, each piece as it
    comes with its tokens' log probabilities where asked; the calls a reply ends with as one
    delta; the usage last where the request asked for it."""
    from quipu.serve.wire import FINISH, error_body, openai_calls, text_logprobs
    from quipu.serve.wire import usage as usage_of

    options = head["body"].get("stream_options")
    usage = isinstance(options, dict) and options.get("include_usage") is True

    def chunk(choices: list[dict[str, Any]], **more: Any) -> str:
        return "data: " + json.dumps({"id": head["ident"], "object": "text_completion" if plain else
                                      "chat.completion.chunk", "created": head["created"], "model": plan.model,
                                      "choices": choices, **more}) + "\n\n"

    def choice(index: int, piece: dict[str, Any], finish: str | None = None, entries: Any = None
               ) -> list[dict[str, Any]]:
        if plain:
            logprobs = text_logprobs(entries) if entries is not None else None
            return [{"index": index, "text": piece.get("content", ""), "logprobs": logprobs, "finish_reason": finish}]
        return [{"index": index, "delta": piece, "finish_reason": finish,
                 "logprobs": {"content": entries} if entries is not None else None}]

    answers: list[Answer] = []
    none: list[Any] | None = [] if plan.logprobs is not None else None  # (asked for: each piece carries a list)
    entries = none  # log probabilities given with no piece yet
    event, began = first, set()
    try:
        while True:
            if event is None:  # (nothing yet: its turn awaited, or its prompt read)
                yield ALIVE
                event = await reply.within(PING_S)
                continue
            kind, index, value = event
            if not plain and index not in began and kind != "error":
                began.add(index)
                yield chunk(choice(index, {"role": "assistant", "content": None}))
            if kind == "prompt":
                pass
            elif kind == "logprobs":
                entries = (entries or []) + value
            elif kind == "done":
                answer: Answer = value
                answers.append(answer)
                calls = [] if plain else openai_calls(answer, streamed=True)
                if calls:
                    yield chunk(choice(index, {"tool_calls": calls}))
                yield chunk(choice(index, {}, FINISH.get(answer.finish_reason, "stop"), entries))
                entries = none
                if len(answers) == len(reply.plans):
                    break
            elif kind == "error":
                yield "data: " + json.dumps(error_body(value)[1]) + "\n\n"
                break
            else:
                yield chunk(choice(index, {kind: value}, entries=entries))
                entries = none
            event = await reply.within(PING_S)
        if usage and answers:
            yield chunk([], usage=usage_of(answers))
        yield "data: [DONE]\n\n"
        reply.sent()  # (resumed once the last chunk is out)
    finally:
        reply.close()  # (the client went away, or the reply is over)


async def ollama_stream(reply: Reply, first: Event | None, plan: ChatRequest, head: dict[str, Any], generate: bool
                        ) -> AsyncIterator[str]:
    """An Ollama-style reply as JSON lines, each piece as it comes, the calls it ends with on a
    line of their own, then its end and figures."""
    from quipu.serve.wire import ollama_error, ollama_piece, ollama_reply, waiting_calls

    created = head["created_at"]
    event = first
    try:
        while True:
            if event is None:  # (its turn awaited: JSON lines have no comment to say it is alive)
                event = await reply.next()
                continue
            kind, _, value = event
            if kind == "done":
                calls = waiting_calls(value)
                if calls:
                    yield json.dumps(ollama_piece(plan.model, created, "", generate=generate, calls=calls)) + "\n"
                piece = ollama_piece(plan.model, created, "", generate=generate)
                yield json.dumps({**piece, **ollama_reply(value, created)}) + "\n"
                reply.sent()  # (resumed once the last line is out)
                break
            if kind == "error":
                yield json.dumps(ollama_error(value)[1]) + "\n"
                break
            if kind in ("content", "reasoning_content"):
                text, reasoning = (value, "") if kind == "content" else ("", value)
                yield json.dumps(ollama_piece(plan.model, created, text, reasoning, generate=generate)) + "\n"
            event = await reply.next()
    finally:
        reply.close()
