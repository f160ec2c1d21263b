"""Where a local model runs, as the commands say it and sessions keep it: the placement shown in
--json and --stats, the lines said of it (fewer layers fit on the GPU; a --ctx past the training
length; a session moved from where it was saved; fewer sequences at once than asked), and a resumed session placed as it last ran."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from quipu.app.turn_options import load_backend
from quipu.engine.base import Backend
from quipu.engine.settings import AUTO, CPU, ContextSettings, Offload
from quipu.errors import UsageError


def load_where_it_ran(model_path: Path, settings: ContextSettings, verbose: bool, where: Offload,
                      saved: Any) -> Backend:
    """A resumed session's model, placed as the session last ran where that was fitted for it
    (`--gpu-layers auto`) and still fits: the same devices and layers compute the same sums, so
    the session goes on bit for bit, though the device's free memory has changed since. Where it
    no longer fits, or the devices are gone, the fit chooses again (and the resume says so)."""
    if where.layers == AUTO and isinstance(saved, dict) and isinstance(saved.get("gpu_layers"), int) \
            and saved["gpu_layers"] > 0 and isinstance(saved.get("devices"), list) and saved["devices"]:
        devices = where.devices or tuple(str(d) for d in saved["devices"])
        try:
            return load_backend(model_path, settings, verbose,
                                replace(where, layers=saved["gpu_layers"], devices=devices))
        except UsageError:
            pass  # (no room for it now, or not those devices: as the fit says)
    return load_backend(model_path, settings, verbose, where)


def sequences_capped(model_path: Path, asked: int) -> tuple[int, str | None]:
    """`asked` sequences side by side (--parallel), or fewer where llama.cpp decodes fewer at once
    on this model's architecture, and the line that says so."""
    from quipu.engine.placement import sequences_at_once

    bound = sequences_at_once(model_path) if asked > 1 else None
    if bound is None or asked <= bound[1]:
        return asked, None
    arch, most = bound
    at_once = "one sequence at a time" if most == 1 else f"at most {most} sequences at once"
    return most, f"llama.cpp decodes {at_once} on {arch} models: --parallel {asked} runs as {most}"


def placement_of(backend: Backend) -> dict[str, Any]:
    """Where a local model runs, as --json and --stats show it."""
    placement = backend.placement
    return {**placement.to_dict(), "summary": placement.summary()}


def placement_notices(backend: Backend, *, ctx_given: bool, verbose: bool) -> list[str]:
    """What to say of where the model runs: always that fewer layers than asked fit on the GPU;
    under --verbose, where it runs; and a --ctx given past what the model was trained on."""
    placement = backend.placement
    said = [placement.note] if placement.note else []
    if ctx_given and backend.n_ctx_train and backend.n_ctx > backend.n_ctx_train:
        said.append(f"--ctx {backend.n_ctx} is past the {backend.n_ctx_train} tokens this model was trained on; "
                    "past them its replies may come apart")
    return said + ([f"the model runs on {placement.summary()}"] if verbose else [])


def placement_words(key: dict[str, Any]) -> str:
    """A snapshot's recorded placement in words."""
    layers, names = key.get("gpu_layers", 0), key.get("devices") or []
    if not layers or not names:
        return "the CPU"
    return f"{layers} layers on {', '.join(str(n) for n in names)}"


def moved_notice(name: str, saved: dict[str, Any] | None, backend: Backend) -> str | None:
    """The line that says a session saved on one placement goes on on another: its context
    state is restored (the bytes are the same on every device), but the sums are made elsewhere,
    so what follows is no longer bit for bit what it would have been where it was saved."""
    was = saved if isinstance(saved, dict) else CPU.key()
    now = backend.placement.key()
    if {k: was.get(k) for k in now} == now:
        return None
    return (f"session '{name}' was saved running on {placement_words(was)} and now runs on "
            f"{placement_words(now)}: its context is restored, but from here the reply is no longer bit for bit "
            "what it would have been there")
