"""Where a model's layers go: on the GPU as many as fit in its free memory, the rest on the CPU.

llama.cpp counts a model's layers as its repeating blocks and one more, the output layer, which is
the first to go to the device (`-ngl 1` puts the output layer there, `-ngl k` it and the last
k - 1 blocks; the token embeddings stay on the host). What a layer takes is read from the file's
tensor table (each tensor's bytes, as ggml sizes its type) and from the cache it keeps (its K and
V rows for every cell of the context); what the device's compute buffers take is measured, as
llama.cpp's own `--fit` measures it (`common/fit.cpp`): a load of the model and a context on it
with `no_alloc`, which plans every buffer and allocates none. The fit keeps a margin of the
device's free memory (1 GiB, as llama.cpp's) and, where asked, to a cap (--gpu-memory)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from quipu.engine.settings import ALL, AUTO, CPU, CTX_AUTO, DEFAULT_CTX_CAP, Offload, Placement, Share, human_bytes, off_device
from quipu.engine.devices import Device, amx_built, devices, offload_devices, row_bytes
from quipu.engine.logs import LOG
from quipu.engine.native import lc
from quipu.engine.ring import ring_size
from quipu.errors import ModelLoadError, UsageError

if TYPE_CHECKING:
    from quipu.gguf import GGUFInfo

MARGIN = 1 << 30  # of a device's free memory left alone, as llama.cpp's fit leaves
_KV_BYTES = {"f16": 2.0, "q8_0": 34 / 32}


def chosen_devices(asked: tuple[str, ...] | None, found: list[Device]) -> list[Device]:
    """The devices layers may go to: --device's (by name, any case), or every GPU llama.cpp uses."""
    gpus = offload_devices(found)
    if asked is None:
        return gpus
    if off_device(asked):
        return []
    by_name = {d.name.lower(): d for d in found if d.kind in ("gpu", "igpu")}
    chosen = []
    for name in asked:
        device = by_name.get(name.lower())
        if device is None:
            known = ", ".join(d.name for d in found if d.kind in ("gpu", "igpu")) or "none but the CPU"
            raise UsageError(f"--device: no device '{name}' here (the devices: {known}; none: the CPU alone)")
        if device not in chosen:
            chosen.append(device)
    return chosen


@dataclass(frozen=True)
class Layers:
    """What each of a model's layers takes on a device: its repeating blocks' weights and the
    cache each keeps, then the output layer's weights."""

    weights: tuple[int, ...]
    caches: tuple[int, ...]  # each block's K and V for every cell it keeps (a window layer's: its ring's)
    output: int
    embed: int = 0  # the token embeddings, which stay on the host
    tied: bool = False  # the output layer reads them (llama.cpp copies them to its device)

    @property
    def count(self) -> int:
        return len(self.weights) + 1

    def blocks_on(self, k: int) -> int:
        """How many blocks `-ngl k` puts on the device: the last k - 1 (the output layer goes first)."""
        return max(0, min(k, self.count) - 1)

    def model_on(self, k: int) -> int:
        """The weights `-ngl k` puts on the device: the output layer's, then the last k - 1 blocks'."""
        n = self.blocks_on(k)
        output = self.output + (self.embed if self.tied else 0)
        return (output if k > 0 else 0) + (sum(self.weights[len(self.weights) - n:]) if n else 0)

    def cache_on(self, k: int) -> int:
        """The cache of the blocks `-ngl k` puts on the device."""
        n = self.blocks_on(k)
        return sum(self.caches[len(self.caches) - n:]) if n else 0

    def cache_off(self, k: int) -> int:
        """The cache of the blocks `-ngl k` leaves on the host."""
        return sum(self.caches[:len(self.caches) - self.blocks_on(k)])

    def on_device(self, k: int) -> int:
        return self.model_on(k) + self.cache_on(k)

    def most_that_fit(self, budget: int) -> int:
        k = 0
        while k < self.count and self.on_device(k + 1) <= budget:
            k += 1
        return k


