"""A projector file checked before llama.cpp's clip reader trusts it.

- Its keys' types, as clip.cpp reads them: gguf's getters assert the type they are asked for, so a
  key of another type aborts the process while the projector loads.
- A first image or recording encoded in a process of its own: clip.cpp loads many tensors as
  optional (a file may hold a fused alternative) that the graph of a projector's type then uses
  all the same, so a file without one loads and crashes at its first medium. What crashes there
  is said here in one line; a projector that encoded once is marked as checked (by its file, the
  text model's and llama-cpp-python's version) and not run apart again.

`python -m quipu.engine.projector_check MODEL PROJECTOR` is that process.
"""

from __future__ import annotations

import hashlib
import os
import signal
import struct
import subprocess
import sys
import zlib
from pathlib import Path

from quipu.errors import ModelLoadError

# gguf's value types (gguf.h)
U32, I32, F32, BOOL, STRING, ARRAY = 4, 5, 6, 7, 8, 9
_TYPE_WORDS = {0: "u8", 1: "i8", 2: "u16", 3: "i16", U32: "u32", I32: "i32", F32: "f32", BOOL: "bool",
               STRING: "string", ARRAY: "array", 10: "u64", 11: "i64", 12: "f64"}

# What clip.cpp (llama.cpp's tools/mtmd) reads each key as: a type, or (ARRAY, its items' type).
_PER_ENCODER: dict[str, int | tuple[int, int]] = {"embedding_length": U32, "feed_forward_length": U32, "block_count": U32, "projection_dim": U32,
                "attention.head_count": U32, "attention.head_count_kv": U32, "attention.head_dim": U32,
                "attention.layer_norm_epsilon": F32, "feature_layer": (ARRAY, I32)}
KEY_TYPES: dict[str, int | tuple[int, int]] = {
    **{f"clip.{encoder}.{key}": kind for encoder in ("vision", "audio") for key, kind in _PER_ENCODER.items()},
    "general.name": STRING, "general.description": STRING,
    "clip.projector_type": STRING, "clip.vision.projector_type": STRING, "clip.audio.projector_type": STRING,
    "clip.gen.audio.projector_type": STRING, "clip.gen.audio.model_variant": STRING,
    "clip.vision.mm_patch_merge_type": STRING,
    "clip.has_vision_encoder": BOOL, "clip.has_audio_encoder": BOOL, "clip.has_gen_audio_encoder": BOOL,
    "clip.use_gelu": BOOL, "clip.use_silu": BOOL,
    "clip.minicpmv_version": I32, "clip.minicpmv_query_num": U32,
    "clip.vision.image_mean": (ARRAY, F32), "clip.vision.image_std": (ARRAY, F32),
    "clip.vision.swiglu_clamp": F32,
    **{f"clip.vision.{key}": (ARRAY, I32) for key in ("image_grid_pinpoints", "projector.spatial_offsets",
                                                       "wa_layer_indexes", "wa_pattern_mode")},
    **{f"clip.vision.{key}": U32 for key in (
        "image_size", "image_min_pixels", "image_max_pixels", "preproc_min_tiles", "preproc_max_tiles",
        "preproc_image_size", "patch_size", "projector.scale_factor", "projector.query_side",
        "projector.window_side", "spatial_merge_size", "n_wa_pattern", "window_size", "sam.head_count",
        "sam.block_count", "sam.embedding_length", "expert_used_count")},
    "clip.audio.rvq.codebook_size": (ARRAY, I32), "clip.audio.wa_pattern_mode": (ARRAY, I32),
    **{f"clip.audio.{key}": U32 for key in (
        "num_mel_bins", "projector.stack_factor", "chunk_size", "conv_kernel_size", "max_pos_emb",
        "projector.window_size", "projector.downsample_rate", "projector.head_count", "rvq.num_quantizers",
        "window_size", "local_block_count", "local_group_size", "subsampling_factor")},
}


def _spelled(kind: int | tuple[int, int]) -> str:
    return f"an array of {_TYPE_WORDS[kind[1]]}" if isinstance(kind, tuple) else f"a {_TYPE_WORDS[kind]}"


def check_keys(path: Path) -> None:
    """Refuses a projector whose keys clip.cpp would read as another type than they are."""
    from quipu.gguf import ArrayInfo, GGUFError, read_gguf

    try:
        info = read_gguf(path)
    except GGUFError as exc:
        raise ModelLoadError(f"the projector {path} cannot be read: {exc}") from None
    for key, want in KEY_TYPES.items():
        if key not in info.metadata:
            continue
        value, found = info.metadata[key], info.types.get(key)
        have: int | tuple[int, int] | None = (ARRAY, value.item_type) if isinstance(value, ArrayInfo) else found
        if have != want:
            said = _spelled(have) if have is not None and (have if isinstance(have, int) else have[1]) in _TYPE_WORDS \
                else "of an unknown type"
            raise ModelLoadError(f"the projector {path} is damaged: its key {key} is {said}, where llama.cpp reads "
                                 f"{_spelled(want)}")


