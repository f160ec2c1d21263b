"""Where the model runs, chosen once per command from the options, the environment and the
config (see `hosts.py` for what a host is)."""

from __future__ import annotations

from quipu.app.environment import Environment, TurnOptions
from quipu.app.hosts import ModelHost


def open_host(opts: TurnOptions, env: Environment) -> ModelHost:
    """The host this command's model runs on: `--url` (else QUIPU_URL, else the config's
    [remote] url) names a server, llama.cpp's llama-server when its /props says so; else local."""
    settings = env.remote(opts.url, opts.model)
    if settings is None:
        from quipu.app.local import LocalHost

        return LocalHost()
    from quipu.app.llama_server import open_llama_server

    host = open_llama_server(settings)
    if host is not None:
        return host
    from quipu.app.chat_api import ChatApiHost

    return ChatApiHost(settings)
