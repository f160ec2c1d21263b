"""How and where a model runs, as settings: a context's (`ContextSettings`: its size, threads,
cache type and layout, and what a saved one says of them), the offload asked for (`Offload`),
and the placement found for it (`Placement`, `Share`), with the parsing of the options that give
them."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from quipu.errors import UsageError

KV_TYPES = ("f16", "q8_0")
FLASH_ATTN = ("auto", "on", "off")


# A context's size when none is asked for: the model's training context, at most this, as in
# llama.cpp's own programs. Each token of context is cache memory (23 KB on SmolLM2-135M, 128 KB
# on Llama 3 8B at f16), allocated and cleared before the first token.
DEFAULT_CTX_CAP = 4096
# `--ctx auto`: the longest context, up to the model's training length, that memory takes with the
# layers asked for (on the GPU, all of them where that is asked or fits); never below DEFAULT_CTX_CAP.
CTX_AUTO = -1
# The bounds llama.cpp holds without asserting: a context of a few cells cannot hold the two
# sequences quipu keeps in it (and a chat template's turn is longer), positions are 32-bit signed,
# and ggml starts at most GGML_MAX_N_THREADS threads (more crash it).
MIN_CTX = 16
MAX_CTX = 2**31 - 256
MAX_THREADS = 512


def check_context_bounds(n_ctx: int | None, n_threads: int | None, where: str = "--ctx") -> None:
    """Refuses, in one line, a context size or thread count llama.cpp would abort or crash on
    (whatever gave it: a flag, the config, the environment, a session)."""
    if n_ctx is not None and n_ctx != CTX_AUTO and not MIN_CTX <= n_ctx <= MAX_CTX:
        raise UsageError(f"{where} must be {'at least ' + str(MIN_CTX) if n_ctx < MIN_CTX else 'at most ' + str(MAX_CTX)} "
                         f"tokens, got {n_ctx}")
    if n_threads is not None and not 1 <= n_threads <= MAX_THREADS:
        raise UsageError(f"--threads must be {'more than 0' if n_threads < 1 else f'at most {MAX_THREADS}'} "
                         f"(llama.cpp's limit), got {n_threads}")


def parse_ctx(text: str | int, where: str = "--ctx") -> int:
    """A context size: a number of tokens more than 0, or auto (CTX_AUTO)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    elif isinstance(text, str) and text.strip().lower() == "auto":
        return CTX_AUTO
    elif isinstance(text, str) and text.strip().isascii() and text.strip().isdigit() and len(text.strip()) < 20:
        value = int(text)
    else:
        raise UsageError(f"{where} takes a number of tokens or auto, not '{text}'")
    if value <= 0:
        raise UsageError(f"{where} must be more than 0, got {value}")
    check_context_bounds(value, None, where)
    return value


