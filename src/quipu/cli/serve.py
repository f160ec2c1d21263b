"""`quipu serve`: the OpenAI API and Ollama's on quipu's engine, over HTTP (Starlette on uvicorn,
imported only by this command). Loopback by default; any other address needs `--api-key`. A
request whose Host is not the address served is refused (a web page cannot reach a loopback
server by DNS rebinding), and so is one a browser sends from another site (its Origin) unless
`--cors` names that site; every refusal is a 4xx in the API's own error shape. What a request
does is `app/serve.py`'s."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import os
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Annotated, Any, AsyncIterator, Callable, List, Optional

import typer

from quipu.cli import options as opt, spec
from quipu.errors import UsageError

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response

    from quipu.app.answer import Answer
    from quipu.app.serve import Served
    from quipu.app.serve_plan import ChatRequest

MAX_BODY = 8 << 20  # bytes of a request's body
BODY_S = 60.0  # seconds a request's body may take to come in whole
MAX_CONNECTIONS = 256  # at once; past them a connection is answered 503 (slow clients cannot hold them all)
HELP = ("Serve models over the OpenAI API (/v1/chat/completions, /v1/embeddings) and Ollama's (/api/chat, "
        "/api/generate, /api/embed), on this machine by default.")
DEFAULTS = {"host": "127.0.0.1", "port": 8080, "keep_alive": "5m"}


def register(app: typer.Typer) -> None:
    app.command("serve", help=HELP)(serve)


def serve(
    context: typer.Context,
    model: Optional[List[str]] = typer.Option(None, "--model", "-m", help="A model to serve (a .gguf file or a known "
                                              "model name; again for more): the first is the default of a request "
                                              "that names none. Any model `quipu models list` names is served by "
                                              "its name too.", metavar="MODEL", autocompletion=spec.OPTS["model"].complete),
    host: Optional[str] = typer.Option(None, "--host", help="The address to listen on (default 127.0.0.1; anything "
                                                            "but loopback needs --api-key)."),
    port: Optional[int] = typer.Option(None, "--port", help="The port to listen on (default 8080)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Answer only requests that bring this key "
                                                                  "(Authorization: Bearer KEY).", metavar="KEY"),
    keep_alive: Optional[str] = typer.Option(None, "--keep-alive", help="How long a model stays loaded after its "
                                             "last request: 5m (the default), 90s, 1h, 0 (unloaded at once), -1 "
                                             "(for good).", metavar="DURATION"),
    cors: Optional[List[str]] = typer.Option(None, "--cors", help="Let web pages of this origin call the server "
                                             "(https://host:port; again for more).", metavar="ORIGIN"),
    parallel: Optional[int] = typer.Option(None, "--parallel", help="Answer up to N requests at once, decoded "
                                           "together (each conversation its own --ctx; default 1: every answer "
                                           "a lone run's to the last bit).", metavar="N"),
    ctx: Annotated[Optional[str], opt.typer_option(spec.OPTS["ctx"])] = None,
    chat_template: Annotated[Optional[str], opt.typer_option(spec.OPTS["chat_template"])] = None,
    mmproj: Annotated[Optional[str], opt.typer_option(spec.OPTS["mmproj"])] = None,
    threads: Annotated[Optional[int], opt.typer_option(spec.OPTS["threads"])] = None,
    kv_type: Annotated[Optional[str], opt.typer_option(spec.OPTS["kv_type"])] = None,
    gpu_layers: Annotated[Optional[str], opt.typer_option(spec.OPTS["gpu_layers"])] = None,
    gpu_memory: Annotated[Optional[str], opt.typer_option(spec.OPTS["gpu_memory"])] = None,
    device: Annotated[Optional[str], opt.typer_option(spec.OPTS["device"])] = None,
    no_log: Annotated[bool, opt.typer_option(spec.OPTS["no_log"])] = False,
    verbose: Annotated[bool, opt.typer_option(spec.OPTS["verbose"])] = False,
) -> None:
    from quipu.app.serve_plan import RequestError, keep_alive as keep_of
    from quipu.cli.terminal import Terminal

    env = context.obj
    config = env.config.serve  # ([serve] in the config: what the command line does not give)
    host = str(host or config.get("host") or DEFAULTS["host"])
    port = int(port if port is not None else config.get("port", DEFAULTS["port"]))
    if not 0 < port < 65536:
        raise UsageError(f"--port must be from 1 to 65535, got {port}")
    if api_key is None and config.get("api_key_env"):
        api_key = os.environ.get(config["api_key_env"]) or None
        if api_key is None:
            raise UsageError(f"[serve] api_key_env names {config['api_key_env']}, which is not set")
    if not loopback(host) and not api_key:
        raise UsageError(f"--host {host} is reachable from other machines: give --api-key KEY too (clients send it "
                         "as Authorization: Bearer KEY)")
    try:
        keep = keep_of(keep_alive if keep_alive is not None else config.get("keep_alive", DEFAULTS["keep_alive"]),
                       "--keep-alive")
    except RequestError as exc:
        raise UsageError(str(exc)) from None
    from quipu.app.serve import MAX_PARALLEL

    where = "--parallel" if parallel is not None else "[serve] parallel"
    parallel = int(parallel if parallel is not None else config.get("parallel", 1))
    if not 1 <= parallel <= MAX_PARALLEL:
        raise UsageError(f"{where} must be from 1 to {MAX_PARALLEL}, got {parallel}")
    origins = list(cors or config.get("cors") or [])
    for origin in origins:
        if origin != "*" and (not origin.startswith(("http://", "https://")) or origin.count("/") != 2):
            raise UsageError(f"--cors takes an origin such as https://example.org:3000 (or *), not {origin!r}")
    models = list(model or config.get("models") or [])
    opts = spec.turn_options({"model": models[0] if models else None, "ctx": ctx, "chat_template": chat_template,
                              "mmproj": mmproj, "threads": threads, "kv_type": kv_type, "gpu_layers": gpu_layers,
                              "gpu_memory": gpu_memory, "device": device, "no_log": no_log, "verbose": verbose}, env)
    term = Terminal.detect()
    from quipu.cli.pull import pull_if_needed

    for name in models or [None]:
        pull_if_needed(env, name, term)
    from quipu.app.serve import Served

    served = Served(env, opts, models, keep, parallel)
    served.load(served.model)  # (before it listens: /health says it takes requests once it can answer them)
    import uvicorn

    def listening() -> None:
        term.err(f"quipu serve: {served.model} at http://{host_in_url(host)}:{port}/v1 (Ctrl-C stops)\n")

    app = http_app(served, host, port, api_key, origins, listening)
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                  lifespan="on", limit_concurrency=MAX_CONNECTIONS)).run()


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_in_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@dataclass(frozen=True)
class Api:
    """One of the routes that answer: which API's shapes (`openai`), what reads its request,
    whether it streams unless told (Ollama's do), and its reply whole and streamed."""

    openai: bool
    make: Callable[..., ChatRequest]
    whole: Callable[[list[Answer], dict[str, Any]], dict[str, Any]]
    stream: Callable[[Served, ChatRequest, dict[str, Any]], AsyncIterator[str]]
    generate: bool = False  # Ollama's /api/generate: a prompt, where /api/chat has messages

    @property
    def media_type(self) -> str:
        return "text/event-stream" if self.openai else "application/x-ndjson"


def apis() -> dict[str, Api]:
    """The routes that answer, by path."""
    from functools import partial

    from quipu.app import serve_bodies as bodies
    from quipu.app.serve_plan import chat_request, completion_request, ollama_request
    from quipu.cli.serve_stream import ollama_stream, openai_stream

    def ollama_whole(generate: bool) -> Callable[[list[Answer], dict[str, Any]], dict[str, Any]]:
        def whole(answers: list[Answer], head: dict[str, Any]) -> dict[str, Any]:
            [answer] = answers  # (Ollama's API asks for one)
            piece = bodies.ollama_piece(answer.model, head["created_at"], answer.text, answer.reasoning,
                                        generate=generate, calls=bodies.waiting_calls(answer))
            return {**piece, **bodies.ollama_reply(answer, head["created_at"])}
        return whole

    return {
        "/v1/chat/completions": Api(True, chat_request, lambda a, head: bodies.chat_completion(a, **head),
                                    partial(openai_stream, plain=False)),
        "/v1/completions": Api(True, completion_request, lambda a, head: bodies.text_completion(a, **head),
                               partial(openai_stream, plain=True)),
        "/api/chat": Api(False, ollama_request, ollama_whole(False), partial(ollama_stream, generate=False)),
        "/api/generate": Api(False, partial(ollama_request, generate=True), ollama_whole(True),
                             partial(ollama_stream, generate=True), generate=True),
    }


def http_app(served: Served, host: str, port: int, api_key: str | None, origins: list[str] | None = None,
             on_start: Any = None) -> Starlette:
    """The HTTP side: routes, the Host, Origin and key checks, bodies read within bounds, errors
    in the API's shape."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from quipu.app import serve_bodies as bodies
    from quipu.app.serve_plan import as_session_turn, choices, embed_inputs, load_only, request_keep
    from quipu.app.serve import ReplySink

    names = {host_in_url(host)} | ({"localhost", "127.0.0.1", "[::1]"} if loopback(host) else set())
    hosts = names | {f"{name}:{port}" for name in names}
    allowed = set(origins or [])
    own = {f"http://{name}" for name in hosts}
    answering = apis()

    def refused(status: int, message: str, kind: str) -> Response:
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status)

    def checked(request: Request, key: bool = True) -> Response | None:
        """A refusal of a request from another site (its Host not the address served, or a
        browser's page of another origin that `--cors` does not name), or without the key
        (`key`: the route needs it)."""
        if api_key is None and request.headers.get("host", "") not in hosts:
            return refused(403, "the Host of this request is not the address served", "forbidden")
        origin = request.headers.get("origin")
        if origin is not None and origin not in own and origin not in allowed and "*" not in allowed:
            return refused(403, "a web page of another site may not call this server (quipu serve --cors ORIGIN "
                                "lets one)", "forbidden")
        if api_key is not None and key:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return refused(401, "a key is needed: Authorization: Bearer KEY", "invalid_api_key")
        return None

    def shaped(openai: bool, exc: BaseException) -> Response:
        """A failure in the API's shape (`openai`: OpenAI's, else Ollama's); a busy server's says
        when to ask again."""
        status, body = (bodies.error_body if openai else bodies.ollama_error)(exc)
        return JSONResponse(body, status, headers={"Retry-After": "1"} if status == 503 else None)

    async def health(request: Request) -> Response:
        # (a probe needs no key; it says how many requests the server holds: answered and waiting)
        return checked(request, key=False) or JSONResponse({"status": "ok", "requests": served.requests})

    async def answer(request: Request) -> Response:
        failed = checked(request)
        if failed is not None:
            return failed
        api = answering[request.url.path]
        try:
            body = await read_json(request)
            if not api.openai and load_only(body, api.generate):
                return await loaded(body, api)
            plan = as_session_turn(served.plan(body, api.make), request.headers.get("x-quipu-session"))
            served.room()  # (a busy server says so before a stream's head is out)
        except Exception as exc:  # (every refusal a 4xx in the API's shape, never a traceback)
            return shaped(api.openai, exc)
        if api.openai:
            plain = request.url.path == "/v1/completions"
            head: dict[str, Any] = {"ident": f"{'cmpl' if plain else 'chatcmpl'}-{secrets.token_hex(12)}",
                                    "created": int(time.time())}
        else:
            head = {"created_at": datetime.now(timezone.utc).isoformat()}
        if (body.get("stream") is True) if api.openai else (body.get("stream", True) is not False):
            return StreamingResponse(api.stream(served, plan, {**head, "body": body}), media_type=api.media_type,
                                     headers={"Cache-Control": "no-cache"})
        try:
            done = [await asyncio.to_thread(served.chat, each, ReplySink()) for each in choices(plan)]
        except Exception as exc:
            return shaped(api.openai, exc)
        return JSONResponse(api.whole(done, head))

    async def loaded(body: dict[str, Any], api: Api) -> Response:
        """Ollama's request with nothing to answer: the model loaded (or, `keep_alive` 0, unloaded)."""
        name, _ = served.pick(body.get("model"))
        now = await asyncio.to_thread(served.load, name, request_keep(body))
        reply = {"model": name, "created_at": datetime.now(timezone.utc).isoformat(), "done": True,
                 "done_reason": "load" if now else "unload"}
        return JSONResponse({**reply, **({"response": ""} if api.generate else
                                         {"message": {"role": "assistant", "content": ""}})})

    async def embeddings(request: Request) -> Response:
        failed = checked(request)
        if failed is not None:
            return failed
        openai = request.url.path == "/v1/embeddings"
        try:
            body = await read_json(request)
            name, _ = served.pick(body.get("model"))
            texts = embed_inputs(body)
            if body.get("dimensions") is not None:
                raise UsageError("dimensions: quipu serve gives each model's embeddings whole")
            keep = None if openai else request_keep(body)
            started = time.perf_counter()
            vectors, tokens, load_s = await asyncio.to_thread(served.embed, name, texts, keep)
            reply = bodies.openai_embeddings(name, vectors, tokens, body.get("encoding_format")) if openai else \
                bodies.ollama_embeddings(name, vectors, tokens, load_s, time.perf_counter() - started)
        except Exception as exc:
            return shaped(openai, exc)
        return JSONResponse(reply)

    async def models(request: Request) -> Response:
        return checked(request) or JSONResponse(bodies.openai_models(served.known()))

    async def tags(request: Request) -> Response:
        return checked(request) or JSONResponse(bodies.ollama_tags(served.known()))

    async def show(request: Request) -> Response:
        failed = checked(request)
        if failed is not None:
            return failed
        try:
            body = await read_json(request)
            return JSONResponse(bodies.ollama_show(*served.pick(body.get("model") or body.get("name"))))
        except Exception as exc:
            return shaped(False, exc)

    async def ps(request: Request) -> Response:
        return checked(request) or JSONResponse(bodies.ollama_ps(served.loaded()))

    async def version(request: Request) -> Response:
        from quipu import __version__

        return checked(request, key=False) or JSONResponse({"version": __version__})

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        return refused(status, "no such route" if status == 404 else
                       "this route does not take that method" if status == 405 else "the request failed",
                       "invalid_request_error")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if on_start is not None:
            on_start()
        try:
            yield
        finally:
            served.close()

    middleware = []
    if allowed:
        from starlette.middleware.cors import CORSMiddleware

        middleware.append(Middleware(CORSMiddleware, allow_origins=sorted(allowed), allow_methods=["GET", "POST"],
                                     allow_headers=["Authorization", "Content-Type"]))
    post = ["POST"]
    return Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                             *(Route(path, answer, methods=post) for path in answering),
                             Route("/v1/embeddings", embeddings, methods=post),
                             Route("/api/embed", embeddings, methods=post),
                             Route("/api/tags", tags), Route("/api/show", show, methods=post), Route("/api/ps", ps),
                             Route("/api/version", version)],
                     middleware=middleware, exception_handlers={HTTPException: http_error}, lifespan=lifespan)


async def read_json(request: Request) -> dict[str, Any]:
    """A request's JSON object, its body read within `MAX_BODY` bytes."""
    from quipu.app.serve_plan import RequestError

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
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        raise RequestError("the body is not JSON") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    return body
