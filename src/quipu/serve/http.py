"""The HTTP side of `quipu serve` (Starlette on uvicorn, imported only by this command): the
routes, the checks every request passes (its Host the address served, against DNS rebinding; a
browser's page of another site refused unless `--cors` names it; the key), bodies read within a
size and a deadline, and every failure in the API's own shape (`wire.error_body`). A request to a
model is counted by the pool from its arrival to its reply's last byte; its body is read on the
loop, and everything else it costs (reading it, media, grammars, the model) runs on threads of its
own, so the loop answers `/health` whatever the others do."""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Mapping, TypeVar

from starlette.responses import Response

from quipu.serve.plan import RequestError
from quipu.serve.server import host_in_url, loopback

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request

    from quipu.serve.apis import Api, Ollama
    from quipu.serve.pool import Pool
    from quipu.serve.stream import Reply

T = TypeVar("T")
MAX_BODY = 8 << 20  # bytes of a request's body
BODY_S = 60.0  # seconds a request's body may take to come in whole
MAX_JSON_DEPTH = 64  # how deep a request's JSON may nest
LIGHT = 4  # requests no model answers (models listed, shown) read at once
# Ollama's routes that change the models on the server's machine, which a client does not do here.
NOT_SERVED = {path: f"{path}: quipu serve changes no model on its machine; there, `quipu models pull NAME` pulls one "
                    "and `quipu models rm NAME` removes one" for path in
              ("/api/pull", "/api/push", "/api/create", "/api/copy", "/api/delete", "/api/blobs")}


