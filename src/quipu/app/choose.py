"""Where the model runs, chosen once per command from the options, the environment and the
config (see `hosts.py` for what a host is). Below this module nothing asks whether there is a
URL: the commands settle it here (`server_of`, into `TurnOptions.server`) and hand it down."""

from __future__ import annotations

from typing import TYPE_CHECKING

from quipu.app.environment import Environment, check_url
from quipu.app.hosts import ModelHost

if TYPE_CHECKING:
    from quipu.engine.http import ServerSettings


def server_of(url: str | None, model: str | None, env: Environment) -> "ServerSettings | None":
    """The server a command talks to (`--url`, else QUIPU_URL, else [remote] url in the config),
    asking for `model` (`-m`), else the config's; None for a model on this machine."""
    url = url or env.environ.get("QUIPU_URL") or env.config.remote.get("url")
    if not url:
        return None
    check_url(url)
    from dataclasses import replace

    from quipu.engine.http import ServerSettings

    conf = env.config.remote
    settings = ServerSettings(url=url, model=model or conf.get("model"),
                              api_key_env=conf.get("api_key_env", "QUIPU_API_KEY"))
    if "timeout" in conf:
        timeout = float(conf["timeout"])
        settings = replace(settings, read_timeout=timeout, connect_timeout=timeout)
    return settings


def open_host(server: "ServerSettings | None") -> ModelHost:
    """The host of `server` (`TurnOptions.server`): llama.cpp's llama-server when its /props
    says so, else the server's chat API; a local model when there is no server."""
    if server is None:
        from quipu.app.local import LocalHost

        return LocalHost()
    from quipu.app.llama_server import open_llama_server

    host = open_llama_server(server)
    if host is not None:
        return host
    from quipu.app.chat_api import ChatApiHost

    return ChatApiHost(server)
