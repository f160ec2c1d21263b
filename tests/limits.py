"""What the tests that feed quipu hostile input share: a memory limit for the process that takes
it, the fuzz worker run under that limit, and a small filesystem that fills up."""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

STRESS = int(os.environ.get("QUIPU_STRESS", "1"))
MEMORY_LIMIT = 3 << 30  # the address space a case may take
SEED = 20261201


def memory_limited() -> None:
    """A subprocess's `preexec_fn`: a leak fails that process, not the machine."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def run_fuzz(surface: str, count: int, model: Path, tmp_path: Path, env: dict | None = None) -> str:
    """`count * QUIPU_STRESS` inputs of `surface` through tests/fuzz_worker.py, in a process of
    its own under the memory limit; asserts it finished, naming the input it died on if not."""
    last = tmp_path / "last-input"
    worker = Path(__file__).with_name("fuzz_worker.py")
    r = subprocess.run([sys.executable, str(worker), surface, str(SEED), str(count * STRESS), str(model)],
                       capture_output=True, timeout=600 * STRESS, preexec_fn=memory_limited,
                       env={**os.environ, **(env or {}), "QUIPU_FUZZ_LAST": str(last)})
    said = (r.stdout + r.stderr).decode("utf-8", "replace")
    tried = last.read_text()[:2000] if last.exists() else ""
    assert r.returncode == 0, f"{surface} (seed {SEED}) exited {r.returncode} on:\n{tried}\n{said[-4000:]}"
    return said


@contextlib.contextmanager
def small_filesystem(path: Path, size: str):
    """A tmpfs of `size` mounted on `path` (which must exist) for the block; the test is skipped
    where none can be mounted."""
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True)