def _int_of(value: Any) -> int | None:
    """A metadata number, or the largest of an array's first items (a per-layer head count)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    head = getattr(value, "head", None)
    return max((v for v in head if isinstance(v, int)), default=None) if head else None


def read_table(path: Path) -> "GGUFInfo":
    from quipu.gguf import GGUFError, read_gguf

    try:
        return read_gguf(path)
    except GGUFError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None


# Architectures whose llama.cpp graph cannot decode several sequences in one step: PLaMo-2's Mamba
# blocks store the states of a step's sequences at a place that counts them twice (two answer
# wrongly, three abort in ggml).
_SEQUENCES_AT_ONCE = {"plamo2": 1}


def sequences_bound(arch: str) -> int | None:
    """The most sequences llama.cpp decodes side by side on an architecture, where it has such a
    bound (None: as many as a context holds)."""
    return _SEQUENCES_AT_ONCE.get(arch)


def sequences_at_once(path: Path) -> tuple[str, int] | None:
    """The architecture of the model file `path` (read from its header, before it loads) and its
    `sequences_bound`, where it has one."""
    arch = read_table(path).architecture
    most = sequences_bound(arch)
    return None if most is None else (arch, most)


# The window layers of a sliding-window architecture whose file does not list them: all but each
# n-th block, the last of every n (llama.cpp's `set_swa_pattern` for each, in src/models/).
_WINDOW_EVERY = {"gemma2": 2, "gemma3": 6, "gemma3n": 5, "gemma-embedding": 6, "cohere2": 4, "gpt-oss": 2,
                 "exaone4": 4, "olmo2": 4, "llama4": 4, "afmoe": 4, "plamo3": 8}


def window_blocks(info: "GGUFInfo") -> tuple[int, list[bool]]:
    """A sliding-window model's window (0: none) and which of its blocks attend through it, as
    its file says or its architecture has them; all of them full where neither says."""
    meta, arch = info.metadata, info.architecture
    n_block = _int_of(meta.get(f"{arch}.block_count")) or 0
    window = _int_of(meta.get(f"{arch}.attention.sliding_window")) or 0
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    listed = getattr(pattern, "head", None)
    if window <= 0:
        return 0, [False] * n_block
    if isinstance(listed, (list, tuple)) and len(listed) >= n_block:
        return window, [bool(v) for v in listed[:n_block]]
    every = pattern if isinstance(pattern, int) and not isinstance(pattern, bool) else _WINDOW_EVERY.get(arch, 0)
    if every <= 0:
        return window, [False] * n_block
    return window, [i % every < every - 1 for i in range(n_block)]


def _cells(n_ctx: int) -> int:
    """The cells llama.cpp's cache has for a context of `n_ctx` (padded to 256)."""
    return -(-max(1, n_ctx) // 256) * 256


def layer_sizes(info: "GGUFInfo", n_ctx: int, kv_type: str, ring: Callable[[int], int] | None = None) -> Layers:
    """Each layer's bytes on a device for a context of `n_ctx` cells, from the file's tensor table
    and its attention's shape; a window layer's cache is `ring(window)` cells (None: every cell,
    as --swa-full keeps)."""
    meta, arch = info.metadata, info.architecture
    n_block = _int_of(meta.get(f"{arch}.block_count")) or 0
    weights = [0] * n_block
    output = embed = 0
    for t in info.tensors:
        n = 1
        for d in t.dims[1:]:
            n *= d
        size = row_bytes(t.ggml_type, t.dims[0] if t.dims else 1) * n
        parts = t.name.split(".")
        if parts[0] == "blk" and len(parts) > 1 and parts[1].isascii() and parts[1].isdigit() \
                and int(parts[1]) < n_block:
            weights[int(parts[1])] += size
        elif parts[0] in ("output", "output_norm"):
            output += size
        elif parts[0] == "token_embd":
            embed = size
    tied = not any(t.name == "output.weight" for t in info.tensors)
    n_embd = _int_of(meta.get(f"{arch}.embedding_length")) or 0
    n_head = _int_of(meta.get(f"{arch}.attention.head_count")) or 1
    n_head_kv = _int_of(meta.get(f"{arch}.attention.head_count_kv")) or n_head
    k_len = _int_of(meta.get(f"{arch}.attention.key_length")) or n_embd // max(1, n_head)
    v_len = _int_of(meta.get(f"{arch}.attention.value_length")) or k_len
    cells = _cells(n_ctx)
    window, windowed = window_blocks(info)
    # (each block's KV heads where the file lists them: none in a block without attention)
    listed = getattr(meta.get(f"{arch}.attention.head_count_kv"), "head", None)
    heads = [v if isinstance(v, int) else n_head_kv for v in listed[:n_block]] \
        if isinstance(listed, list) and len(listed) >= n_block else [n_head_kv] * n_block
    per_cell = [h * (k_len + v_len) * _KV_BYTES.get(kv_type, 2.0) for h in heads]
    ring_cells = min(cells, ring(window)) if ring is not None and window else cells
    windowed = [*windowed[:n_block], *[False] * (n_block - len(windowed))]
    caches = [int((ring_cells if w else cells) * c) for w, c in zip(windowed, per_cell, strict=True)]
    recurrent = recurrent_blocks(info)
    if recurrent is not None:  # (a recurrent block keeps its state, of the context's sequences, and no cell,
        # but where its attention runs beside it: Falcon-H1's)
        both = arch in ATTENTION_BESIDE
        caches = [RECURRENT_SEQS * recurrent[0] + (c if both else 0) if r else c
                  for c, r in zip(caches, recurrent[1], strict=False)]
    own = cached_blocks(arch, n_block, _int_of(meta.get(f"{arch}.attention.shared_kv_layers")) or 0)
    return Layers(tuple(weights), tuple(c if i < own else 0 for i, c in enumerate(caches)), output, embed, tied)


def measure_compute(path: Path, handles: Sequence[int], cparams: Any) -> dict[str, int]:
    """What the compute buffers of a context with `cparams` take on every layer offloaded to
    `handles`, by buffer type: a model and context loaded with `no_alloc` (no weights read, no
    memory taken), as llama.cpp's fit measures."""
    mparams, keep = model_params(-1, handles)
    mparams.no_alloc = True
    mparams.load_mode = lc.LLAMA_LOAD_MODE_NONE
    LOG.clear_errors()
    model = lc.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise ModelLoadError(f"llama.cpp could not read {path}{LOG.reason()}")
    try:
        ctx = lc.llama_init_from_model(model, cparams)
        if not ctx:
            raise ModelLoadError(f"llama.cpp could not plan a context for {path}{LOG.reason()}")
        lc.llama_free(ctx)
        return dict(LOG.compute)
    finally:
        lc.llama_model_free(model)
        del keep


def model_params(n_gpu_layers: int, handles: Sequence[int], split: Sequence[float] | None = None
                 ) -> tuple[Any, list[ctypes.Array[Any]]]:
    """llama.cpp's parameters for a model with `n_gpu_layers` on the devices `handles` (none: the
    CPU alone, even where the build has a GPU), spread over several as `split` says; the weights
    kept out of the CPU's extra buffer types where the build has AMX (`devices.amx_built`). With
    the arrays the parameters point into, to keep alive while the model loads."""
    mparams = lc.llama_model_default_params()
    mparams.n_gpu_layers = n_gpu_layers
    mparams.use_extra_bufts = not amx_built()
    devices = (ctypes.c_void_p * (len(handles) + 1))(*handles, None)  # (NULL-ended)
    mparams.devices = ctypes.cast(devices, ctypes.c_void_p)
    keep: list[ctypes.Array[Any]] = [devices]
    if split:
        shares = (ctypes.c_float * max(len(split), lc.llama_max_devices()))(*split)
        mparams.tensor_split = shares
        keep.append(shares)
    return mparams, keep


def plan(path: Path, asked: Offload, n_ctx: int, kv_type: str, cparams_for: Callable[[int], Any], *,
         detail: bool = False) -> Placement:
    """Where the model at `path` runs with a context of `n_ctx` cells (0: the model's, at most
    DEFAULT_CTX_CAP; CTX_AUTO: the longest that fits) made with `cparams_for(n_ctx)`: the layers
    asked for, or as many as fit; refused, before anything loads, where more layers are asked for
    than the devices' free memory can take. With `detail`, a model on the CPU alone is measured
    too (its share)."""
    found = devices()
    chosen = chosen_devices(asked.devices, found)
    if not chosen:
        if asked.layers not in (AUTO, 0):
            raise UsageError(f"--gpu-layers {asked.layers} and --device {','.join(asked.devices or ())} ask for "
                             "the GPU and the CPU alone at once: drop one")
        if not detail:
            return CPU
    info = read_table(path)
    trained = info.context_length or DEFAULT_CTX_CAP
    handles = [d.handle for d in chosen]
    host = _host(found)
    measured: dict[int, dict[str, int]] = {}  # (compute buffers by context size: a measure loads the model)

    def compute_at(cells: int) -> dict[str, int]:
        if cells not in measured:
            measured[cells] = measure_compute(path, handles, cparams_for(cells))
        return measured[cells]

    if n_ctx == CTX_AUTO:
        n_ctx = _longest_context(info, kv_type, trained, chosen, asked, host, compute_at(trained), cparams_for)
    n_ctx = n_ctx or min(trained, DEFAULT_CTX_CAP)
    layers = layer_sizes(info, n_ctx, kv_type, ring_of(cparams_for(n_ctx)))
    compute = compute_at(n_ctx)
    if not chosen:
        shares = _shares([], layers, 0, None, compute, host)
        return replace(CPU, n_layers=layers.count, shares=shares, n_ctx=n_ctx)
    budgets = _budgets(chosen, asked, compute)
    budget = sum(budgets)
    fit = layers.most_that_fit(budget)
    want = _wanted(asked, layers, fit)
    names = {d.name for d in chosen}
    where = " and ".join(sorted(names))
    free_said = " + ".join(human_bytes(d.free) for d in chosen)
    cap = f", at most {human_bytes(asked.memory)} by --gpu-memory" if asked.memory is not None else ""
    if want > fit:
        raise UsageError(f"--gpu-layers {asked.layers}: {want} layers need {human_bytes(layers.on_device(want))} "
                         f"on {where}, which has {free_said} free (less a {human_bytes(MARGIN)} margin{cap} and "
                         f"{human_bytes(sum(compute.get(n, 0) for n in names))} of compute buffers); "
                         f"{fit} fit (--gpu-layers auto)")
    note = None
    if asked.layers == AUTO and fit < layers.count:
        some = f"{fit} of the model's {layers.count} layers fit" if fit else \
            f"none of the model's {layers.count} layers fits"
        note = (f"{some} on {where} ({free_said} free{cap}); "
                f"{'the rest run' if fit else 'it runs'} on the CPU, slower")
    split = tuple(b / budget for b in budgets) if len(chosen) > 1 and budget > 0 else None
    shares = _shares(chosen, layers, want, split, compute, host)
    backend = chosen[0].backend or chosen[0].name.rstrip("0123456789")
    return Placement(backend, tuple(d.name for d in chosen), want, layers.count, shares, note, n_ctx,
                     tuple(handles), split)


def ring_of(cparams: Any) -> Callable[[int], int] | None:
    """The cells of the window cache of a context made with `cparams`, for a window (None: as
    many as the context's, `swa_full`)."""
    if cparams.swa_full:
        return None
    n_seq = cparams.n_seq_max if cparams.kv_unified else 1
    return lambda window: ring_size(window, n_seq, cparams.n_ubatch, cparams.n_ctx)


def window_cache(path: Path, n_ctx: int, kv_type: str, cparams: Any) -> dict[str, int] | None:
    """A sliding-window model's window layers in a context of `n_ctx` cells made with `cparams`:
    the window, how many of its blocks keep one, the cells each keeps (its ring's, or every one
    with `swa_full`), and their cache's bytes, beside what every position would take; None for a
    model without one."""
    info = read_table(path)
    window, windowed = window_blocks(info)
    if not window or not any(windowed):
        return None
    ring = ring_of(cparams)
    kept, every = layer_sizes(info, n_ctx, kv_type, ring), layer_sizes(info, n_ctx, kv_type)
    cache = sum(c for c, w in zip(kept.caches, windowed, strict=True) if w)
    return {"window": window, "window_layers": sum(windowed), "layers": len(windowed),
            "cells": min(_cells(n_ctx), ring(window)) if ring else _cells(n_ctx),
            "bytes": cache, "every_position_bytes": sum(c for c, w in zip(every.caches, windowed, strict=True) if w)}


def cached_blocks(arch: str, n_block: int, shared: int) -> int:
    """How many of a model's first blocks keep a cache of their own: not those that read an
    earlier block's (Gemma 3n's after its 20th, `gemma3n.cpp`; Gemma 4's small models' last
    `shared`, its `attention.shared_kv_layers`)."""
    if arch == "gemma3n" and n_block > 20:
        return 20
    return n_block - shared if 0 < shared < n_block else n_block


# The recurrent states a single-sequence context keeps (`llama_context.py`: a second sequence
# shares its cells while a turn's piece is written).
RECURRENT_SEQS = 2
# Hybrid architectures whose recurrent blocks are all but every n-th (llama.cpp's default for a file
# that lists none: `full_attention_interval`).
_ATTENTION_EVERY = {"qwen35": 4, "qwen35moe": 4, "qwen3next": 4}
# Hybrid architectures whose every block keeps a recurrent state and an attention cache beside it.
ATTENTION_BESIDE = {"falcon-h1"}


def recurrent_blocks(info: "GGUFInfo") -> tuple[int, list[bool]] | None:
    """A hybrid or recurrent model's state in each block that keeps one (a short convolution's
    last inputs, or a state space's with its convolution's, F32, one a sequence, whatever the
    context's length): its bytes, and which blocks keep one; None for a model without one."""
    meta, arch = info.metadata, info.architecture
    n_block = _int_of(meta.get(f"{arch}.block_count")) or 0
    n_embd = _int_of(meta.get(f"{arch}.embedding_length")) or 0
    l_cache = _int_of(meta.get(f"{arch}.shortconv.l_cache")) or 0
    d_conv, d_inner = (_int_of(meta.get(f"{arch}.ssm.{k}")) or 0 for k in ("conv_kernel", "inner_size"))
    d_state, n_group = (_int_of(meta.get(f"{arch}.ssm.{k}")) or 0 for k in ("state_size", "group_count"))
    wkv = _int_of(meta.get(f"{arch}.wkv.head_size")) or 0
    if wkv:  # (RWKV: its token shifts and its wkv state, in every block; no attention)
        floats = (_int_of(meta.get(f"{arch}.token_shift_count")) or 2) * n_embd + n_embd * wkv
    elif l_cache:  # (LFM2: the last inputs of a short convolution)
        floats = n_embd * (l_cache - 1)
    elif d_inner:  # (Mamba, Gated DeltaNet: a convolution's inputs and the state)
        floats = max(0, d_conv - 1) * (d_inner + 2 * n_group * d_state) + d_state * d_inner
    else:
        return None
    kv = meta.get(f"{arch}.attention.head_count_kv")
    listed = getattr(kv, "head", None)
    ff = getattr(meta.get(f"{arch}.feed_forward_length"), "head", None)
    every = _int_of(meta.get(f"{arch}.full_attention_interval")) or _ATTENTION_EVERY.get(arch, 0)
    if wkv or arch in ATTENTION_BESIDE:
        blocks = [True] * n_block
    elif isinstance(listed, (list, tuple)) and len(listed) >= n_block:
        # (a block with neither attention nor a feed-forward is a state's; Nemotron-H's with a
        # feed-forward alone keeps nothing)
        mlp = ff if arch.startswith("nemotron_h") and isinstance(ff, list) and len(ff) >= n_block else [0] * n_block
        blocks = [v == 0 and not f for v, f in zip(listed[:n_block], mlp[:n_block], strict=True)]
    elif every:
        blocks = [(i + 1) % every != 0 for i in range(n_block)]
    else:
        blocks = [True] * n_block
    return 4 * floats, blocks


def recurrent_state(path: Path, checkpoints: int, saved: int) -> dict[str, int] | None:
    """A hybrid or recurrent model's state (`recurrent_blocks`) in all, what `checkpoints` of it
    take in memory (`engine/checkpoints.py`), and what the `saved` a session keeps on disk take;
    None for a model without one."""
    found = recurrent_blocks(read_table(path))
    if found is None:
        return None
    size = found[0] * sum(found[1])
    return {"layers": sum(found[1]), "blocks": len(found[1]), "bytes": size, "checkpoints": checkpoints,
            "checkpoint_bytes": size * checkpoints, "saved": saved, "saved_bytes": size * saved}


def check_host_room(path: Path, n_ctx: int, kv_type: str, gpu_layers: int, cparams: Any) -> None:
    """Refuses, before it is made, a context whose cache on the host is more than the host's
    free memory can hold (llama.cpp would fill it, clearing the cache, until the system kills
    the process)."""
    host = _host(devices())
    if host is None or not host.free:
        return
    layers = layer_sizes(read_table(path), n_ctx, kv_type, ring_of(cparams))
    need = layers.cache_off(gpu_layers)
    if need > host.free:
        raise UsageError(f"a context of {n_ctx} tokens needs {human_bytes(need)} of cache in memory, and this machine "
                         f"has {human_bytes(host.free)} free; give a smaller --ctx (--ctx auto: the longest that fits)")


def _budgets(chosen: list[Device], asked: Offload, compute: dict[str, int]) -> list[int]:
    """What each device has for layers: its free memory less the margin (at most --gpu-memory),
    less its compute buffers."""
    budgets = []
    for d in chosen:
        room = max(0, d.free - MARGIN)
        if asked.memory is not None:
            room = min(room, asked.memory)
        budgets.append(max(0, room - compute.get(d.name, 0)))
    return budgets


def _wanted(asked: Offload, layers: Layers, fit: int) -> int:
    if asked.layers == ALL:
        return layers.count
    return fit if asked.layers == AUTO else min(int(asked.layers), layers.count)


def _longest_context(info: "GGUFInfo", kv_type: str, trained: int, chosen: list[Device], asked: Offload,
                     host: Device | None, compute: dict[str, int], cparams_for: Callable[[int], Any]) -> int:
    """--ctx auto: the longest context, in steps of 256 up to the model's training length, with
    which the layers asked for (auto: all of them) fit on the devices, or, on the CPU alone, the
    model and its cache fit in the host's free memory; never below DEFAULT_CTX_CAP (the training
    length, if shorter). `compute` is measured at the training length, the most it can be."""
    floor = min(trained, DEFAULT_CTX_CAP)
    if chosen:
        budget = sum(_budgets(chosen, asked, compute))

        def fits(n: int) -> bool:
            layers = layer_sizes(info, n, kv_type, ring_of(cparams_for(n)))
            return layers.most_that_fit(budget) >= _wanted(asked, layers, layers.count)
    else:
        room = (host.free if host else 0) - MARGIN - sum(compute.values())

        def fits(n: int) -> bool:
            layers = layer_sizes(info, n, kv_type, ring_of(cparams_for(n)))
            return layers.embed + sum(layers.weights) + layers.output + sum(layers.caches) <= room

    low, high = floor, trained  # (low fits, or is the floor)
    if fits(high):
        return high
    while high - low > 256:
        middle = (low + high) // 2 // 256 * 256
        if middle <= low:
            break
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _host(found: list[Device]) -> Device | None:
    return next((d for d in found if d.kind == "cpu"), None)


def _shares(chosen: list[Device], layers: Layers, k: int, split: tuple[float, ...] | None,
            compute: dict[str, int], host: Device | None) -> tuple[Share, ...]:
    """Each device's part of `k` layers offloaded (by `split` where there are several), then the
    host's: the token embeddings, the blocks left on the CPU, their cache and its compute buffers."""
    shares = []
    for i, d in enumerate(chosen):
        part = split[i] if split else 1.0
        shares.append(Share(d.name, round(k * part), int(layers.model_on(k) * part),
                            int(layers.cache_on(k) * part), compute.get(d.name, 0), d.free, d.total))
    n_off = len(layers.weights) - layers.blocks_on(k)
    host_compute = sum(v for name, v in compute.items() if name not in {d.name for d in chosen})
    on_cpu = layers.embed + sum(layers.weights[:n_off]) + (layers.output if k == 0 else 0)
    shares.append(Share("CPU", layers.count - k, on_cpu, layers.cache_off(k), host_compute,
                        host.free if host else 0, host.total if host else 0))
    return tuple(shares)
