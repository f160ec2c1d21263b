"""`quipu` run with some of its output on a pseudo-terminal, as a person at a terminal sees it."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import threading
from pathlib import Path


def on_a_terminal(home: Path, *args: object, stdout_too: bool = True, stdin: bytes | None = None,
                  timeout: float = 300) -> tuple[int, str, bytes]:
    """`quipu ARGS` with stderr (and, with `stdout_too`, stdout) on a pseudo-terminal, `stdin`
    piped to it: (its exit code, what the terminal was given, what went to a piped stdout)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    env.update(QUIPU_HOME=str(home), COLUMNS="100")
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "quipu", *map(str, args)],
                            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                            stdout=follower if stdout_too else subprocess.PIPE, stderr=follower, env=env)
    os.close(follower)
    chunks: list[bytes] = []

    def drain() -> None:  # (a terminal that is not read from blocks its writer)
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    out, _ = proc.communicate(stdin, timeout=timeout)
    reader.join(timeout=10)
    os.close(leader)
    return proc.returncode, b"".join(chunks).decode("utf-8", "replace"), out or b""
