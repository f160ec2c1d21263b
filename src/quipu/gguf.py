"""A small, defensive GGUF header reader: model facts without loading the model.

Reads the metadata and tensor table only, with bounds on every length, so a damaged or
hostile file gives a GGUFError, not a hang or an allocation of its choosing.
"""

from __future__ import annotations

import mmap
import os
import struct
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

MAX_KEY = 1 << 16
MAX_STRING = 1 << 24
MAX_KV = 1 << 20
MAX_TENSORS = 1 << 22
MAX_DIMS = 8

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9

FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
    36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4_MOE",
}


class GGUFError(ValueError):
    """The file is not a GGUF file this reader can make sense of."""


HEAD_ITEMS = 512  # an array's first items read (a per-layer value of every layer: llama.cpp's most)


@dataclass(frozen=True)
class ArrayInfo:
    """An array value, not read in full: its element type, length and where it starts."""

    item_type: int
    count: int
    offset: int
    head: list[Any] = field(default_factory=list)  # the first few items, when they are scalars


@dataclass(frozen=True)
class TensorInfo:
    """A tensor of the table: its name, ggml type and dimensions (ggml's order, rows first)."""

    name: str
    ggml_type: int
    dims: tuple[int, ...]


@dataclass
class GGUFInfo:
    path: Path
    version: int
    metadata: dict[str, Any]
    n_tensors: int
    n_params: int
    tensors: list[TensorInfo] = field(default_factory=list)
    types: dict[str, int] = field(default_factory=dict)  # each key's gguf value type

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "?"))

    @property
    def context_length(self) -> int | None:
        value = self.metadata.get(f"{self.architecture}.context_length")
        # (llama.cpp reads it as a 32-bit signed number: past that it is no length it can use)
        return int(value) if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**31 else None

    @property
    def quantization(self) -> str:
        ftype = self.metadata.get("general.file_type")
        return FILE_TYPES.get(ftype, f"type {ftype}") if isinstance(ftype, int) else "?"

    @property
    def chat_template(self) -> str | None:
        value = self.metadata.get("tokenizer.chat_template")
        return value if isinstance(value, str) else None

    @property
    def name(self) -> str | None:
        value = self.metadata.get("general.name")
        return value if isinstance(value, str) else None

    def token_text(self, token_id: int) -> str | None:
        """The text of one token, read from the vocabulary in the file."""
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, ArrayInfo) or tokens.item_type != STRING or not 0 <= token_id < tokens.count:
            return None
        with _mapped(self.path) as reader:
            reader.skip_strings(token_id, at=tokens.offset)
            return reader.string()


def human_params(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}".replace(".0", "")
    return str(n)


class _Reader:
    """Reads from a memory map; every length is checked against the file before use."""

    def __init__(self, buf: mmap.mmap, size: int):
        self.buf = buf
        self.size = size
        self.pos = 0

    def read(self, n: int) -> bytes:
        end = self.pos + n
        if end > self.size:
            raise GGUFError("the file ends inside its header")
        data = self.buf[self.pos : end]
        self.pos = end
        return data

    def scalar(self, fmt: str) -> Any:
        width = struct.calcsize(fmt)
        if self.pos + width > self.size:
            raise GGUFError("the file ends inside its header")
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += width
        return value

    def length(self, limit: int, what: str) -> int:
        n: int = self.scalar("<Q")
        if n > limit or n > self.size:
            raise GGUFError(f"the header declares an impossible {what} ({n})")
        return n

    def string(self, limit: int = MAX_STRING) -> str:
        return self.read(self.length(limit, "string length")).decode("utf-8", "replace")

    def skip_strings(self, count: int, at: int | None = None) -> None:
        """Reads past `count` strings, from `at` (else from where the reader is)."""
        buf, pos, size, unpack = self.buf, self.pos if at is None else at, self.size, struct.unpack_from
        for _ in range(count):
            if pos + 8 > size:
                raise GGUFError("the file ends inside its header")
            pos += 8 + unpack("<Q", buf, pos)[0]
        if pos > size:
            raise GGUFError("the file ends inside its header")
        self.pos = pos

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            item_type = self.scalar("<I")
            count = self.length(self.size, "array length")
            offset = self.pos
            if item_type in _SCALARS:
                width = struct.calcsize(_SCALARS[item_type])
                head = [self.scalar(_SCALARS[item_type]) for _ in range(min(count, HEAD_ITEMS))]
                info = ArrayInfo(item_type, count, offset, head)
                self.pos = offset + count * width
                if self.pos > self.size:
                    raise GGUFError("an array runs past the end of the file")
            elif item_type == STRING:
                info = ArrayInfo(item_type, count, offset)
                self.skip_strings(count)
            else:
                raise GGUFError(f"nested or unknown array type {item_type}")
            return info
        raise GGUFError(f"unknown metadata type {vtype}")


@contextmanager
def _mapped(path: Path) -> Iterator[_Reader]:
    with path.open("rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            raise GGUFError("the file is empty")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            yield _Reader(buf, size)


def read_gguf(path: Path) -> GGUFInfo:
    """Reads the metadata and tensor table of a GGUF file."""
    path = Path(path)
    try:
        if not path.is_file():
            raise GGUFError("not a regular file")
        with _mapped(path) as reader:
            if reader.read(4) != b"GGUF":
                raise GGUFError("not a GGUF file")
            version = reader.scalar("<I")
            if version not in (2, 3):
                raise GGUFError(f"GGUF version {version} is not supported")
            n_tensors = reader.length(MAX_TENSORS, "tensor count")
            n_kv = reader.length(MAX_KV, "metadata count")
            metadata: dict[str, Any] = {}
            types: dict[str, int] = {}
            for _ in range(n_kv):
                key = reader.string(MAX_KEY)
                types[key] = reader.scalar("<I")
                metadata[key] = reader.value(types[key])
            n_params = 0
            tensors = []
            for _ in range(n_tensors):
                name = reader.string(MAX_KEY)
                n_dims = reader.scalar("<I")
                if n_dims > MAX_DIMS:
                    raise GGUFError(f"a tensor declares {n_dims} dimensions")
                dims = tuple(reader.scalar("<Q") for _ in range(n_dims))
                ggml_type = reader.scalar("<I")
                reader.read(8)  # offset
                count = 1
                for d in dims:
                    count *= d
                n_params += count
                tensors.append(TensorInfo(name, ggml_type, dims))
    except OSError as exc:
        raise GGUFError(exc.strerror or str(exc)) from exc
    return GGUFInfo(path, version, metadata, n_tensors, n_params, tensors, types)
