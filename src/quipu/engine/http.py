"""An HTTP server quipu talks to (llama.cpp's `llama-server`, vLLM, Ollama, LM Studio,
llama-cpp-python's server, any OpenAI-compatible one): `ServerClient` turns everything that can
go wrong on the way into one-line `ServerError`s: a server that cannot be reached, a key refused
(naming the variable that holds it), a model the server does not have, the server's own message
on 4xx and 5xx, a stream cut in the middle or an event that is not JSON (what came before is
kept: `ServerError.partial`). Requests that fail before the first token are tried again, with
growing pauses, when the failure may pass (connection refused, 429, 502, 503, 504); never after,
so nothing is generated twice. The chat API is `chat_api.py`'s; llama-server's own endpoints
(tokens, slots) are `llama_server.py`'s.

httpx is imported only here, so local runs and `--version` do not pay for it. The API key is
read from the environment at the moment of the request and kept nowhere else.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Self

from quipu.errors import QuipuError

RETRY_STATUSES = (429, 502, 503, 504)
MAX_EVENT_BYTES = 8 << 20  # the longest line of a stream of events (a token's event is a few hundred bytes)


class ServerError(QuipuError):
    """The server could not be used, or failed mid-reply (`partial` holds what came first: a
    `chat_api.ChatReply`, an `engine.base.Completion`)."""

    def __init__(self, message: str, *, partial: Any = None, status: int = 0):
        super().__init__(message)
        self.partial = partial
        self.status = status  # the HTTP status that said no, if one did


@dataclass(frozen=True)
class ServerSettings:
    url: str
    model: str | None = None  # None: the server's only (or first) model
    api_key_env: str = "QUIPU_API_KEY"
    connect_timeout: float = 10.0
    read_timeout: float = 600.0  # the longest wait for the next event: a long prompt is read first
    retries: int = 3
    backoff: float = 0.5  # seconds before the first retry, doubled each time



class ServerClient:
    """An HTTP server quipu talks to: its requests, tried again where a failure may pass, every
    fault one line; the stream of events a reply comes in; the models it lists."""

    def __init__(self, settings: ServerSettings):
        import httpx

        self.settings = settings
        # (an OpenAI-style client's base URL, which ends in /v1 as servers print it, names the same server)
        self.base = settings.url.rstrip("/").removesuffix("/v1")
        if not self.base.startswith(("http://", "https://")):
            raise ServerError(f"the server address must start with http:// or https://, not '{settings.url}'")
        self._httpx = httpx
        self._client = self._connect()
        self._model = settings.model

    def _connect(self) -> Any:
        httpx, settings = self._httpx, self.settings
        return httpx.Client(timeout=httpx.Timeout(settings.read_timeout, connect=settings.connect_timeout),
                            follow_redirects=True)

    def close(self) -> None:
        """Lets the connections go; a later request opens new ones."""
        self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _headers(self) -> dict[str, str]:
        key = os.environ.get(self.settings.api_key_env)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def where(self) -> str:
        return f"the server at {self.base}"

    def request(self, method: str, path: str, body: dict[str, Any] | None = None, *, stream: bool = False) -> Any:
        """The response (opened for streaming when asked), after the retries a failure may earn."""
        httpx = self._httpx
        pause = self.settings.backoff
        if self._client.is_closed:
            self._client = self._connect()
        for attempt in range(self.settings.retries + 1):
            last = attempt == self.settings.retries
            try:
                request = self._client.build_request(method, self.base + path, json=body, headers=self._headers())
                response = self._client.send(request, stream=stream)
            except httpx.ConnectError as exc:
                if last or "Name or service not known" in str(exc) or "nodename nor servname" in str(exc):
                    raise ServerError(f"cannot reach {self.where()}: {_reason(exc)}") from None
            except httpx.ConnectTimeout:
                raise ServerError(f"{self.where()} did not take the connection within "
                                  f"{self.settings.connect_timeout:g} s") from None
            except httpx.TimeoutException:
                raise ServerError(f"{self.where()} did not answer within {self._timeout_said()}") from None
            except httpx.HTTPError as exc:
                raise ServerError(f"the request to {self.where()} failed: {_reason(exc)}") from None
            else:
                if response.status_code < 400:
                    return response
                if last or response.status_code not in RETRY_STATUSES:
                    raise self._http_error(response)
                response.close()
            time.sleep(pause)
            pause *= 2
        raise AssertionError("unreachable")

    def _timeout_said(self) -> str:
        return f"{self.settings.read_timeout:g} s"

    def _http_error(self, response: Any) -> ServerError:
        try:
            response.read()
            body = response.json()
        except Exception:  # a body that is not JSON (a proxy's page): its start is the message
            body = response.text[:200] if hasattr(response, "text") else ""
        finally:
            response.close()
        said = _server_message(body)
        code = response.status_code
        status = f"{code} {response.reason_phrase}".strip()
        if code in (401, 403):
            held = self.settings.api_key_env
            key = "the key in $" + held if os.environ.get(held) else f"no key (set ${held})"
            return ServerError(f"{self.where()} refused the request ({status}) with {key}"
                               f"{': ' + said if said else ''}", status=code)
        if code == 404:
            return ServerError(f"{self.where()} has no such model or endpoint ({status})"
                               f"{': ' + said if said else ''}", status=code)
        return ServerError(f"{self.where()} answered {status}{': ' + said if said else ''}", status=code)

    def request_json(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        response = self.request(method, path, body)
        try:
            return response.json()
        except ValueError:
            raise ServerError(f"{self.where()} did not answer {path} with JSON") from None

    def models(self) -> list[dict[str, Any]]:
        """The server's models (`/v1/models`): each with at least an `id`."""
        data = self.request_json("GET", "/v1/models")
        items = data.get("data") if isinstance(data, dict) else None
        if not isinstance(items, list):
            raise ServerError(f"{self.where()} answered /v1/models with something else than a model list")
        return [m for m in items if isinstance(m, dict) and isinstance(m.get("id"), str)]

    def model_name(self) -> str:
        """The model asked for, else the server's first."""
        if self._model is None:
            models = self.models()
            if not models:
                raise ServerError(f"{self.where()} lists no model")
            self._model = models[0]["id"]
        return self._model

    def events(self, response: Any, partial: Callable[[], Any], last: Callable[[dict[str, Any]], bool]) -> Iterator[dict[str, Any]]:
        """The JSON objects of a stream of server-sent events, to `[DONE]` or an event `last` says
        is the last. Every fault is a ServerError carrying `partial()`, what came before it."""
        httpx = self._httpx
        finished = False
        try:
            for line in self._lines(response, partial):
                if not line.startswith("data:"):
                    continue  # comments (pings), event names, blank separators
                data = line[5:].strip()
                if data == "[DONE]":
                    finished = True
                    break
                try:
                    event = json.loads(data)
                except ValueError:
                    raise ServerError(f"{self.where()} sent an event that is not JSON: {data[:80]!r}",
                                      partial=partial()) from None
                if not isinstance(event, dict):
                    raise ServerError(f"{self.where()} sent an event that is not an object", partial=partial())
                if "error" in event:
                    raise ServerError(f"{self.where()} failed mid-reply: {_server_message(event)}",
                                      partial=partial())
                yield event
                if last(event):
                    finished = True
                    break
        except httpx.TimeoutException:
            raise ServerError(f"{self.where()} sent nothing for {self._timeout_said()} mid-reply",
                              partial=partial()) from None
        except httpx.HTTPError as exc:
            raise ServerError(f"{self.where()} cut the reply short: {_reason(exc)}", partial=partial()) from None
        if not finished and not getattr(partial(), "finish_reason", ""):
            raise ServerError(f"{self.where()} closed the stream before the reply was over", partial=partial())

    def _lines(self, response: Any, partial: Callable[[], Any]) -> Iterator[str]:
        """The stream's lines, each held only up to MAX_EVENT_BYTES: a server that never ends a
        line is an error, not a process that grows until it is killed."""
        held = b""
        for chunk in response.iter_bytes():
            held += chunk
            start = 0
            while (end := held.find(b"\n", start)) >= 0:
                yield held[start:end].rstrip(b"\r").decode("utf-8", "replace")
                start = end + 1
            held = held[start:]
            if len(held) > MAX_EVENT_BYTES:
                raise ServerError(f"{self.where()} sent an event longer than {MAX_EVENT_BYTES >> 20} MB",
                                  partial=partial())
        if held:
            yield held.rstrip(b"\r").decode("utf-8", "replace")