async def off_loop(work: Callable[..., T], *args: Any) -> T:
    """`work(*args)` on a thread of its own (not the loop's, nor a pool's that could fill: a
    request counted in by the pool has its thread), its result or its error awaited."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not done.done():
            done.set_result(result) if error is None else done.set_exception(error)

    def run() -> None:
        try:
            result = work(*args)
        except BaseException as exc:  # (handed to the awaiting request, which shapes it)
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=run, name="quipu-serve-work", daemon=True).start()
    return await done


class Door:
    """What every request passes before its route: the Host it names (the address served, unless
    a key guards the server), its Origin (a page of this server's, or one `--cors` names), the key."""

    def __init__(self, host: str, port: int, api_key: str | None, origins: list[str]):
        names = {host_in_url(host)} | ({"localhost", "127.0.0.1", "[::1]"} if loopback(host) else set())
        self.hosts = names | {f"{name}:{port}" for name in names}
        self.own = {f"http://{name}" for name in self.hosts}
        self.api_key, self.allowed = api_key, set(origins)

    def refusal(self, request: Request, errors: Errors, key: bool = True) -> Response | None:
        """A refusal of a request from another site, or without the key (`key`: the route needs
        it; as a bearer token, or Anthropic's `x-api-key`), in the shape `errors` gives."""
        if self.api_key is None and request.headers.get("host", "") not in self.hosts:
            return shaped(errors, RequestError("the Host of this request is not the address served", 403, "forbidden"))
        origin = request.headers.get("origin")
        if origin is not None and origin not in self.own and origin not in self.allowed and "*" not in self.allowed:
            return shaped(errors, RequestError("a web page of another site may not call this server (quipu serve "
                                               "--cors ORIGIN lets one)", 403, "forbidden"))
        if self.api_key is not None and key:
            given = request.headers.get("authorization", "").encode()
            other = request.headers.get("x-api-key", "").encode()
            wanted = self.api_key.encode()
            if not (hmac.compare_digest(given, b"Bearer " + wanted) | hmac.compare_digest(other, wanted)):
                return shaped(errors, RequestError("a key is needed: Authorization: Bearer KEY (or x-api-key: KEY)",
                                                   401, "invalid_api_key"))
        return None


Errors = Callable[[BaseException], "tuple[int, dict[str, Any]]"]  # a failure's status and body, in an API's shape


def openai_errors(exc: BaseException) -> tuple[int, dict[str, Any]]:
    from quipu.serve.wire import error_body

    return error_body(exc)


def ollama_errors(exc: BaseException) -> tuple[int, dict[str, Any]]:
    from quipu.serve.wire import ollama_error

    return ollama_error(exc)


def shaped(errors: Errors, exc: BaseException) -> Response:
    """A failure in an API's shape (`errors` gives it); a busy server's says when to ask again."""
    from starlette.responses import JSONResponse

    status, body = errors(exc)
    return JSONResponse(body, status, headers={"Retry-After": "1"} if status == 503 else None)


class Place:
    """A request's place in the pool, given back once its response has ended and every other
    holder (its turn's thread, which a client's going ends at its next token) is done."""

    def __init__(self, release: Callable[[], None]):
        self.release, self.holders, self.lock = release, 1, threading.Lock()

    def hold(self) -> Callable[[], None]:
        """One more holder; what it calls when it is done."""
        with self.lock:
            self.holders += 1
        return self.done

    def done(self) -> None:
        with self.lock:
            self.holders -= 1
            last = self.holders == 0
        if last:
            self.release()


async def counted(pool: Pool, errors: Errors, answer: Callable[[Place], Awaitable[Response]]) -> Response:
    """The response `answer` makes for a request counted in by the pool from now to its last byte
    (or its client's going) and its turn's end, or the pool's refusal: busy."""
    try:
        place = Place(pool.admit())
    except RequestError as exc:
        return shaped(errors, exc)
    try:
        inner = await answer(place)
    except BaseException:
        place.done()
        raise
    return Then(inner, ended=place.done)


class Then(Response):
    """A response (`inner`) sent as it is, then `sent` where it went out whole, and `ended` in any
    case (its client gone included)."""

    def __init__(self, inner: Response, sent: Callable[[], object] = lambda: None,
                 ended: Callable[[], object] = lambda: None):
        self.inner, self.sent, self.ended = inner, sent, ended

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.inner(scope, receive, send)
            self.sent()
        finally:
            self.ended()


MAX_PAGE = 100  # items a page of a response's input holds at most (OpenAI's bound)


def page_of(query: Mapping[str, str]) -> tuple[int, str, str | None]:
    """A page of a list as OpenAI's API asks one: `limit` (1 to 100, 20 by default), `order`
    (desc by default, or asc) and `after` (the id of the item it follows)."""
    limit, order, after = query.get("limit", "20"), query.get("order", "desc"), query.get("after")
    if not limit.isascii() or not limit.isdigit() or not 1 <= int(limit) <= MAX_PAGE:
        raise RequestError(f"limit must be a whole number from 1 to {MAX_PAGE}")
    if order not in ("asc", "desc"):
        raise RequestError("order must be asc or desc")
    return int(limit), order, after


class Logged:
    """The line the server's log says of a request to a model once its response has ended: its
    method and path, its status, its reply's id, the prompt's tokens (those restored among them),
    the reply's, and how long it took; a refusal's message."""

    def __init__(self, say: Callable[[str], None], request: Request):
        self.say, self.started = say, time.perf_counter()
        self.what = f"{request.method} {request.url.path}"
        self.status, self.why = 200, ""
        self.reply: Reply | None = None

    def failed(self, response: Response, exc: BaseException) -> Response:
        self.status, self.why = response.status_code, str(exc)[:200]
        return response

    def end(self) -> None:
        took = f"{time.perf_counter() - self.started:.1f} s"
        if self.why or self.reply is None:
            self.say(f"{self.what} {self.status}{': ' + self.why if self.why else ''} ({took})")
            return
        answers = self.reply.answers
        if not answers:
            self.say(f"{self.what} {self.status} {self.reply.ident}: no answer ({took})")
            return
        s = answers[0].stats
        self.say(f"{self.what} {self.status} {self.reply.ident}: {s.prompt_tokens:,} prompt tokens "
                 f"({s.cached_tokens:,} restored), {sum(a.stats.completion_tokens for a in answers):,} out, "
                 f"{answers[0].finish_reason} ({took})")


async def watch_gone(request: Request, reply: Reply) -> None:
    """Ends `reply` at its next token once the client of a whole reply goes away (its body is in:
    what comes next is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            reply.close()
            return


class Routes:
    """The routes' work, on `pool`, behind `door`."""

    def __init__(self, pool: Pool, door: Door):
        from quipu.serve.apis import apis

        self.pool, self.door, self.apis = pool, door, apis()
        # (what the routes that no model answers read, off the loop a few at a time: the others
        # wait, each on a connection the server bounds)
        self.light = asyncio.Semaphore(LIGHT)

    async def _light(self, work: Callable[..., T], *args: Any) -> T:
        async with self.light:
            return await off_loop(work, *args)

    async def health(self, request: Request) -> Response:
        from starlette.responses import JSONResponse

        # (a probe needs no key; it says how many requests the server holds, from arrival to last byte)
        return self.door.refusal(request, openai_errors, key=False) or \
            JSONResponse({"status": "ok", "requests": self.pool.requests})

    async def answer(self, request: Request) -> Response:
        """A request to a model, in any API: counted in (or refused as busy), read, planned off
        the loop, then answered whole or streamed; a stream's head goes out once its first event
        is in, so a request that cannot be answered (too long for the context, say) is a 4xx."""
        api = self.apis[request.url.path]
        logged = Logged(self.pool.say, request)
        response = self.door.refusal(request, api.error) or \
            await counted(self.pool, api.error, lambda place: self._answer(request, api, place, logged))
        if not isinstance(response, Then) and not logged.why:  # (refused at the door, or busy)
            logged.status = response.status_code
        return Then(response, ended=logged.end)

    async def _answer(self, request: Request, api: Api, place: Place, logged: Logged) -> Response:
        from starlette.responses import JSONResponse, StreamingResponse

        from quipu.serve.apis import Ollama
        from quipu.serve.plan import load_only
        from quipu.serve.stream import Reply

        try:
            body = await read_json(request)
            if isinstance(api, Ollama) and load_only(body, api.generate):
                return await self._loaded(body, api)
            head = {**api.head(), "body": body}
            plan = await off_loop(api.plan, self.pool, body, request.headers.get("x-quipu-session"), head)
        except Exception as exc:  # (every refusal a 4xx in the API's shape, never a traceback)
            return logged.failed(shaped(api.error, exc), exc)
        if plan.ignored:
            client = request.headers.get("user-agent", "a client")[:80]
            self.pool.say_once(f"{client}: {request.url.path} lets be what tunes a hosted service: "
                               f"{', '.join(plan.ignored)}")
        reply = Reply(self.pool, plan, head["ident"], place.hold(), api.kept(self.pool, plan, head),
                      api.shown(plan, head))
        logged.reply = reply
        if not api.streams(body):
            watch = asyncio.create_task(watch_gone(request, reply))  # (until it is sent: a session's turn is kept then)
            try:
                answers = await reply.whole()
            except Exception as exc:
                watch.cancel()
                return logged.failed(shaped(api.error, exc), exc)
            return Then(JSONResponse(api.whole(answers, head, plan)), sent=reply.sent, ended=watch.cancel)
        # (a stream's head goes out with its first event, the prompt laid out, so that a prompt too long is a
        # 4xx; or, where its turn waits for others, at once, and the stream says it is alive meanwhile)
        first = await reply.first()
        if first is not None and first[0] == "error":
            return logged.failed(shaped(api.error, first[2]), first[2])
        return StreamingResponse(api.stream(reply, first, plan, head), media_type=api.media_type,
                                 headers={"Cache-Control": "no-cache"})

    async def _loaded(self, body: dict[str, Any], api: Ollama) -> Response:
        """Ollama's request with nothing to answer: the model loaded (or, `keep_alive` 0, unloaded)."""
        from starlette.responses import JSONResponse

        from quipu.serve.plan import request_keep

        name, _ = await off_loop(self.pool.pick, body.get("model"))  # (it may look through the folders)
        now = await off_loop(self.pool.load, name, request_keep(body))
        reply = {"model": name, "created_at": datetime.now(timezone.utc).isoformat(), "done": True,
                 "done_reason": "load" if now else "unload"}
        return JSONResponse({**reply, **({"response": ""} if api.generate else
                                         {"message": {"role": "assistant", "content": ""}})})

    async def embeddings(self, request: Request) -> Response:
        """/v1/embeddings, Ollama's /api/embed, and its older /api/embeddings (one prompt, its
        vector as the model gives it)."""
        path = request.url.path
        errors = openai_errors if path == "/v1/embeddings" else ollama_errors
        refused = self.door.refusal(request, errors)
        return refused or await counted(self.pool, errors, lambda place: self._embed(request, path, errors))

    async def _embed(self, request: Request, path: str, errors: Errors) -> Response:
        from starlette.responses import JSONResponse

        from quipu.serve import wire
        from quipu.serve.plan import embed_inputs, request_keep

        openai, older = path == "/v1/embeddings", path == "/api/embeddings"
        try:
            body = await read_json(request)
            name, _ = await off_loop(self.pool.pick, body.get("model"))  # (it may look through the folders)
            inputs = embed_inputs(body, "prompt" if older else "input")
            if older and len(inputs) != 1:
                raise RequestError("prompt must be one text (/api/embed takes several)")
            if body.get("dimensions") is not None:
                raise RequestError("dimensions: quipu serve gives each model's embeddings whole")
            keep = None if openai else request_keep(body)
            started = time.perf_counter()
            vectors, tokens, load_s = await off_loop(self.pool.embed, name, inputs, keep)
            if older:
                return JSONResponse({"embedding": vectors[0]})
            reply = wire.openai_embeddings(name, vectors, tokens, body.get("encoding_format")) if openai else \
                wire.ollama_embeddings(name, vectors, tokens, load_s, time.perf_counter() - started)
        except Exception as exc:
            return shaped(errors, exc)
        return JSONResponse(reply)

    async def count_tokens(self, request: Request) -> Response:
        """/v1/messages/count_tokens: the tokens a Messages request's prompt would be, its
        system prompt, tools and messages rendered by the model's template."""
        from starlette.responses import JSONResponse

        from quipu.serve.anthropic import error_body, messages_request

        refused = self.door.refusal(request, error_body)
        if refused is not None:
            return refused

        async def counting(place: Place) -> Response:
            try:
                body = await read_json(request)
                plan = await off_loop(self.pool.plan, body, lambda b, base: messages_request(b, base, counting=True),
                                      True)
                count = await off_loop(self.pool.count, plan)
            except Exception as exc:
                return shaped(error_body, exc)
            return JSONResponse({"input_tokens": count})
        return await counted(self.pool, error_body, counting)

    async def response(self, request: Request) -> Response:
        """GET /v1/responses/{id} (a kept response whole), .../input_items (the input it
        answered), DELETE (forgotten; its conversation stays in its session)."""
        from starlette.responses import JSONResponse

        from quipu.app.responses import forget, kept_response

        refused = self.door.refusal(request, openai_errors)
        if refused is not None:
            return refused
        ident = request.path_params["ident"]
        items = request.url.path.endswith("/input_items")
        shown = self.pool.in_progress(ident)
        if shown is not None and request.method == "GET" and not items:
            return JSONResponse(shown)  # (a response being made is said so at once)
        try:
            pages = page_of(request.query_params) if items else None
            await off_loop(self.pool.kept_wait, ident)  # (a response being made, its input or its removal: once kept)
            async with self.light:
                if request.method == "DELETE":
                    if not await off_loop(forget, self.pool.env, ident):
                        raise RequestError(f"no response '{ident[:80]}' is kept here", 404, "not_found")
                    return JSONResponse({"id": ident, "object": "response.deleted", "deleted": True})
                kept = await off_loop(kept_response, self.pool.env, ident)
        except Exception as exc:
            return shaped(openai_errors, exc)
        if kept is None:
            return shaped(openai_errors, RequestError(f"no response '{ident[:80]}' is kept here", 404, "not_found"))
        if pages is not None:
            from quipu.serve.responses import input_items

            try:
                return JSONResponse(input_items(kept.input, ident, *pages))
            except RequestError as exc:  # (an `after` the input does not hold)
                return shaped(openai_errors, exc)
        return JSONResponse(kept.response)

    async def listed(self, request: Request) -> Response:
        """/v1/models, /api/tags, /api/ps and /api/version: what the server has."""
        from starlette.responses import JSONResponse

        from quipu import __version__
        from quipu.serve import wire

        path = request.url.path
        failed = self.door.refusal(request, openai_errors if path == "/v1/models" else ollama_errors,
                                   key=path != "/api/version")
        if failed is not None:
            return failed
        if path == "/api/version":
            return JSONResponse({"version": __version__})
        if path == "/api/ps":  # (each reads its models' headers, and the folders models are in)
            return JSONResponse(await self._light(wire.ollama_ps, self.pool.loaded(), self.pool.digest))
        if path == "/v1/models":
            return JSONResponse(await self._light(lambda: wire.openai_models(self.pool.known())))
        return JSONResponse(await self._light(lambda: wire.ollama_tags(self.pool.known(), self.pool.digest)))

    async def show(self, request: Request) -> Response:
        from starlette.responses import JSONResponse

        from quipu.serve import wire

        failed = self.door.refusal(request, ollama_errors)
        if failed is not None:
            return failed
        try:
            async with self.light:
                body = await read_json(request)
                found = await off_loop(self.pool.pick, body.get("model") or body.get("name"))
                return JSONResponse(await off_loop(lambda: wire.ollama_show(*found, self.pool.settings())))
        except Exception as exc:
            return shaped(ollama_errors, exc)


def http_app(pool: Pool, host: str, port: int, api_key: str | None, origins: list[str] | None = None,
             on_start: Callable[[], None] | None = None) -> Starlette:
    """The HTTP side: routes behind the door, errors in the API's shape."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.routing import Route

    from quipu.serve.anthropic import error_body as anthropic_errors

    routes = Routes(pool, Door(host, port, api_key, list(origins or [])))

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        path = request.url.path
        said = (NOT_SERVED[path] if status in (404, 405) and path in NOT_SERVED else "no such route" if status == 404
                else "this route does not take that method" if status == 405 else "the request failed")
        errors = ollama_errors if path.startswith("/api/") else \
            anthropic_errors if path.startswith("/v1/messages") else openai_errors
        return shaped(errors, RequestError(said, status))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if on_start is not None:
            on_start()
        try:
            yield
        finally:
            await off_loop(pool.close)

    middleware = []
    if origins:
        from starlette.middleware.cors import CORSMiddleware

        # (any header a client sends: the openai SDK's x-stainless-*, X-Quipu-Session, a key)
        middleware.append(Middleware(CORSMiddleware, allow_origins=sorted(origins), allow_methods=["GET", "POST", "DELETE"],
                                     allow_headers=["*"]))
    post = ["POST"]
    return Starlette(routes=[Route("/health", routes.health),
                             *(Route(path, routes.listed) for path in ("/v1/models", "/api/tags", "/api/ps",
                                                                       "/api/version")),
                             *(Route(path, routes.answer, methods=post) for path in routes.apis),
                             *(Route(path, routes.embeddings, methods=post)
                               for path in ("/v1/embeddings", "/api/embed", "/api/embeddings")),
                             Route("/v1/messages/count_tokens", routes.count_tokens, methods=post),
                             Route("/v1/responses/{ident}", routes.response, methods=["GET", "DELETE"]),
                             Route("/v1/responses/{ident}/input_items", routes.response),
                             Route("/api/show", routes.show, methods=post)],
                     middleware=middleware, exception_handlers={HTTPException: http_error}, lifespan=lifespan)


async def read_json(request: Request) -> dict[str, Any]:
    """A request's JSON object, its body read within `MAX_BODY` bytes and `BODY_S` seconds, and
    read off the loop: nested at most `MAX_JSON_DEPTH` deep, and no text in it a lone half of a
    UTF-16 pair (which no tokenizer can take)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isascii() or not declared.isdigit() or int(declared) > MAX_BODY):
        raise RequestError(f"the body must be at most {MAX_BODY >> 20} MB", 413)
    data = bytearray()
    try:
        async with asyncio.timeout(BODY_S):  # (a client that sends its body a byte at a time is let go)
            async for chunk in request.stream():
                data += chunk
                if len(data) > MAX_BODY:
                    raise RequestError(f"the body must be at most {MAX_BODY >> 20} MB", 413)
    except TimeoutError:
        raise RequestError(f"the body did not come in whole within {BODY_S:.0f} s", 408) from None
    return await off_loop(parse_json, bytes(data))


def parse_json(data: bytes) -> dict[str, Any]:
    """A request's body as a JSON object, checked as `read_json` says."""
    from quipu.app.user_files import lone_surrogate

    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        raise RequestError("the body is not JSON") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    check_depth(body)
    for key, value in body.items():
        if lone_surrogate(key) or lone_surrogate(value):
            raise RequestError(f"{key[:40]!r} holds a lone surrogate (\\ud800-\\udfff), which is no text")
    return body


def check_depth(value: Any, depth: int = 0) -> None:
    """Refuses a request's JSON that nests deeper than `MAX_JSON_DEPTH`."""
    if depth > MAX_JSON_DEPTH:
        raise RequestError(f"the body nests deeper than {MAX_JSON_DEPTH} levels")
    for item in value.values() if isinstance(value, dict) else value if isinstance(value, list) else ():
        check_depth(item, depth + 1)
