"""Servers on loopback for the tests: llama-cpp-python's own, llama.cpp's llama-server built from
the sources llama-cpp-python vendors (`python -m bench.llamacpp llama-server`), `fake`, a chat
completions server whose faults a test picks, and quipu's own (`quipu_serve`, with the `openai`
client of it and a request of that client, `ask`).

Locally a missing llama-server skips its tests with the reason; where QUIPU_REQUIRE_SERVERS=1
(CI) it fails them instead."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest


@dataclass
class Server:
    url: str
    slots: Path | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(proc, url: str, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text(errors='replace')[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)  # still loading: asked again, the outcome does not hang on this
    raise RuntimeError(f"the server did not come up: {log.read_text(errors='replace')[-2000:]}")


def serve(cmd: list[str], ready: str, port: int, log: Path):
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=sink, stdin=subprocess.DEVNULL)
    try:
        wait_until_up(proc, f"http://127.0.0.1:{port}{ready}", log)
    except BaseException:
        proc.kill()
        raise
    return proc


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _llama_cpp_python(bundled_model, tmp_path_factory, *extra: str):
    """llama-cpp-python's own server on the bundled model, on loopback, until the module is done."""
    pytest.importorskip("uvicorn", reason="llama-cpp-python[server] is in the test extras")
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "log.txt"
    proc = serve([sys.executable, "-m", "llama_cpp.server", "--model", str(bundled_model), "--host", "127.0.0.1",
                  "--port", str(port), "--n_ctx", "2048", "--n_threads", "2", *extra], "/v1/models", port, log)
    yield f"http://127.0.0.1:{port}"
    stop(proc)


@pytest.fixture(scope="module")
def function_calling_server(bundled_model, tmp_path_factory):
    """llama-cpp-python's server with its function-calling chat format: tools over the chat API."""
    yield from _llama_cpp_python(bundled_model, tmp_path_factory, "--chat_format", "chatml-function-calling")


@pytest.fixture(scope="module")
def llama_cpp_python_server(bundled_model, tmp_path_factory):
    yield from _llama_cpp_python(bundled_model, tmp_path_factory, "--model_alias", "smollm2")


