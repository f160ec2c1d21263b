"""`quipu serve`'s command line: its options read and checked, then the server (`quipu.serve`)
started. Loopback by default; any other address needs `--api-key`."""

from __future__ import annotations

import os
from typing import Annotated, List, Optional

import typer

from quipu.cli import options as opt, spec
from quipu.errors import UsageError

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
    from quipu.cli.terminal import Terminal
    from quipu.serve.plan import RequestError, keep_alive as keep_of
    from quipu.serve.server import host_in_url, installed, loopback

    installed()

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
    if api_key is not None and not api_key.strip():
        raise UsageError("--api-key is empty: give the key clients must send, or leave it out on loopback")
    if not loopback(host) and not api_key:
        raise UsageError(f"--host {host} is reachable from other machines: give --api-key KEY too (clients send it "
                         "as Authorization: Bearer KEY)")
    try:
        keep = keep_of(keep_alive if keep_alive is not None else config.get("keep_alive", DEFAULTS["keep_alive"]),
                       "--keep-alive")
    except RequestError as exc:
        raise UsageError(str(exc)) from None
    from quipu.serve.pool import MAX_PARALLEL

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
    from quipu.serve import http, server
    from quipu.serve.pool import Pool

    pool = Pool(env, opts, models, keep, parallel, say=lambda line: term.err(f"quipu serve: {line}\n"))
    pool.load(pool.model)  # (before it listens: /health says it takes requests once it can answer them)

    def listening() -> None:
        term.err(f"quipu serve: {pool.model} at http://{host_in_url(host)}:{port}/v1 (Ctrl-C stops)\n")

    server.run(http.http_app(pool, host, port, api_key, origins, listening), pool, host, port)
