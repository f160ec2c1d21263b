"""`quipu serve`'s command line: its options read and checked, then the server (`quipu.serve`)
started. Loopback by default; any other address needs `--api-key`."""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer

from quipu.cli import options as opt, spec

HELP = ("Serve models over four APIs: OpenAI's chat completions (/v1/chat/completions, /v1/completions, "
        "/v1/embeddings), OpenAI's Responses (/v1/responses), Anthropic's Messages (/v1/messages) and Ollama's "
        "(/api/chat, /api/generate, /api/embed); on this machine by default.")


def register(app: typer.Typer) -> None:
    app.command("serve", help=HELP)(serve)


def serve(
    context: typer.Context,
    models: Annotated[Optional[List[str]], opt.typer_option(spec.OPTS["models"])] = None,
    host: Annotated[Optional[str], opt.typer_option(spec.OPTS["host"])] = None,
    port: Annotated[Optional[int], opt.typer_option(spec.OPTS["port"])] = None,
    api_key: Annotated[Optional[str], opt.typer_option(spec.OPTS["api_key"])] = None,
    keep_alive: Annotated[Optional[str], opt.typer_option(spec.OPTS["keep_alive"])] = None,
    cors: Annotated[Optional[List[str]], opt.typer_option(spec.OPTS["cors"])] = None,
    parallel: Annotated[Optional[int], opt.typer_option(spec.OPTS["parallel"])] = None,
    ctx: Annotated[Optional[str], opt.typer_option(spec.OPTS["ctx"])] = None,
    chat_template: Annotated[Optional[str], opt.typer_option(spec.OPTS["chat_template"])] = None,
    mmproj: Annotated[Optional[str], opt.typer_option(spec.OPTS["mmproj"])] = None,
    threads: Annotated[Optional[int], opt.typer_option(spec.OPTS["threads"])] = None,
    kv_type: Annotated[Optional[str], opt.typer_option(spec.OPTS["kv_type"])] = None,
    flash_attn: Annotated[Optional[str], opt.typer_option(spec.OPTS["flash_attn"])] = None,
    gpu_layers: Annotated[Optional[str], opt.typer_option(spec.OPTS["gpu_layers"])] = None,
    gpu_memory: Annotated[Optional[str], opt.typer_option(spec.OPTS["gpu_memory"])] = None,
    device: Annotated[Optional[str], opt.typer_option(spec.OPTS["device"])] = None,
    no_log: Annotated[bool, opt.typer_option(spec.OPTS["no_log"])] = False,
    verbose: Annotated[bool, opt.typer_option(spec.OPTS["verbose"])] = False,
) -> None:
    from quipu.cli.terminal import Terminal
    from quipu.serve.server import installed, listening_of

    installed()

    env = context.obj
    given = {"models": models, "host": host, "port": port, "api_key": api_key, "keep_alive": keep_alive, "cors": cors,
             "parallel": parallel}
    chosen = listening_of(given, env.config.serve, env.environ)  # (the [serve] config's where these give none)
    served: list[str | None] = list(chosen.models) or [None]  # (none: the default model)
    opts = spec.turn_options({"model": served[0], "ctx": ctx, "chat_template": chat_template,
                              "mmproj": mmproj, "threads": threads, "kv_type": kv_type, "flash_attn": flash_attn,
                              "gpu_layers": gpu_layers, "gpu_memory": gpu_memory, "device": device, "no_log": no_log,
                              "verbose": verbose}, env)
    term = Terminal.detect()
    from quipu.cli.pull import pull_if_needed
    from quipu.serve import http, server

    sock = server.bind(chosen.host, chosen.port)  # (an address in use is said before the model loads)

    for name in served:
        pull_if_needed(env, name, term)
    from quipu.serve.pool import Pool

    pool = Pool(env, opts, chosen.models, chosen.keep, chosen.parallel,
                say=lambda line: term.err(f"quipu serve: {line}\n"))
    pool.load(pool.model)  # (before it listens: /health says it takes requests once it can answer them)

    def listening() -> None:
        term.err(f"quipu serve: {pool.model} at {chosen.url} (Ctrl-C stops)\n")
        if not opts.no_cache:
            term.err(f"quipu serve: every conversation kept in the prompt cache, {env.dirs.prompt_cache}, up to "
                     f"{env.cache_max_bytes / 2**30:.1f} GiB (the config's [cache] max_bytes)\n")

    app = http.http_app(pool, chosen.host, chosen.port, chosen.api_key, list(chosen.origins), listening)
    server.run(app, pool, sock)
