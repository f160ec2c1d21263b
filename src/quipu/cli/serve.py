"""`quipu serve`: the OpenAI chat API and Ollama's on quipu's engine, over HTTP (Starlette on uvicorn, imported
only by this command). Loopback by default; any other address needs `--api-key`. A request
whose Host is not the address served is refused (a web page cannot reach a loopback server by
DNS rebinding); every refusal is a 4xx in the API's own error shape. What a request does is
`app/serve.py`'s."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import secrets
import threading
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Annotated, Any, AsyncIterator, Optional

import typer

from quipu.cli import options as opt, spec
from quipu.errors import UsageError

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response

    from quipu.app.answer import Answer
    from quipu.app.serve import ChatRequest, Served

MAX_BODY = 8 << 20  # bytes of a request's body
HELP = ("Serve a model over the OpenAI chat API (/v1/chat/completions) and Ollama's (/api/chat, /api/generate), "
        "on this machine by default.")


def register(app: typer.Typer) -> None:
    app.command("serve", help=HELP)(serve)


def serve(
    context: typer.Context,
    model: Annotated[Optional[str], opt.typer_option(spec.OPTS["model"])] = None,
    host: str = typer.Option("127.0.0.1", "--host", help="The address to listen on (anything but loopback needs "
                                                        "--api-key)."),
    port: int = typer.Option(8080, "--port", help="The port to listen on."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Answer only requests that bring this key "
                                                                  "(Authorization: Bearer KEY).", metavar="KEY"),
    ctx: Annotated[Optional[str], opt.typer_option(spec.OPTS["ctx"])] = None,
    chat_template: Annotated[Optional[str], opt.typer_option(spec.OPTS["chat_template"])] = None,
    threads: Annotated[Optional[int], opt.typer_option(spec.OPTS["threads"])] = None,
    kv_type: Annotated[Optional[str], opt.typer_option(spec.OPTS["kv_type"])] = None,
    gpu_layers: Annotated[Optional[str], opt.typer_option(spec.OPTS["gpu_layers"])] = None,
    gpu_memory: Annotated[Optional[str], opt.typer_option(spec.OPTS["gpu_memory"])] = None,
    device: Annotated[Optional[str], opt.typer_option(spec.OPTS["device"])] = None,
    no_log: Annotated[bool, opt.typer_option(spec.OPTS["no_log"])] = False,
    verbose: Annotated[bool, opt.typer_option(spec.OPTS["verbose"])] = False,
) -> None:
    from quipu.cli.terminal import Terminal

    env = context.obj
    if not 0 < port < 65536:
        raise UsageError(f"--port must be from 1 to 65535, got {port}")
    if not loopback(host) and not api_key:
        raise UsageError(f"--host {host} is reachable from other machines: give --api-key KEY too (clients send it "
                         "as Authorization: Bearer KEY)")
    opts = spec.turn_options({"model": model, "ctx": ctx, "chat_template": chat_template, "threads": threads, "kv_type": kv_type,
                              "gpu_layers": gpu_layers, "gpu_memory": gpu_memory, "device": device,
                              "no_log": no_log, "verbose": verbose}, env)
    term = Terminal.detect()
    from quipu.cli.pull import pull_if_needed

    pull_if_needed(env, opts.model, term)
    from quipu.app.serve import Served

    served = Served(env, opts)
    import uvicorn

    def listening() -> None:
        term.stderr.write(f"quipu serve: {served.model} at http://{host_in_url(host)}:{port}/v1 (Ctrl-C stops)\n")
        term.stderr.flush()

    app = http_app(served, host, port, api_key, listening)
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                  lifespan="on")).run()


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_in_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def http_app(served: Served, host: str, port: int, api_key: str | None, on_start: Any = None) -> Starlette:
    """The HTTP side: routes, the Host and key checks, bodies read within bounds, errors in the API's shape."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from quipu.app.serve import chat_completion, error_body, text_completion

    names = {host_in_url(host)} | ({"localhost", "127.0.0.1", "[::1]"} if loopback(host) else set())
    hosts = names | {f"{name}:{port}" for name in names}

    def refused(status: int, message: str, kind: str) -> Response:
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status)

    def checked(request: Request, key: bool = True) -> Response | None:
        """A refusal of a request from another site (its Host not the address served), or
        without the key (`key`: the route needs it)."""
        if api_key is None and request.headers.get("host", "") not in hosts:
            return refused(403, "the Host of this request is not the address served", "forbidden")
        if api_key is not None and key:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return refused(401, "a key is needed: Authorization: Bearer KEY", "invalid_api_key")
        return None

    async def health(request: Request) -> Response:
        return checked(request, key=False) or JSONResponse({"status": "ok"})  # (a probe needs no key)

    async def models(request: Request) -> Response:
        return checked(request) or JSONResponse({"object": "list", "data": served.models()})

    async def chat(request: Request) -> Response:
        failed = checked(request)
        if failed is not None:
            return failed
        plain = request.url.path == "/v1/completions"
        try:
            body = await read_json(request)
            plan = served.completion(body) if plain else served.plan(body)
        except Exception as exc:  # (every refusal a 4xx in the API's shape, never a traceback)
            status, shaped = error_body(exc)
            return JSONResponse(shaped, status)
        ident, created = f"{'cmpl' if plain else 'chatcmpl'}-{secrets.token_hex(12)}", int(time.time())
        if body.get("stream") is True:
            options = body.get("stream_options")
            usage = isinstance(options, dict) and options.get("include_usage") is True
            return StreamingResponse(openai_stream(served, plan, ident, created, usage, plain),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        from quipu.app.serve import ReplySink

        try:
            answer = await asyncio.to_thread(served.chat, plan, ReplySink())
        except Exception as exc:
            status, shaped = error_body(exc)
            return JSONResponse(shaped, status)
        return JSONResponse(text_completion(answer, ident, created) if plain else chat_completion(answer, ident, created))

    async def ollama(request: Request) -> Response:
        from quipu.app.serve import ollama_error, ollama_piece, ollama_reply, waiting_calls

        failed = checked(request)
        if failed is not None:
            return failed
        generate = request.url.path == "/api/generate"
        try:
            body = await read_json(request)
            plan = served.ollama(body, generate)
        except Exception as exc:
            status, shaped = ollama_error(exc)
            return JSONResponse(shaped, status)
        created = datetime.now(timezone.utc).isoformat()
        if body.get("stream", True) is not False:  # (Ollama streams unless told not to)
            return StreamingResponse(ollama_stream(served, plan, created, generate),
                                     media_type="application/x-ndjson")
        from quipu.app.serve import ReplySink

        try:
            answer = await asyncio.to_thread(served.chat, plan, ReplySink())
        except Exception as exc:
            status, shaped = ollama_error(exc)
            return JSONResponse(shaped, status)
        piece = ollama_piece(served.model, created, answer.text, answer.reasoning, generate=generate,
                             calls=waiting_calls(answer))
        return JSONResponse({**piece, **ollama_reply(answer, created)})

    async def tags(request: Request) -> Response:
        from quipu.app.serve import ollama_models

        return checked(request) or JSONResponse(ollama_models(served))

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

    return Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                             Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/completions", chat, methods=["POST"]),
                             Route("/api/chat", ollama, methods=["POST"]), Route("/api/generate", ollama, methods=["POST"]),
                             Route("/api/tags", tags), Route("/api/version", version)],
                     exception_handlers={HTTPException: http_error}, lifespan=lifespan)