def available_cpus() -> int:
    """The CPUs this process may run on (affinity), not the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def default_threads(sysfs: str = "/sys/devices") -> int:
    """The threads a context computes with unless told: as llama.cpp chooses them, one a
    physical core this process may run on (a core's hyperthread siblings share its arithmetic
    units: a second thread there waits more than it adds), on the performance cores where the
    platform says which they are (Linux's `cpu_core` on Intel's hybrid chips); every CPU it may
    use where the topology cannot be read."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return available_cpus()
    performance = _cpu_list(f"{sysfs}/cpu_core/cpus")  # (absent but on a hybrid chip)
    if performance and set(allowed) & performance:
        allowed = [cpu for cpu in allowed if cpu in performance]
    cores = set()
    for cpu in allowed:
        siblings = _cpu_list(f"{sysfs}/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        if not siblings:
            return available_cpus()
        cores.add(min(siblings))
    return max(1, len(cores))


def _cpu_list(path: str) -> set[int]:
    """A sysfs CPU list ("0-3,8,10-11") as the CPUs it names; none where it cannot be read."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return set()
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            return set()
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


@dataclass(frozen=True)
class ContextSettings:
    """What the context (and so the state bytes) depends on, plus the thread count."""

    n_ctx: int = 0  # 0: the model's training context, capped at DEFAULT_CTX_CAP; CTX_AUTO: as memory allows
    # Tokens a prefill step takes (llama.cpp's n_batch and n_ubatch): on two cores as fast as 512
    # (faster on Gemma 3), and a prompt cache entry is restored to a multiple of it (`step_start`).
    n_batch: int = 256
    n_threads: int = 0  # 0: default_threads()
    kv_type: str = "f16"
    # Sequences that share the context, each of n_ctx cells in a stream of its own, decoded together
    # (a batch's rows, a server's requests: `scheduler.py`). A sequence's state names the
    # context's streams: it is kept apart from others' (`state_key`).
    n_seq: int = 1
    flash_attn: str = "auto"  # auto (llama.cpp's choice), on or off
    # Set by the backend, not asked for: whether its cache stores V transposed (as llama.cpp
    # does for attention without flash attention); None where it is not known.
    v_trans: bool | None = None
    # A sliding-window model's window cache as big as the context (llama.cpp's swa_full), not a
    # ring of the window and a step (its programs' default, and quipu's).
    swa_full: bool = False
    # Set by the backend of a sliding-window model: "ring" for the window and a step, laid out as
    # an uninterrupted read leaves it (ring.py); "every cell" for a cache of every position, whose
    # state holds each cell where it lies (a state that held only the window's cells, as before,
    # restored them elsewhere: not bit for bit). None: a plain cache.
    window_cells: str | None = None

    def state_key(self) -> dict[str, Any]:
        """The settings a snapshot's state bytes are only valid under, and their layout."""
        key = {"n_ctx": self.n_ctx, "n_batch": self.n_batch, "kv_type": self.kv_type, "v_trans": self.v_trans}
        if self.n_seq > 1:
            key["parallel"] = self.n_seq  # (the name a server's saved states have always had)
        if self.window_cells is not None:
            key["window_cells"] = self.window_cells
        if self.swa_full and self.window_cells is not None:
            key["swa_full"] = True  # (asked for, and so kept by a session; an older quipu's "every cell" was not)
        return key


def saved_state_key(saved: dict[str, Any]) -> dict[str, Any]:
    """A state key as a snapshot's metadata holds it, with the layout of one written before the
    layout was recorded: quipu then turned flash attention off for an f16 cache (V transposed)
    and on for a quantized one."""
    return saved if "v_trans" in saved else {**saved, "v_trans": saved.get("kv_type") == "f16"}


def remembered_flash_attn(saved: dict[str, Any]) -> str:
    """The flash attention a session goes on with, from its saved state key, so that its state
    is restored as it is: off where its cache was laid out without it (V transposed), on where
    it was laid out with it (a session made on a GPU, or on the CPU before quipu turned it off
    there); quipu's choice where the layout is not known."""
    v_trans = saved_state_key(saved).get("v_trans")
    return "auto" if v_trans is None else "off" if v_trans else "on"


def layout_differs(saved: dict[str, Any], context: ContextSettings) -> str | None:
    """Why state bytes saved under `saved` (a state key) cannot be restored into a context with
    `context`'s layout, or None when they can be."""
    if context.window_cells is not None and saved.get("window_cells") is None:
        return "the saved context state holds only its sliding window's cells, which do not restore bit for bit"
    if saved.get("window_cells") != context.window_cells:
        return ("the saved context state was made with a sliding-window cache of every position (--swa-full), "
                "this context keeps a ring of the window" if saved.get("window_cells") == "every cell" else
                "the saved context state was made with a ring of the sliding window, this context keeps every "
                "position (--swa-full)")
    was = saved_state_key(saved).get("v_trans")
    if was == context.v_trans:
        return None

    def said(v_trans: bool | None) -> str:
        if v_trans is None:
            return "in a layout not known"
        return "without flash attention (V transposed)" if v_trans else "for flash attention (V not transposed)"

    return f"the saved context state was laid out {said(was)}, this context {said(context.v_trans)}"


AUTO, ALL = "auto", "all"


@dataclass(frozen=True)
class Offload:
    """Where the user asked a model to run: how many layers on the GPU (a count, `auto`: as many
    as fit, `all`), at most how many bytes of a device's memory, and on which devices (None:
    every GPU; none: the CPU alone)."""

    layers: int | str = AUTO
    memory: int | None = None
    devices: tuple[str, ...] | None = None
    fit_ctx: int = 0  # the context, in cells, the fit leaves room for (0: the first one opened on the model)


def parse_layers(text: str | int, where: str = "--gpu-layers") -> int | str:
    """N, auto or all, checked."""
    value = str(text).strip().lower()
    if value in (AUTO, ALL):
        return value
    if value.isascii() and value.isdigit() and len(value) < 7:
        return int(value)
    raise UsageError(f"{where} takes a number of layers, auto or all, not '{text}'")


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_size(text: str | int, where: str = "--gpu-memory") -> int:
    """A size in bytes: 512M, 6G, 6.5GiB, 1500000000 (K, M, G, T in powers of 1024)."""
    found = re.fullmatch(r"\s*([0-9]{1,15}(?:\.[0-9]{1,6})?)\s*([A-Za-z]{0,3})\s*", str(text))
    unit = found.group(2).lower() if found else ""
    if not found or unit not in _UNITS or float(found.group(1)) <= 0:
        raise UsageError(f"{where} takes a size, as 512M, 6G or 6.5GiB, not '{text}'")
    return int(float(found.group(1)) * _UNITS[unit])


def human_bytes(n: int) -> str:
    """1.5 GiB, 340.2 MiB, 12 B."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def off_device(asked: Sequence[str]) -> bool:
    """Whether --device asks for the CPU alone (none, or cpu)."""
    return [a.strip().lower() for a in asked] in (["none"], ["cpu"])


@dataclass(frozen=True)
class Share:
    """What one device holds: layers, and bytes of weights (model), cache (context) and compute."""

    device: str
    layers: int = 0
    model: int = 0
    context: int = 0
    compute: int = 0
    free: int = 0
    total: int = 0

    @property
    def needs(self) -> int:
        return self.model + self.context + self.compute

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "layers": self.layers, "model_bytes": self.model, "context_bytes": self.context,
                "compute_bytes": self.compute, "free_bytes": self.free, "total_bytes": self.total}


@dataclass(frozen=True)
class Placement:
    """Where a model runs: `gpu_layers` of its `n_layers` on `devices` (none: the CPU alone), by
    `backend`; what each device takes (`shares`, the host's last), and the line to say when fewer
    layers than asked went to the device."""

    backend: str = "CPU"
    devices: tuple[str, ...] = ()
    gpu_layers: int = 0
    n_layers: int = 0
    shares: tuple[Share, ...] = ()
    note: str | None = None
    n_ctx: int = 0  # the context it was fitted for (0: not measured)
    handles: tuple[int, ...] = field(default=(), compare=False)  # the ggml devices, in order
    split: tuple[float, ...] | None = field(default=None, compare=False)  # each device's share of the layers

    @property
    def on_device(self) -> bool:
        return self.gpu_layers > 0 and bool(self.devices)

    def summary(self) -> str:
        """'31/31 layers on Vulkan0', '12/31 layers on CUDA0, the rest on the CPU', 'the CPU'."""
        if not self.on_device:
            return "the CPU"
        where = ", ".join(self.devices)
        rest = "" if self.gpu_layers >= self.n_layers else ", the rest on the CPU"
        return f"{self.gpu_layers}/{self.n_layers} layers on {where}{rest}"

    def key(self) -> dict[str, Any]:
        """What a snapshot records of where it was made: the backend, devices and layers."""
        return {"backend": self.backend, "devices": list(self.devices), "gpu_layers": self.gpu_layers}

    def to_dict(self) -> dict[str, Any]:
        return {**self.key(), "layers": self.n_layers, "memory": [s.to_dict() for s in self.shares]}


CPU = Placement()
