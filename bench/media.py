"""Reading an image into the context, side by side with llama.cpp's own `llama-mtmd-cli` on the
same files.

The projector is a random one of a real encoder's size, written here with the tests' writer
(`tests/tinymodel.py`): a SigLIP-base-sized encoder (12 layers of width 768) on 224-pixel images
in 14-pixel patches, pooled 4 by 4 into 16 positions, the kind llama.cpp's clip.cpp reads as
Gemma 3's; the text model is the tests' tiny one, so the image's encoding is most of the work.
Interleaved `repeats` times: `quipu run -a IMAGE -n 1 --json` (its prefill time: the image
encoded and read, and the few text tokens around it) and `llama-mtmd-cli --image IMAGE -n 1`
(what it says it spent encoding the image and reading it in), and both whole processes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from bench.common import median, quipu_cmd

ROOT = Path(__file__).resolve().parent.parent


def _files(folder: Path) -> tuple[Path, Path, Path]:
    sys.path.insert(0, str(ROOT / "tests"))
    from PIL import Image
    from tinymodel import write_tiny_gguf, write_tiny_projector

    import numpy as np

    model, projector, image = folder / "tiny.gguf", folder / "mmproj-siglip-base.gguf", folder / "photo.png"
    write_tiny_gguf(model)
    write_tiny_projector(projector, n_embd=768, n_ff=3072, n_layer=12, n_head=12, image_size=224, patch=14, merge=4)
    pixels = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(image)
    return model, projector, image


_ENCODED = re.compile(r"(?:image slice encoded|mtmd batch encoding done) in (\d+) ms")
_DECODED = re.compile(r"image decoded \(batch \d+/\d+\) in (\d+) ms")


def _theirs(exe: Path, model: Path, projector: Path, image: Path, threads: int) -> tuple[float, float]:
    """(seconds llama-mtmd-cli says the image took, encoded and read in; the whole process's)."""
    started = time.perf_counter()
    r = subprocess.run([str(exe), "-m", str(model), "--mmproj", str(projector), "--image", str(image), "-p",
                        "Describe it.", "-n", "1", "-t", str(threads), "--temp", "0", "-c", "1024"],
                       capture_output=True, check=True)
    whole = time.perf_counter() - started
    said = r.stderr.decode(errors="replace") + r.stdout.decode(errors="replace")
    spent = sum(int(m) for m in _ENCODED.findall(said)) + sum(int(m) for m in _DECODED.findall(said))
    return spent / 1000, whole


def _ours(model: Path, projector: Path, image: Path, threads: int, home: str) -> tuple[float, float]:
    whole, r = quipu_cmd("run", "-m", str(model), "--mmproj", str(projector), "-a", str(image), "-n", "1", "--json",
                         "--no-cache", "--threads", str(threads), "--ctx", "1024", "-t", "0", "Describe it.",
                         env={"QUIPU_HOME": home})
    return json.loads(r.stdout)["timings"]["prefill_s"], whole


def bench_media(threads: int, repeats: int, home: str) -> list[dict]:
    import tempfile

    from bench import llamacpp

    try:
        exe = llamacpp.build(("llama-mtmd-cli",)) / "llama-mtmd-cli"
    except Exception as exc:  # no compiler or sdist: say so
        return [{"what": f"llama-mtmd-cli could not be built ({exc}); images not compared", "quipu": ""}]
    with tempfile.TemporaryDirectory() as folder:
        model, projector, image = _files(Path(folder))
        _ours(model, projector, image, threads, home)  # (once, so that both read the files from memory)
        ours, theirs = [], []
        for _ in range(repeats):  # interleaved, so load on the machine hits both alike
            theirs.append(_theirs(exe, model, projector, image, threads))
            ours.append(_ours(model, projector, image, threads, home))
    rows = []
    for i, what in ((0, "an image (640x480 PNG, a SigLIP-base-sized projector) encoded and read into the context, s"),
                    (1, "the whole run with that image, one token generated, s")):
        q, t = median([o[i] for o in ours]), median([o[i] for o in theirs])
        rows.append({"what": what, "quipu": round(q, 3), "llama.cpp": f"{t:.3f} (llama-mtmd-cli)",
                     "ratio": round(t / q, 3) if q else ""})
    return rows
