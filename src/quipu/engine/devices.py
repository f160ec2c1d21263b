"""What this llama.cpp was built with and the devices it sees, through ggml's own device functions
(`ggml_backend_dev_*`, `ggml_backend_reg_*` in the `libggml` that llama-cpp-python ships)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from quipu.engine.logs import LOG
from quipu.engine.native import lc, load_ggml

# ggml_backend_dev_type
_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}


@dataclass(frozen=True)
class Device:
    """One ggml device: `name` as llama.cpp logs it (CPU, CUDA0, Vulkan0, MTL0), what it is, its
    kind (cpu, gpu, igpu: a GPU sharing the host's memory, accel: BLAS and the like) and memory."""

    name: str
    description: str
    kind: str
    backend: str  # the backend it belongs to: CPU, CUDA, Vulkan, Metal, ...
    free: int
    total: int
    handle: int  # (ggml_backend_dev_t)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "kind": self.kind, "backend": self.backend,
                "free_bytes": self.free, "total_bytes": self.total}


@lru_cache(maxsize=1)
def _lib() -> Any:
    g = load_ggml().libggml
    text, ptr, size = ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t
    for fn, args, res in (
        ("ggml_backend_dev_count", [], size), ("ggml_backend_dev_get", [size], ptr),
        ("ggml_backend_dev_name", [ptr], text), ("ggml_backend_dev_description", [ptr], text),
        ("ggml_backend_dev_type", [ptr], ctypes.c_int), ("ggml_backend_dev_backend_reg", [ptr], ptr),
        ("ggml_backend_dev_memory", [ptr, ctypes.POINTER(size), ctypes.POINTER(size)], None),
        ("ggml_backend_reg_count", [], size), ("ggml_backend_reg_get", [size], ptr),
        ("ggml_backend_reg_name", [ptr], text), ("ggml_version", [], text), ("ggml_commit", [], text),
        ("ggml_type_size", [ctypes.c_int], size), ("ggml_blck_size", [ctypes.c_int], ctypes.c_int64),
    ):
        f = getattr(g, fn)
        f.argtypes, f.restype = args, res
    _start_backends(g)
    return g


def _start_backends(g: Any) -> None:
    """Starts ggml's backends (the first call into its registry does), with what a backend writes
    to the terminal as it starts (ggml-vulkan lists the devices it finds, on stderr, not through
    llama.cpp's log) kept off quipu's stderr unless --verbose asks for llama.cpp's log."""
    import os
    import sys
    import tempfile

    LOG.install()
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # (no stderr to keep clean)
        g.ggml_backend_dev_count()
        return
    with tempfile.TemporaryFile() as said:
        os.dup2(said.fileno(), 2)
        try:
            g.ggml_backend_dev_count()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        if LOG.verbose:
            said.seek(0)
            sys.stderr.write(said.read().decode("utf-8", "replace"))
            sys.stderr.flush()


def _text(raw: bytes | None) -> str:
    return raw.decode("utf-8", "replace") if raw else ""


def devices() -> list[Device]:
    """Every device ggml sees, the CPU's included, with its memory as it is now."""
    g = _lib()
    found = []
    for i in range(g.ggml_backend_dev_count()):
        dev = g.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        g.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        reg = g.ggml_backend_dev_backend_reg(dev)
        kind = _KINDS.get(g.ggml_backend_dev_type(dev), "other")
        # (ggml says the host's whole memory is free: what the system and this process's cgroup
        # still let it take is what a context can be made of)
        room = host_available() if kind == "cpu" else None
        found.append(Device(_text(g.ggml_backend_dev_name(dev)), _text(g.ggml_backend_dev_description(dev)), kind,
                            _text(g.ggml_backend_reg_name(reg)) if reg else "",
                            min(free.value, room) if room is not None else free.value, total.value, dev))
    return found


def host_available() -> int | None:
    """The memory the host can still give this process without swapping, where the system says
    it (Linux: MemAvailable, and a cgroup's limit less its use); None elsewhere."""
    try:
        with open("/proc/meminfo", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
        room = int(fields[b"MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None
    try:
        with open("/proc/self/cgroup", "rb") as f:
            group = next((line.split(b"::", 1)[1].strip() for line in f if line.startswith(b"0::")), None)
        if group is not None:
            base = "/sys/fs/cgroup" + group.decode("utf-8", "replace")
            with open(base + "/memory.max", "rb") as f:
                limit = f.read().strip()
            if limit != b"max":
                with open(base + "/memory.current", "rb") as f:
                    room = min(room, max(0, int(limit) - int(f.read().strip())))
    except (OSError, ValueError):
        pass
    return room


def offload_devices(found: list[Device] | None = None) -> list[Device]:
    """The devices llama.cpp puts layers on: its GPUs, else a GPU that shares the host's memory."""
    found = devices() if found is None else found
    gpus = [d for d in found if d.kind == "gpu"]
    return gpus or [d for d in found if d.kind == "igpu"]


def backends() -> list[str]:
    """The backends this llama.cpp was built with (CPU, CUDA, Vulkan, Metal, BLAS, ...)."""
    g = _lib()
    return [_text(g.ggml_backend_reg_name(g.ggml_backend_reg_get(i))) for i in range(g.ggml_backend_reg_count())]


HOST_BACKENDS = ("CPU", "BLAS", "AMX", "RPC")


def gpu_backends() -> list[str]:
    """The backends of this build that drive a GPU (CUDA, Vulkan, Metal, ROCm, SYCL, ...)."""
    return [b for b in backends() if b not in HOST_BACKENDS]


def no_gpu_reason() -> str:
    """Why nothing can be offloaded here, and what to do, in words for a user."""
    built = gpu_backends()
    if built:
        return (f"this llama.cpp is built for {' and '.join(built)} but sees no such GPU; `quipu doctor` "
                "lists what it sees")
    return ("this llama.cpp is built for the CPU alone; `quipu doctor` gives the one command that installs a build "
            "for your GPU")


def supports_offload() -> bool:
    """Whether this build can put layers anywhere but the CPU."""
    _lib()
    return bool(lc.llama_supports_gpu_offload())


def llama_cpp_version() -> str:
    """ggml's version (and commit, where the build knew it): the llama.cpp these libraries are."""
    g = _lib()
    version, commit = _text(g.ggml_version()), _text(g.ggml_commit())
    return version if commit in ("", "unknown") else f"{version} ({commit})"


def cpu_features() -> list[str]:
    """The CPU features the CPU backend was built for and found (AVX2, F16C, ...), as llama.cpp lists them."""
    info = _text(lc.llama_print_system_info())
    features: list[str] = []
    for part in info.split("|"):
        name, sep, value = part.partition("=")
        name = name.split(":")[-1].strip()
        if sep and value.strip() == "1" and name and name not in features:
            features.append(name)
    return features


@lru_cache(maxsize=1)
def amx_built() -> bool:
    """Whether the CPU backend was built with AMX (-march=native on a Sapphire Rapids CPU and after).
    Its matrix multiplication crashes on some such machines (llama.cpp issue 20824): quipu then
    keeps the weights out of the extra buffer types AMX works in (`model.py`)."""
    return "AMX_INT8" in cpu_features()


def row_bytes(ggml_type: int, n: int) -> int:
    """The bytes a row of `n` values of a ggml type takes (quantized in blocks)."""
    g = _lib()
    block = g.ggml_blck_size(ggml_type)
    return g.ggml_type_size(ggml_type) * n // block if block > 0 else 0