# How long encoding a first medium may take apart (a large vision tower on a slow CPU included).
PROBE_TIMEOUT_S = 600


def check_encodes(path: Path, model_path: Path, marks: Path | None) -> None:
    """Encodes a first image (and recording) with the projector at `path` for the model at
    `model_path` in a process of its own, unless `marks` (a folder) says it did before; a
    ModelLoadError saying how it failed when it does not."""
    mark = None
    if marks is not None:
        from quipu.engine.native import binding_version

        facts = []
        for p in (path, model_path):
            st = p.stat()
            facts += [str(p.resolve()), str(st.st_size), str(st.st_mtime_ns)]
        mark = marks / hashlib.sha256("\0".join([*facts, binding_version()]).encode()).hexdigest()
        if mark.exists():
            return
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"},
           "GGML_NO_BACKTRACE": "1"}  # (an abort there is expected: no debugger run to describe it)
    try:
        r = subprocess.run([sys.executable, "-m", "quipu.engine.projector_check", str(model_path), str(path)],
                           capture_output=True, env=env, stdin=subprocess.DEVNULL, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ModelLoadError(f"the projector {path} took more than {PROBE_TIMEOUT_S // 60} minutes to encode a "
                             "first, tiny medium; it was not used") from None
    if r.returncode != 0:
        said = r.stderr.decode("utf-8", "replace").strip().splitlines()
        doing = [line for line in r.stdout.decode("utf-8", "replace").splitlines() if line in ("image", "recording")]
        reason = said[-1] if r.returncode == 3 and said else (
            f"llama.cpp {'crashed' if r.returncode < 0 else 'failed'} encoding a first, tiny "
            + (doing[-1] if doing else "medium")
            + (f" ({signal.Signals(-r.returncode).name})" if r.returncode < 0 and -r.returncode in
               signal.valid_signals() else f" (exit {r.returncode})")
            + ": the file lacks a part its kind needs, or is not made for llama.cpp as built")
        raise ModelLoadError(f"the projector {path} cannot be used: {reason}")
    if mark is not None:
        from quipu.paths import open_private, private_dir

        private_dir(mark.parent, levels=2)
        os.close(open_private(mark, os.O_WRONLY))


def _png(width: int = 16, height: int = 16) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    rows = b"".join(b"\x00" + bytes((x * 13 + y * 7) % 256 for x in range(width * 3)) for y in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def _wav(seconds: float = 0.5, rate: int = 16000) -> bytes:
    n = int(seconds * rate)
    samples = b"".join(struct.pack("<h", (i * 37) % 2000 - 1000) for i in range(n))
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(samples)) + samples
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _probe(model_path: str, projector: str) -> int:
    """The process apart: the model's vocabulary and sizes (no weights), the projector, a medium
    of each kind it takes encoded. Exit 0, or 3 with the reason on its last line of stderr."""
    import ctypes

    from quipu.engine.logs import LOG
    from quipu.engine.native import lc, load_mtmd

    m = load_mtmd()
    LOG.install()  # (llama.cpp's log kept from the terminal, its errors kept for the reason)
    LOG.install_media()
    params = lc.llama_model_default_params()
    params.vocab_only = True
    model = lc.llama_model_load_from_file(model_path.encode(), params)
    if not model:
        print("llama.cpp could not read the model's vocabulary", file=sys.stderr)
        return 3
    cparams = m.mtmd_context_params_default()
    cparams.use_gpu, cparams.print_timings, cparams.warmup = False, False, False
    cparams.n_threads = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    ctx = m.mtmd_init_from_file(projector.encode(), model, cparams)
    if not ctx:
        print(f"llama.cpp could not load it{LOG.reason()}", file=sys.stderr)
        return 3
    media = [("image", _png())] if m.mtmd_support_vision(ctx) else []
    media += [("recording", _wav())] if m.mtmd_support_audio(ctx) else []
    for what, data in media:
        print(what, flush=True)  # (what it was encoding, should it crash)
        buf = (ctypes.c_ubyte * len(data)).from_buffer_copy(data)
        bitmap = m.mtmd_helper_bitmap_init_from_buf(ctx, buf, len(data), False)
        chunks = m.mtmd_input_chunks_init()
        marker = m.mtmd_default_marker()
        text = m.mtmd_input_text(marker, len(marker), False, True)
        if not bitmap or m.mtmd_tokenize(ctx, chunks, ctypes.byref(text), (m.mtmd_bitmap_p_ctypes * 1)(bitmap), 1):
            print(f"it cannot take a first, tiny {what}", file=sys.stderr)
            return 3
        for i in range(m.mtmd_input_chunks_size(chunks)):
            chunk = m.mtmd_input_chunks_get(chunks, i)
            if m.mtmd_input_chunk_get_type(chunk) != m.MTMD_INPUT_CHUNK_TYPE_TEXT and m.mtmd_encode_chunk(ctx, chunk):
                print(f"llama.cpp could not encode a first, tiny {what} with it", file=sys.stderr)
                return 3
    return 0


if __name__ == "__main__":
    sys.exit(_probe(sys.argv[1], sys.argv[2]))
