"""`quipu doctor`: what this machine gives quipu (versions, the backends llama.cpp was built with,
its devices and their memory, where quipu keeps its files), how to get a GPU build where there
is none, and, for a model, where it would run and what it would take there."""

from __future__ import annotations

import shlex
import sys
from typing import Any

from quipu import __version__
from quipu.app.environment import Environment
from quipu.app.turn_options import TurnOptions, context_settings, offload
from quipu.errors import UsageError

# The CMake switch of each GPU backend llama-cpp-python can be built with.
GPU_BUILDS = (("CUDA", "NVIDIA GPUs", "-DGGML_CUDA=on"), ("Metal", "Apple Silicon", "-DGGML_METAL=on"),
              ("Vulkan", "most GPUs: AMD, Intel, NVIDIA", "-DGGML_VULKAN=on"), ("ROCm", "AMD GPUs", "-DGGML_HIP=on"))
MAC_ONLY, NOT_ON_MAC = {"Metal"}, {"CUDA", "ROCm", "Vulkan"}  # (the systems each is built on)


def install_commands(version: str) -> list[dict[str, str]]:
    """The one command per GPU backend of this system that rebuilds llama-cpp-python for it, in
    this Python (Metal on a Mac alone, the others elsewhere)."""
    python = shlex.quote(sys.executable)
    return [{"backend": name, "for": what,
             "command": f'CMAKE_ARGS="{flag}" {python} -m pip install --force-reinstall --no-deps --no-cache-dir '
                        f'llama-cpp-python=={version}'}
            for name, what, flag in GPU_BUILDS if name not in (NOT_ON_MAC if sys.platform == "darwin" else MAC_ONLY)]


def threads_report() -> dict[str, Any]:
    """The CPU threads a context computes with: at most one a physical core this process may use,
    fewer while other programs run (the count quipu would start with now), unless --threads."""
    from quipu.engine.settings import available_cpus, default_threads
    from quipu.engine.threads import free_cores, running_elsewhere

    most, cpus = default_threads(), available_cpus()
    return {"most": most, "cpus": cpus, "running_elsewhere": running_elsewhere(), "now": free_cores(most, cpus)}


def report(env: Environment, opts: TurnOptions | None = None) -> dict[str, Any]:
    """What `quipu doctor` says, as data; with `opts` naming a model (or the default one), where
    it would run with those options, and what it would take."""
    from quipu.engine import devices as dev
    from quipu.engine.native import binding_version

    binding = binding_version()
    gpu_backends = dev.gpu_backends()
    found = dev.devices()
    out: dict[str, Any] = {
        "versions": {"quipu": __version__, "llama_cpp_python": binding, "llama_cpp": dev.llama_cpp_version(),
                     "python": sys.version.split()[0]},
        "backends": dev.backends(),
        "gpu_backends": gpu_backends,
        "cpu_features": dev.cpu_features(),
        "threads": threads_report(),
        "devices": [d.to_dict() for d in found],
        "offload": dev.supports_offload(),
        "dirs": {"data": str(env.dirs.data), "config": str(env.dirs.config), "state": str(env.dirs.state),
                 "cache": str(env.dirs.cache), "sessions": str(env.dirs.sessions), "models": str(env.dirs.models)},
    }
    if not gpu_backends:
        out["install_gpu_build"] = install_commands(binding)
    elif not dev.supports_offload():
        out["problem"] = dev.no_gpu_reason()
    if opts is not None:
        out["model"] = model_report(env, opts)
    return out


def model_report(env: Environment, opts: TurnOptions) -> dict[str, Any]:
    """Where the model `opts` names would run, and what it would take on each device: measured
    as a load would plan it, nothing loaded."""
    from quipu.engine.llama import place
    from quipu.engine.llama_memory import RECURRENT_CHECKPOINTS
    from quipu.engine.llama_context import context_params
    from quipu.engine.placement import recurrent_state, window_cache
    from quipu.store.store import RECURRENT_SLOTS

    from quipu.engine.settings import KV_TYPES

    name, path = env.resolve_model(opts.model)
    settings = context_settings(opts, env)
    if settings.kv_type not in KV_TYPES:  # (what a run refuses, in the words it refuses it)
        raise UsageError(f"--kv-type must be one of {', '.join(KV_TYPES)}, not '{settings.kv_type[:40]}'")
    out: dict[str, Any] = {"name": name, "path": str(path)}
    try:
        placement = place(path, offload(opts, env), settings, detail=True)
    except UsageError as exc:  # (what a run would refuse: said, and the doctor's answer goes on)
        out["refused"] = str(exc)
        return out
    host = placement.shares[-1]
    out.update({"ctx": placement.n_ctx, "placement": {**placement.to_dict(), "summary": placement.summary()},
                "all_on_gpu": placement.on_device and placement.gpu_layers >= placement.n_layers,
                "host_fits": host.needs <= host.free})
    if placement.note:
        out["note"] = placement.note
    window = window_cache(path, placement.n_ctx, settings.kv_type, context_params(settings, placement.n_ctx))
    if window is not None:
        out["window_cache"] = window
    state = recurrent_state(path, RECURRENT_CHECKPOINTS, RECURRENT_SLOTS)
    if state is not None:
        out["recurrent_state"] = state
    return out
