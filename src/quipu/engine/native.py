"""llama-cpp-python's ctypes layer, loaded alone.

`import llama_cpp` runs the package's `__init__`, which also imports the high-level API (the
`Llama` class, NumPy, Jinja and every chat format): a tenth of a second that a command-line
run pays before it has read a byte of the model. quipu needs only `llama_cpp.llama_cpp`, so
the package is registered without running its `__init__`; the first attribute asked of the
package itself (not of its submodules) runs it after all, so any later `import llama_cpp`
elsewhere in the process still sees the whole package.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from types import ModuleType
from typing import Any


def _bare_package() -> ModuleType:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.loader is None:
        raise ImportError("llama-cpp-python is not installed")
    package = importlib.util.module_from_spec(spec)
    loader = spec.loader

    def complete(name: str) -> Any:
        # Runs the real __init__ in this module object, once, then answers from it.
        del package.__dict__["__getattr__"]
        loader.exec_module(package)
        return getattr(package, name)

    package.__dict__["__getattr__"] = complete
    return package


def load() -> ModuleType:
    """The `llama_cpp.llama_cpp` module, without the high-level API unless it was imported already."""
    if "llama_cpp" not in sys.modules:
        sys.modules["llama_cpp"] = _bare_package()
    return importlib.import_module("llama_cpp.llama_cpp")


def load_mtmd() -> ModuleType:
    """llama.cpp's multimodal library's binding (`llama_cpp.mtmd_cpp`), loaded as the ctypes layer
    is: without the high-level API (`from llama_cpp import mtmd_cpp` would run it)."""
    load()
    return importlib.import_module("llama_cpp.mtmd_cpp")


def load_ggml() -> ModuleType:
    """llama-cpp-python's handle on ggml's library (`llama_cpp._ggml`: `libggml`), loaded as the
    ctypes layer is."""
    load()
    return importlib.import_module("llama_cpp._ggml")


def binding_version() -> str:
    """llama-cpp-python's version, read without running its package (which `__version__` would)."""
    package = sys.modules.get("llama_cpp")
    if package is not None and "__version__" in package.__dict__:
        return str(package.__dict__["__version__"])
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return "unknown"
    with open(spec.origin, encoding="utf-8") as f:
        found = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', f.read(), re.MULTILINE)
    return found.group(1) if found else "unknown"


lc = load()