def download(url: str, max_bytes: int, timeout: float = 60.0,
             stopped: Callable[[], bool] = lambda: False) -> tuple[bytes, str]:
    """A file from the web (an attachment given by URL): its bytes and its content type, read
    within `max_bytes` (decoded: a body sent compressed, once or many times, is inflated a piece
    at a time and given up past the bound) and `timeout` seconds in all, its headers included,
    redirects followed (five at most). It is fetched in a thread of its own, so that the caller
    acts on `stopped` (Ctrl-C, SIGTERM) and the deadline whatever the server does. Too large is
    a UsageError; a failure on the way a ServerError; each one line; stopped, `Interrupted`."""
    import httpx

    from quipu import __version__
    from quipu.engine.base import waited

    client = httpx.Client(follow_redirects=True, max_redirects=5, timeout=httpx.Timeout(timeout, connect=10.0),
                          headers={"User-Agent": f"quipu/{__version__}", "Accept-Encoding": "identity"})
    try:
        return waited(lambda: _fetch(client, url, max_bytes), stopped, f"stopped while {url} was fetched", timeout)
    except TimeoutError:
        raise ServerError(f"cannot attach {url}: it took more than {timeout:g} s to come") from None
    finally:
        try:
            client.close()  # (a fetch still under way ends with an error nobody waits for)
        except Exception:  # noqa: BLE001 - closed from another thread: whatever it says
            pass