def llama_server_program() -> Path:
    """llama.cpp's llama-server, built from the vendored sources; the test is skipped without it
    (and fails where CI requires the servers)."""
    from bench.llamacpp import program

    exe = program("llama-server")
    if exe is None:
        reason = "llama-server is not built here (python -m bench.llamacpp llama-server builds it)"
        if os.environ.get("QUIPU_REQUIRE_SERVERS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return exe


@pytest.fixture(scope="module")
def llama_server(bundled_model, tmp_path_factory):
    exe = llama_server_program()
    port = free_port()
    base = tmp_path_factory.mktemp("llama-server")
    slots = base / "slots"
    slots.mkdir()
    proc = serve([str(exe), "-m", str(bundled_model), "--host", "127.0.0.1", "--port", str(port), "-c", "8192",
                  "-np", "2", "-t", "2", "--slot-save-path", str(slots), "--no-webui"],
                 "/health", port, base / "log.txt")
    yield Server(f"http://127.0.0.1:{port}", slots)
    stop(proc)


# ---- a chat completions server whose behaviour the test picks ------------------------------------

WORDS = ["Hello", ",", " world", "!", " The", " sky", " is", " blue", "."]


def chunk(text: str | None = None, finish: str | None = None, usage: dict | None = None) -> bytes:
    event = {"id": "x", "object": "chat.completion.chunk", "model": "fake-model",
             "choices": [] if usage else [{"index": 0, "delta": {"content": text} if text else {},
                                           "finish_reason": finish}]}
    if usage:
        event["usage"] = usage
    return f"data: {json.dumps(event)}\n\n".encode()


def usage_of(body: dict, completion_tokens: int) -> dict:
    """What the fake server counts of a request: a token a character of the messages' text and
    1,000 more (so that a count a client made up itself could not pass for the server's), the
    first message's characters held in its cache, and 500 more pieces than it sent."""
    texts = [m.get("content") or "" for m in body.get("messages", [])]
    return {"prompt_tokens": 1000 + sum(map(len, texts)), "completion_tokens": 500 + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": len(texts[0]) if texts else 0}}


class Faulty(BaseHTTPRequestHandler):
    """A chat completions server whose behaviour the test picks (`server.mode`)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self.reply(200, {"object": "list", "data": [{"id": "fake-model", "owned_by": "tests",
                                                         "meta": {"n_vocab": 4096}}]})
        elif self.path == "/props" and self.server.llama:
            self.reply(200, {"default_generation_settings": {"n_ctx": 512}, "total_slots": 1,
                             "model_path": "/models/fake.gguf", "chat_template": None, "bos_token": "",
                             "eos_token": ""})
        else:
            self.reply(404, {"error": {"message": "no such route"}})

    def do_POST(self) -> None:
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server.requests.append((body, self.headers.get("Authorization")))
        mode = server.mode
        if self.path == "/fuzz-seed":  # the fuzz's client says which events to draw next
            server.seed = body["seed"]
            return self.reply(200, {})
        if mode == "random" and self.path in ("/completion", "/v1/chat/completions"):
            return self.random_events()
        if self.server.llama and self.path in ("/tokenize", "/detokenize", "/completion"):
            return self.llama_server(body, mode)
        if self.path == "/v1/embeddings":
            vectors = [{"index": i, "embedding": [3.0, 4.0 + i]} for i in range(len(body["input"]))][::-1]
            return self.reply(200, {"object": "list", "data": vectors if mode == "ok" else []})
        if mode == "retry-then-ok" and len(server.requests) < 3:
            return self.reply(503, {"error": {"message": "loading the model"}})
        if mode in ("401", "403"):
            return self.reply(int(mode), {"error": {"message": "invalid api key"}})
        if mode == "404":
            return self.reply(404, {"error": {"message": f"model '{body['model']}' not found"}})
        if mode in ("429", "500"):
            return self.reply(int(mode), {"error": {"message": "the server is busy" if mode == "429" else "boom"}})
        if mode == "html":
            return self.reply(502, "<html>bad gateway</html>")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        words = WORDS[: body.get("max_tokens", len(WORDS))]
        for i, word in enumerate(words):
            if mode == "cut" and i == 4:
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if mode == "malformed" and i == 4:
                self.wfile.write(b"data: {not json\n\n")
                self.wfile.flush()
                return
            if mode == "endless" and i == 4:  # an event that never ends (until the client lets go)
                try:
                    for _ in range(64):
                        self.wfile.write(b"data: " + b"x" * (1 << 20))
                        self.wfile.flush()
                except OSError:
                    pass
                return
            if mode == "badtypes" and i == 4:  # a piece that is not text, after four that are
                event = {"choices": [{"index": 0, "delta": {"content": 5}, "finish_reason": None}]}
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
                return
            if mode == "stall" and i == 4:
                self.wfile.flush()
                server.release.wait(60)
                return
            self.wfile.write(b": ping\n\n" if i == 2 else b"")
            self.wfile.write(chunk(word))
            self.wfile.flush()
        finish = "length" if len(words) < len(WORDS) else "stop"
        self.wfile.write(chunk(finish=finish))
        counts = ({"prompt_tokens": "many", "completion_tokens": None, "prompt_tokens_details": "x"}
                  if mode == "badcounts" else usage_of(body, len(words)))
        self.wfile.write(chunk(usage=counts))
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def random_events(self) -> None:
        """A stream of events drawn from `server.seed`: the shapes a server sends, with any value
        in any place, sometimes not JSON, sometimes no end."""
        import random

        rng = random.Random(self.server.seed)

        def value(depth=0):
            kinds = ["none", "int", "float", "text", "bool"] + (["list", "dict"] if depth < 3 else [])
            kind = rng.choice(kinds)
            if kind == "int":
                return rng.choice([0, 1, -1, 5, 2**40, 10**30])
            if kind == "float":
                return rng.choice([0.5, -1.0, 1e308])
            if kind == "text":
                return rng.choice(["", "hi", " world", "<|im_end|>", "\u2603", "x" * 100])
            if kind == "bool":
                return rng.choice([True, False])
            if kind == "list":
                return [value(depth + 1) for _ in range(rng.randrange(3))]
            if kind == "dict":
                keys = ["choices", "delta", "content", "finish_reason", "usage", "prompt_tokens", "timings",
                        "tokens", "stop", "stop_type", "tokens_predicted", "tokens_evaluated", "model", "error",
                        "cache_n", "prompt_ms"]
                return {rng.choice(keys): value(depth + 1) for _ in range(rng.randrange(4))}
            return None

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        try:
            self._random_stream(rng, value)
        except OSError:
            pass  # the client let go (it may, on a stream that makes no sense)

    def _random_stream(self, rng, value) -> None:
        for _ in range(rng.randrange(8)):
            shape = rng.randrange(6)
            if shape == 0:
                event = {"choices": [{"delta": {"content": value()}, "finish_reason": value()}]}
            elif shape == 1:
                event = {"content": value(), "tokens": [rng.choice([5, -1, 10**9])], "stop": value(),
                         "tokens_predicted": value(), "tokens_evaluated": value(), "timings": value()}
            elif shape == 2:
                event = {"usage": value(), "timings": value(), "choices": value()}
            else:
                event = value()
            data = json.dumps(event) if rng.randrange(10) else "{not json"
            self.wfile.write(f"data: {data}\n\n".encode())
        if rng.randrange(2):
            self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def llama_server(self, body: dict, mode: str) -> None:
        """llama-server's token endpoints, for a vocabulary of one token a character (id: its code)."""
        if self.path == "/tokenize":
            return self.reply(200, {"tokens": [{"id": ord(c), "piece": c} for c in body["content"]]})
        if self.path == "/detokenize":
            return self.reply(200, {"content": "".join(chr(t) for t in body["tokens"])})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        text = "".join(WORDS)[: body["n_predict"]]
        # The prompt: token ids, then maybe text (a token a character), counted in every event.
        evaluated = sum(1 if isinstance(p, int) else len(p) for p in body["prompt"]) + (mode == "miscount")
        for i, c in enumerate(text):
            if mode == "cut" and i == 6:
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            event = {"content": c, "tokens": [ord(c)], "stop": False, "tokens_predicted": i + 1,
                     "tokens_evaluated": evaluated}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.flush()
        end = {"content": "", "tokens": [], "stop": True, "stop_type": "limit", "tokens_evaluated": evaluated,
               "timings": {"cache_n": 0, "prompt_ms": 1.0, "predicted_ms": 2.0}}
        self.wfile.write(f"data: {json.dumps(end)}\n\n".encode())
        self.wfile.flush()

    def reply(self, status: int, body) -> None:
        data = (json.dumps(body) if not isinstance(body, str) else body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if not isinstance(body, str) else "text/html")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fake():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Faulty)
    server.mode = "ok"
    server.seed = 0  # (mode "random": the events drawn)
    server.llama = False  # True: also llama-server's /props and token endpoints
    server.requests = []
    server.release = threading.Event()
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()


# ---- quipu's own server ------------------------------------------------------------------------

# A tool in the shape Ollama's client sends one in: its keys in this order, nothing more.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, today.",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}}}}
SYSTEM = "You are a patient tutor who answers every question in one short, plain sentence. " * 12


@contextlib.contextmanager
def quipu_serve(home, model, *args, tmp_path):
    """`quipu serve` of `model` on a free loopback port (its `QUIPU_HOME` `home`), until the block
    is done; its log must hold no traceback."""
    port = free_port()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ["QUIPU_HOME"] = str(home)
    log = tmp_path / f"serve-{port}.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "quipu", "serve", "-m", str(model), "--port", str(port),
                                 *map(str, args)], stdout=sink, stderr=sink, stdin=subprocess.DEVNULL, env=environ)
    try:
        wait_until_up(proc, f"http://127.0.0.1:{port}/health", log, timeout=120)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "Traceback" not in log.read_text(errors="replace")


def openai_client(url, key="none"):
    """The official `openai` client of a server at `url`."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def ask(c, messages, **more):
    """A chat request of the client `c`, greedy and short unless told."""
    return c.chat.completions.create(model=c.models.list().data[0].id, messages=messages,
                                     **{"temperature": 0, "max_tokens": 8, **more})
