"""The state file, `NAME.kv`: the context's KV bytes, verified before anything reaches llama.cpp.

Layout (little-endian):

    magic  b"QUIPUKV\\n"                 8 bytes
    format version                       u32
    metadata length M                    u32   (at most MAX_META)
    metadata                             M bytes of UTF-8 JSON
    state length S                       u64   (must equal what is left before the checksum)
    state bytes                          S bytes
    sha256 of everything above           32 bytes

No pickle anywhere: a session file from someone else can be wrong, never run code.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from typing import Any

from quipu.errors import SnapshotError

MAGIC = b"QUIPUKV\n"
VERSION = 1
MAX_META = 1 << 20
_HEAD = struct.Struct("<8sII")
_LEN = struct.Struct("<Q")
_DIGEST = 32


@dataclass
class StateBlob:
    meta: dict[str, Any]
    state: bytes | memoryview


def state_chunks(meta: dict[str, Any], state: bytes | memoryview) -> list[bytes | memoryview]:
    """The state file as pieces to write one after another: the state bytes are not copied."""
    body = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode("utf-8")
    if len(body) > MAX_META:
        raise SnapshotError("snapshot metadata is too large")
    parts = [_HEAD.pack(MAGIC, VERSION, len(body)), body, _LEN.pack(len(memoryview(state).cast("B"))), state]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return parts + [digest.digest()]


def encode_state(meta: dict[str, Any], state: bytes | memoryview) -> bytes:
    return b"".join(state_chunks(meta, state))


def read_state(path) -> "StateBlob":
    """A state file read and verified, its state bytes a view of one buffer (no copy)."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        data = bytearray(size)
        view = memoryview(data)
        got = 0
        while got < size:
            n = fh.readinto(view[got:])
            if not n:
                break
            got += n
    return decode_state(view[:got])


def decode_state(data: bytes | memoryview) -> StateBlob:
    """Checks magic, version, lengths and checksum, then parses; raises SnapshotError on any flaw."""
    view = memoryview(data)
    if len(view) < _HEAD.size + _LEN.size + _DIGEST:
        raise SnapshotError("the state file is truncated")
    magic, version, meta_len = _HEAD.unpack_from(view, 0)
    if magic != MAGIC:
        raise SnapshotError("not a quipu state file")
    if version != VERSION:
        raise SnapshotError(f"state file format {version} is not one this quipu reads ({VERSION})")
    if meta_len > MAX_META or _HEAD.size + meta_len + _LEN.size + _DIGEST > len(view):
        raise SnapshotError("the state file is truncated or its metadata length is damaged")
    at = _HEAD.size + meta_len
    (state_len,) = _LEN.unpack_from(view, at)
    state_at = at + _LEN.size
    if state_at + state_len + _DIGEST != len(view):
        raise SnapshotError("the state file is truncated or its length is damaged")
    if hashlib.sha256(view[:-_DIGEST]).digest() != bytes(view[-_DIGEST:]):
        raise SnapshotError("the state file is damaged (checksum mismatch)")
    try:
        meta = json.loads(bytes(view[_HEAD.size:at]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise SnapshotError("the state file's metadata is not valid JSON") from exc
    if not isinstance(meta, dict):
        raise SnapshotError("the state file's metadata is not an object")
    # A view, not a copy: a state is tens of megabytes, and llama.cpp reads it where it lies.
    return StateBlob(meta, view[state_at : state_at + state_len])


def read_meta(path) -> dict[str, Any]:
    """The metadata of a state file, read without its state bytes (to choose among files); the
    checksum is checked only when the whole file is decoded. Raises SnapshotError or OSError."""
    with open(path, "rb") as fh:
        head = fh.read(_HEAD.size)
        if len(head) < _HEAD.size:
            raise SnapshotError("the state file is truncated")
        magic, version, meta_len = _HEAD.unpack(head)
        if magic != MAGIC or version != VERSION or meta_len > MAX_META:
            raise SnapshotError("not a quipu state file this quipu reads")
        body = fh.read(meta_len)
    try:
        meta = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise SnapshotError("the state file's metadata is not valid JSON") from None
    if not isinstance(meta, dict):
        raise SnapshotError("the state file's metadata is not an object")
    return meta