# A body's content encodings quipu inflates itself (zlib's window bits for each).
_ENCODINGS = {"gzip": 31, "x-gzip": 31, "deflate": 15}
_PIECE = 64 << 10  # the most one step of inflating makes


def _fetch(client: Any, url: str, max_bytes: int) -> tuple[bytes, str]:
    import zlib

    import httpx

    from quipu.errors import UsageError

    too_large = UsageError(f"cannot attach {url}: it is larger than {max_bytes >> 20} MB")
    try:
        with client.stream("GET", url) as response:
            if response.status_code >= 400:
                raise ServerError(f"cannot attach {url}: it answered {response.status_code} "
                                  f"{response.reason_phrase}".rstrip(), status=response.status_code)
            encodings = [e.strip().lower() for e in response.headers.get("content-encoding", "").split(",")
                         if e.strip() and e.strip().lower() != "identity"]
            unknown = [e for e in encodings if e not in _ENCODINGS]
            if unknown or len(encodings) > 4:
                raise ServerError(f"cannot attach {url}: it is sent in an encoding quipu does not read "
                                  f"({', '.join(encodings)[:80]})")
            declared = response.headers.get("content-length", "")
            if not encodings and declared.isascii() and declared.isdigit() and int(declared) > max_bytes:
                raise too_large
            layers = [zlib.decompressobj(_ENCODINGS[e]) for e in reversed(encodings)]
            data = bytearray()

            def take(i: int, piece: bytes) -> None:
                """`piece` through layer i and those after it, into `data`, a bounded step at a time."""
                if i == len(layers):
                    data.extend(piece)
                    if len(data) > max_bytes:
                        raise too_large
                    return
                while piece:
                    out = layers[i].decompress(piece, _PIECE)
                    take(i + 1, out)
                    piece = layers[i].unconsumed_tail

            for chunk in response.iter_raw():
                take(0, chunk)
            return bytes(data), response.headers.get("content-type", "")
    except httpx.TooManyRedirects:
        raise ServerError(f"cannot attach {url}: it redirects more than five times") from None
    except zlib.error:
        raise ServerError(f"cannot attach {url}: its compressed body is damaged") from None
    except httpx.HTTPError as exc:
        raise ServerError(f"cannot attach {url}: {_reason(exc)}") from None


def count_of(value: Any) -> int:
    """A count a server reported; what is not one counts as nothing (the figures are the server's)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _server_message(body: Any) -> str:
    """The message a server put in its error body (OpenAI's shape, and a few others)."""
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict):
            message = error.get("message") or error.get("detail") or ""
            return str(message)[:300]
        if isinstance(error, str):
            return error[:300]
        if "detail" in body:
            return str(body["detail"])[:300]
    if isinstance(body, str):
        return body.strip()[:200]
    return ""


def _reason(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    if "Connection refused" in text or "Errno 111" in text:
        return "connection refused"
    if "Name or service not known" in text or "nodename nor servname" in text or "Temporary failure in name" in text:
        return "the host name does not resolve"
    return text.splitlines()[0][:200]
