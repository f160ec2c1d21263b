"""The state file, `NAME.kv`: the context's KV bytes, verified before anything reaches llama.cpp;
and the state log beside it, `NAME.kvlog`: the pieces later turns added, each a record of the
same layout (magic b"QUIPUKVP"), one after another.

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
from pathlib import Path
from typing import Any

from quipu.errors import SnapshotError
from quipu.paths import open_private

MAGIC = b"QUIPUKV\n"
PIECE_MAGIC = b"QUIPUKVP"
VERSION = 1
MAX_META = 1 << 20
_HEAD = struct.Struct("<8sII")
_LEN = struct.Struct("<Q")
_DIGEST = 32


@dataclass
class StateBlob:
    meta: dict[str, Any]
    state: bytes | memoryview


def state_chunks(meta: dict[str, Any], state: bytes | memoryview, magic: bytes = MAGIC) -> list[bytes | memoryview]:
    """The state file (or a log record, with PIECE_MAGIC) as pieces to write one after another:
    the state bytes are not copied."""
    body = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode("utf-8")
    if len(body) > MAX_META:
        raise SnapshotError("snapshot metadata is too large")
    parts = [_HEAD.pack(magic, VERSION, len(body)), body, _LEN.pack(len(memoryview(state).cast("B"))), state]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return parts + [digest.digest()]


def encode_state(meta: dict[str, Any], state: bytes | memoryview) -> bytes:
    return b"".join(state_chunks(meta, state))


def read_state(path: Path) -> "StateBlob":
    """A state file read and verified, its state bytes a view of one buffer (no copy)."""
    return decode_state(_read_into(path))


def _read_into(path: Path) -> memoryview:
    """A file's bytes in one writable buffer, read without a copy."""
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
    return view[:got]


def decode_state(data: bytes | memoryview, expect: bytes = MAGIC) -> StateBlob:
    """Checks magic, version, lengths and checksum, then parses; raises SnapshotError on any flaw."""
    view = memoryview(data)
    if len(view) < _HEAD.size + _LEN.size + _DIGEST:
        raise SnapshotError("the state file is truncated")
    magic, version, meta_len = _HEAD.unpack_from(view, 0)
    if magic != expect:
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


def read_meta(path: Path) -> dict[str, Any]:
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


def read_log(path: Path) -> tuple[list[tuple[StateBlob, int]], int, str | None]:
    """The records of a state log, read in order and each verified: (the good ones, each with
    the byte it ends at; the length of the file they fill; what is wrong after them, if
    anything: a record cut short by a crash while it was written, or damage). A record whose
    checksum fails but whose lengths frame it is left out and the rest read (another branch's
    pieces do not need it). A missing log holds no record."""
    try:
        view = _read_into(path)  # (a buffer llama.cpp reads the pieces from where they lie)
    except FileNotFoundError:
        return [], 0, None
    records: list[tuple[StateBlob, int]] = []
    at = 0
    damage: str | None = None
    while at < len(view):
        if len(view) - at < _HEAD.size:
            return records, at, "its last piece was cut short"
        magic, version, meta_len = _HEAD.unpack_from(view, at)
        end = at + _HEAD.size + meta_len
        if magic != PIECE_MAGIC or version != VERSION or meta_len > MAX_META or end + _LEN.size > len(view):
            return records, at, "a piece is damaged" if magic != PIECE_MAGIC else "its last piece was cut short"
        (state_len,) = _LEN.unpack_from(view, end)
        end += _LEN.size + state_len + _DIGEST
        if end > len(view):
            return records, at, "its last piece was cut short"
        try:
            record = decode_state(view[at:end], PIECE_MAGIC)
            # (after a damaged one, only pieces that name their parents: the others followed it)
            if damage is None or "id" in record.meta:
                records.append((record, end))
        except SnapshotError:  # (its frame holds: the pieces after it are read, those that need it are not)
            damage = "a piece is damaged"
        at = end
    return records, at, damage


def append_record(path: Path, meta: dict[str, Any], state: bytes | memoryview, at: int) -> int:
    """Writes a record at byte `at` of the log (what is after it, a record cut short, goes),
    fsynced; returns the log's new length."""
    chunks = state_chunks(meta, state, PIECE_MAGIC)
    fd = open_private(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, at)
        os.lseek(fd, at, os.SEEK_SET)
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            while view:
                view = view[os.write(fd, view):]
        os.fsync(fd)
        return os.lseek(fd, 0, os.SEEK_CUR)
    finally:
        os.close(fd)
