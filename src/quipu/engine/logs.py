"""llama.cpp's log output: silent unless asked for, with real errors kept for our messages."""

from __future__ import annotations

import collections
import ctypes
import re
import sys

from quipu.engine.native import lc

GGML_LOG_LEVEL_ERROR = 4
GGML_LOG_LEVEL_CONT = 5
# How a new context says which attention its cache was made for (`llama_context`'s constructor,
# src/llama-context.cpp): "auto" and "enabled" make V untransposed, "disabled" transposed.
_FLASH_ATTN = re.compile(r"llama_context: flash_attn\s*=\s*(\w+)")
# What a new context's compute buffers take, by buffer type (a device's name, or CPU and host ones):
# said even where nothing is allocated (a model loaded with `no_alloc`, to measure).
_COMPUTE = re.compile(r"\w+:\s*(\S+) compute buffer size =\s*([0-9.]+) MiB")


class LlamaLog:
    """Receives every llama.cpp log line; keeps the recent errors, echoes all of it when verbose."""

    def __init__(self) -> None:
        self.verbose = False  # (set by `echo`)
        self.errors: collections.deque[str] = collections.deque(maxlen=8)
        self._last_level = 0
        self._callback = None
        self.flash_attn: str | None = None  # what the last context made was made with, as it said
        self.compute: dict[str, int] = {}  # the last context's compute buffers, bytes by buffer type

    def echo(self, verbose: bool) -> None:
        """Echoes every line llama.cpp logs on stderr (`--verbose`), or none."""
        self.verbose = verbose

    def install(self) -> None:
        if self._callback is None:
            # Kept on self: the C side holds a bare pointer to it.
            self._callback = lc.llama_log_callback(self._on_log)
        lc.llama_log_set(self._callback, ctypes.c_void_p(0))

    def install_media(self) -> None:
        """The multimodal library (mtmd) and its helpers log here too."""
        from quipu.engine.native import load_mtmd

        mtmd_cpp = load_mtmd()
        self.install()
        mtmd_cpp.mtmd_log_set(self._callback, ctypes.c_void_p(0))
        mtmd_cpp.mtmd_helper_log_set(self._callback, ctypes.c_void_p(0))

    def _on_log(self, level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        if level == GGML_LOG_LEVEL_CONT:
            level = self._last_level
        self._last_level = level
        message = text.decode("utf-8", "replace") if text else ""
        if level == GGML_LOG_LEVEL_ERROR and message.strip():
            self.errors.append(message.strip())
        elif message.startswith("llama_context: flash_attn"):
            found = _FLASH_ATTN.match(message)
            self.flash_attn = found.group(1) if found else None
        elif "compute buffer size" in message:
            found = _COMPUTE.match(message)
            if found:
                self.compute[found.group(1)] = int(float(found.group(2)) * (1 << 20))
        if self.verbose:
            sys.stderr.write(message)
            sys.stderr.flush()

    def clear_errors(self) -> None:
        self.errors.clear()
        self.flash_attn = None
        self.compute = {}

    def reason(self) -> str:
        """': <what llama.cpp said went wrong first>', or '' when it said nothing."""
        if not self.errors:
            return ""
        first = self.errors[0]
        for marker in ("error loading model: ", "error: "):
            if marker in first:
                first = first.split(marker, 1)[1]
                break
        return f": {first}"


LOG = LlamaLog()
