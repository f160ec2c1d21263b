"""The server that listens: uvicorn, with connections held within bounds (a connection that sends
no whole request head within `HEAD_S` is closed; past `MAX_CONNECTIONS`, or a client's
`MAX_PER_CLIENT`, the longest-idle connection is closed to make room, so idle or half-sent
sockets cannot lock others out), and a stop that cuts every reply at its next token: SIGTERM
exits 0 at once, leaving every kept conversation as its last whole turn left it (Ctrl-C: 130)."""

from __future__ import annotations

import contextlib
import ipaddress
import signal
import socket
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

if TYPE_CHECKING:
    from quipu.serve.plan import Keep
    from quipu.serve.pool import Pool

HEAD_S = 10.0  # seconds a connection may take to send a request's head
MAX_CONNECTIONS = 512  # open at once
MAX_PER_CLIENT = 128  # open at once from one address
STOP_S = 1  # seconds: how long a stop waits for replies to end (each ends at its next token) before it goes


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_in_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host


DEFAULTS = {"host": "127.0.0.1", "port": 8080, "keep_alive": "5m", "parallel": 1}


@dataclass(frozen=True)
class Listening:
    """What a server is told, checked: where it listens, the key it wants, how long a model stays
    loaded, how many requests it answers at once, the pages that may call it, its models."""

    host: str
    port: int
    api_key: str | None
    keep: Keep
    parallel: int
    origins: tuple[str, ...]
    models: tuple[str, ...]

    @property
    def url(self) -> str:
        """The address OpenAI-style clients are given."""
        return f"http://{host_in_url(self.host)}:{self.port}/v1"


def listening_of(given: Mapping[str, Any], config: Mapping[str, Any], environ: Mapping[str, str]) -> Listening:
    """The server's own options (`quipu.options`' group "serve") as the command line gives them,
    else as the config's [serve] does, else their defaults; each refused in one line."""
    from quipu.errors import UsageError
    from quipu.options import OPTIONS
    from quipu.serve.plan import RequestError, keep_alive
    from quipu.serve.pool import MAX_PARALLEL

    def value(name: str) -> Any:
        chosen = given.get(name)
        return chosen if chosen not in (None, [], ()) else config.get(name, DEFAULTS.get(name))

    def where(name: str) -> str:
        return OPTIONS[name].spelled if given.get(name) not in (None, [], ()) else f"[serve] {name}"

    host, port, parallel = str(value("host")), int(value("port")), int(value("parallel"))
    bounds = OPTIONS["port"].bounds
    refused = bounds.refusal(where("port"), port) if bounds is not None else None
    if refused is not None:
        raise UsageError(refused)
    api_key = given.get("api_key")
    if api_key is None and config.get("api_key_env"):
        api_key = environ.get(config["api_key_env"]) or None
        if api_key is None:
            raise UsageError(f"[serve] api_key_env names {config['api_key_env']}, which is not set")
    if api_key is not None and not api_key.strip():
        raise UsageError("--api-key is empty: give the key clients must send, or leave it out on loopback")
    if not loopback(host) and not api_key:
        raise UsageError(f"--host {host} is reachable from other machines: give --api-key KEY too (clients send it "
                         "as Authorization: Bearer KEY)")
    try:
        keep = keep_alive(value("keep_alive"), where("keep_alive"))
    except RequestError as exc:
        raise UsageError(str(exc)) from None
    if not 1 <= parallel <= MAX_PARALLEL:
        raise UsageError(f"{where('parallel')} must be from 1 to {MAX_PARALLEL}, got {parallel}")
    origins = tuple(value("cors") or ())
    for origin in origins:
        if origin != "*" and (not origin.startswith(("http://", "https://")) or origin.count("/") != 2):
            raise UsageError(f"--cors takes an origin such as https://example.org:3000 (or *), not {origin!r}")
    return Listening(host, port, api_key, keep, parallel, origins, tuple(value("models") or ()))


def installed() -> None:
    """Refuses in one line where the server's own packages (the `serve` extra) are missing."""
    import importlib.util

    from quipu.errors import UsageError

    missing = [name for name in ("starlette", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"quipu serve needs {' and '.join(missing)}: pip install 'quipu[serve]'")


def protocol() -> type:
    """uvicorn's HTTP/1.1 protocol, with the bounds above."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Bounded(H11Protocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.head_timer = self.loop.call_later(HEAD_S, self._head_late)
            mine = [c for c in self.connections if isinstance(c, Bounded) and c._host() == self._host()]
            if len(self.connections) > MAX_CONNECTIONS:
                self._make_room(list(self.connections))
            if len(mine) > MAX_PER_CLIENT:
                self._make_room(mine)

        def _host(self) -> str:
            return self.client[0] if self.client else ""

        def _idle(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _make_room(self, among: list[Any]) -> None:
            idle = [c for c in among if c is not self and isinstance(c, Bounded) and c._idle()]
            (idle[0] if idle else self).transport.close()

        def _head_late(self) -> None:
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()  # (no whole request head in time: its place is given to others)

        def connection_lost(self, exc: Exception | None) -> None:
            self.head_timer.cancel()
            super().connection_lost(exc)

    return Bounded


def bind(host: str, port: int) -> socket.socket:
    """The socket the server listens on, bound before its model loads: an address in use, or one
    this machine does not have, is one line (exit 1)."""
    from quipu.errors import QuipuError

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
        except BaseException:
            sock.close()
            raise
    except OSError as exc:
        raise QuipuError(f"quipu serve cannot listen on {host_in_url(host)}:{port}: "
                         f"{exc.strerror or exc}") from None
    return sock


def run(app: Any, pool: Pool, sock: socket.socket) -> None:
    """Serves `app` on `sock` (`bind`'s) until told to stop; SIGTERM returns (exit 0), Ctrl-C
    raises KeyboardInterrupt (130). Either stops `pool` at once, so every reply ends at its next
    token."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            pool.stop()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # (uvicorn's, but that a SIGTERM, once the server has stopped as it asked, is not
            # raised again: the process exits 0)
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            before: dict[int, Callable[..., Any] | int | None] = {
                s: signal.signal(s, self.handle_exit) for s in handled}
            try:
                yield
            finally:
                for sig, handler in before.items():
                    signal.signal(sig, handler)
            if signal.SIGINT in self._captured_signals:
                raise KeyboardInterrupt

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", http=protocol(),
                            timeout_graceful_shutdown=STOP_S, timeout_keep_alive=5)
    Server(config).run(sockets=[sock])
