"""Real servers on loopback for the tests: llama-cpp-python's own, and llama.cpp's llama-server
built from the sources llama-cpp-python vendors (`python -m bench.llamacpp llama-server`).

Locally a missing llama-server skips its tests with the reason; where QUIPU_REQUIRE_SERVERS=1
(CI) it fails them instead."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
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


@pytest.fixture(scope="module")
def llama_cpp_python_server(bundled_model, tmp_path_factory):
    pytest.importorskip("uvicorn", reason="llama-cpp-python[server] is in the test extras")
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "log.txt"
    proc = serve([sys.executable, "-m", "llama_cpp.server", "--model", str(bundled_model), "--host", "127.0.0.1",
                  "--port", str(port), "--n_ctx", "2048", "--n_threads", "2", "--model_alias", "smollm2"],
                 "/v1/models", port, log)
    yield f"http://127.0.0.1:{port}"
    stop(proc)


@pytest.fixture(scope="module")
def llama_server(bundled_model, tmp_path_factory):
    from bench.llamacpp import program

    exe = program("llama-server")
    if exe is None:
        reason = "llama-server is not built here (python -m bench.llamacpp llama-server builds it)"
        if os.environ.get("QUIPU_REQUIRE_SERVERS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    port = free_port()
    base = tmp_path_factory.mktemp("llama-server")
    slots = base / "slots"
    slots.mkdir()
    proc = serve([str(exe), "-m", str(bundled_model), "--host", "127.0.0.1", "--port", str(port), "-c", "8192",
                  "-np", "2", "-t", "2", "--slot-save-path", str(slots), "--no-webui"],
                 "/health", port, base / "log.txt")
    yield Server(f"http://127.0.0.1:{port}", slots)
    stop(proc)
