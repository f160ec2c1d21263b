"""The server that listens: uvicorn, with connections held within bounds (a connection that sends
no whole request head within `HEAD_S` is closed; past `MAX_CONNECTIONS`, or a client's
`MAX_PER_CLIENT`, the longest-idle connection is closed to make room, so idle or half-sent
sockets cannot lock others out), and a stop that cuts every reply at its next token: SIGTERM
exits 0 at once, leaving every kept conversation as its last whole turn left it (Ctrl-C: 130)."""

from __future__ import annotations

import contextlib
import ipaddress
import signal
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
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


def run(app: Any, pool: Pool, host: str, port: int) -> None:
    """Serves `app` on host:port until told to stop; SIGTERM returns (exit 0), Ctrl-C raises
    KeyboardInterrupt (130). Either stops `pool` at once, so every reply ends at its next token."""
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
            before: dict[int, Callable[..., Any] | int | None] = {s: signal.signal(s, self.handle_exit) for s in handled}
            try:
                yield
            finally:
                for sig, handler in before.items():
                    signal.signal(sig, handler)
            if signal.SIGINT in self._captured_signals:
                raise KeyboardInterrupt

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="on",
                            http=protocol(), timeout_graceful_shutdown=STOP_S, timeout_keep_alive=5)
    Server(config).run()
