"""Build llama.cpp's own programs from the sources that the installed llama-cpp-python vendors.

The benchmarks compare quipu with `llama-completion`, `llama-bench` and `llama-batched-bench` built from the
same llama.cpp that quipu runs on. The sdist is fetched with pip (pip's cache makes that
offline after the first time), unpacked and built once into a cache folder:

    python -m bench.llamacpp llama-completion llama-batched-bench   # prints the bin folder

`QUIPU_LLAMA_BIN` points at a folder that already holds the programs.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib.metadata import version
from pathlib import Path

# Built without AMX on x86-64, as CI's llama-cpp-python is (.ci/llama-wheel): ggml's AMX matrix
# multiplication crashes on some Sapphire Rapids machines (llama.cpp issue 20824).
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
NO_AMX = [f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}"] if platform.machine() == "x86_64" else []
TARGETS = ("llama-completion", "llama-batched-bench", "llama-bench", "llama-server", "llama-mtmd-cli")


def build_root() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "quipu-llama.cpp" / version("llama_cpp_python")


def bin_dir() -> Path:
    explicit = os.environ.get("QUIPU_LLAMA_BIN")
    return Path(explicit) if explicit else build_root() / "build" / "bin"


def program(name: str) -> Path | None:
    """The built program, or None when it has not been built."""
    path = bin_dir() / name
    return path if path.is_file() and os.access(path, os.X_OK) else None


def sources() -> Path:
    root = build_root()
    src = root / "llama.cpp"
    if (src / "CMakeLists.txt").is_file():
        return src
    root.mkdir(parents=True, exist_ok=True)
    wanted = version("llama_cpp_python")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={wanted}", "-d", tmp], check=True)
        archive = next(Path(tmp).glob("*.tar.gz"))
        prefix = f"{archive.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and len(m.name) > len(prefix)]
            for m in members:
                m.name = m.name[len(prefix):]
            partial = root / "llama.cpp.partial"
            shutil.rmtree(partial, ignore_errors=True)
            tar.extractall(partial, members=members, filter="data")
    partial.rename(src)
    return src


def build(targets: tuple[str, ...] = TARGETS) -> Path:
    missing = [t for t in targets if program(t) is None]
    if not missing:
        return bin_dir()
    src = sources()
    out = build_root() / "build"
    subprocess.run(["cmake", "-S", str(src), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DGGML_NATIVE=ON", *NO_AMX],
                   check=True, stdout=subprocess.DEVNULL)
    jobs = str(os.cpu_count() or 2)
    subprocess.run(["cmake", "--build", str(out), "--config", "Release", "-j", jobs, "--target", *missing],
                   check=True, stdout=subprocess.DEVNULL)
    return bin_dir()


if __name__ == "__main__":
    print(build(tuple(sys.argv[1:]) or TARGETS))