async def read_json(request: Request) -> dict[str, Any]:
    """A request's JSON object, its body read within `MAX_BODY` bytes."""
    from quipu.app.serve import RequestError

    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isascii() or not declared.isdigit() or int(declared) > MAX_BODY):
        raise RequestError(f"the body must be at most {MAX_BODY >> 20} MB", 413)
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_BODY:
            raise RequestError(f"the body must be at most {MAX_BODY >> 20} MB", 413)
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        raise RequestError("the body is not JSON") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    return body


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


async def openai_stream(served: Served, plan: ChatRequest, ident: str, created: int, usage: bool,
                        plain: bool = False) -> AsyncIterator[str]:
    """A chat completion (or, `plain`, a completion) as server-sent events, each piece as it comes."""
    from quipu.app.serve import FINISH, error_body, openai_calls
    from quipu.app.serve import usage as usage_of

    def chunk(choices: list[dict[str, Any]], **more: Any) -> str:
        return "data: " + json.dumps({"id": ident, "object": "text_completion" if plain else "chat.completion.chunk",
                                      "created": created, "model": served.model, "choices": choices,
                                      **more}) + "\n\n"

    def choice(piece: dict[str, Any], finish: str | None = None) -> list[dict[str, Any]]:
        if plain:
            return [{"index": 0, "text": piece.get("content", ""), "logprobs": None, "finish_reason": finish}]
        return [{"index": 0, "delta": piece, "finish_reason": finish}]

    if not plain:
        yield chunk(choice({"role": "assistant", "content": ""}))
    async for kind, value in events(served, plan):
        if kind == "done":
            answer: Answer = value
            calls = [] if plain else openai_calls(answer, streamed=True)
            if calls:
                yield chunk(choice({"tool_calls": calls}))
            yield chunk(choice({}, FINISH.get(answer.finish_reason, "stop")))
            if usage:
                yield chunk([], usage=usage_of(answer))
        elif kind == "error":
            yield "data: " + json.dumps(error_body(value)[1]) + "\n\n"
        else:
            yield chunk(choice({kind: value}))
    yield "data: [DONE]\n\n"


async def ollama_stream(served: Served, plan: ChatRequest, created: str, generate: bool) -> AsyncIterator[str]:
    """An Ollama-style reply as JSON lines, each piece as it comes, then its end and figures."""
    from quipu.app.serve import ollama_error, ollama_piece, ollama_reply, waiting_calls

    async for kind, value in events(served, plan):
        if kind == "done":
            calls = waiting_calls(value)
            if calls:  # (the calls on a line of their own, before the last, as Ollama sends them)
                yield json.dumps(ollama_piece(served.model, created, "", generate=generate, calls=calls)) + "\n"
            piece = ollama_piece(served.model, created, "", generate=generate)
            yield json.dumps({**piece, **ollama_reply(value, created)}) + "\n"
        elif kind == "error":
            yield json.dumps(ollama_error(value)[1]) + "\n"
        else:
            text, reasoning = (value, "") if kind == "content" else ("", value)
            yield json.dumps(ollama_piece(served.model, created, text, reasoning, generate=generate)) + "\n"
