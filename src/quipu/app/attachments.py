"""Files attached to a message (`run -a`, a chat's `/attach`): read with a bound on their size,
known by their bytes and not by their name, and refused in one line when they are not what they
claim or are more than quipu takes.

A text file (UTF-8) goes to the model as a delimited block before the message, with its name.
An image (PNG, JPEG, WebP, GIF, BMP) or a recording (WAV, MP3, FLAC) is known here with its
size read from its header alone (an image's pixel count is checked before anything decodes it,
so a file that claims a huge picture allocates nothing); whether the model can take it is the
host's to say (`cannot_take`)."""

from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from quipu.app.user_files import read_user_file
from quipu.errors import UsageError, told_to_stop

if TYPE_CHECKING:
    from quipu.sessions.template import ChatTemplate

MAX_ATTACHMENT_BYTES = 32 << 20  # the largest file attached
# What one message (or a run, or a messages file) may carry in all: each file is bounded, and so
# are their number and their bytes together, refused before the next is read.
MAX_ATTACHMENTS = 64
MAX_ATTACHED_BYTES = 128 << 20
MAX_IMAGE_PIXELS = 40_000_000  # the most pixels an image's header may claim (a 40-megapixel photo)
# The longest recording a header may claim: llama.cpp's decoder makes room for every sample a
# header claims, at the projector's rate, before it reads one.
MAX_AUDIO_SECONDS = 10 * 60
AUDIO_RATES = (1_000, 384_000)  # the sample rates taken (a rate of 1 Hz claims 16,000 samples a sample)


@dataclass(frozen=True)
class Kind:
    """What an attachment is: its kind (text, image, audio) and format, and the file names'
    endings that say so."""

    kind: str
    format: str
    endings: tuple[str, ...]
    mime: str = ""  # its media type, where a chat API takes it


TEXT = Kind("text", "UTF-8 text", (".txt", ".md", ".markdown", ".rst", ".csv", ".tsv", ".log"))
PNG = Kind("image", "PNG", (".png",), "image/png")
JPEG = Kind("image", "JPEG", (".jpg", ".jpeg", ".jfif"), "image/jpeg")
WEBP = Kind("image", "WebP", (".webp",), "image/webp")
GIF = Kind("image", "GIF", (".gif",), "image/gif")
BMP = Kind("image", "BMP", (".bmp",), "image/bmp")
WAV = Kind("audio", "WAV", (".wav", ".wave"), "audio/wav")
MP3 = Kind("audio", "MP3", (".mp3",), "audio/mp3")
FLAC = Kind("audio", "FLAC", (".flac",))
KINDS = (TEXT, PNG, JPEG, WEBP, GIF, BMP, WAV, MP3, FLAC)
# What a model takes besides text, in words.
SENSE_WORDS = {"image": "images", "audio": "audio"}
# What a name's ending claims, for the kinds it names.
CLAIMED = {ending: kind for kind in KINDS for ending in kind.endings}


@dataclass(frozen=True)
class Attachment:
    """One attached file: its name (as the model is told it), what it is, and its bytes."""

    name: str
    kind: Kind
    data: bytes
    pixels: tuple[int, int] | None = None  # an image's width and height, from its header

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def text(self) -> str:
        """A text file's text, nothing in it taken for one of quipu's markers (`defuse`)."""
        from quipu.engine.base import defuse

        return defuse(self.data.decode("utf-8-sig"))

    def entry(self) -> dict[str, str]:
        """How a session's transcript names it (`Transcript.media`)."""
        return {"sha256": self.digest, "kind": self.kind.kind, "format": self.kind.format, "name": self.name}

    def describe(self) -> str:
        """What it is, in a few words: `[image: PNG, 640x480, 1.2 KB]`, `[text: 312 B]`."""
        parts = [] if self.kind is TEXT else [self.kind.format]
        if self.pixels:
            parts.append(f"{self.pixels[0]}x{self.pixels[1]}")
        return f"[{self.kind.kind}: {', '.join(parts + [_size(len(self.data))])}]"


def check_room(held: Sequence[Attachment], what: str = "a message") -> None:
    """Refuses one more attachment where `held` is as many, or as many bytes, as `what` carries."""
    if len(held) >= MAX_ATTACHMENTS:
        raise UsageError(f"{what} carries at most {MAX_ATTACHMENTS} attachments")
    check_total(held, what)


def read_attachments(names: Sequence[str], stopped: Callable[[], bool] = lambda: False) -> list[Attachment]:
    """Each file or URL of `--attach`, read in turn within the bounds of one message; `stopped`
    (Ctrl-C, SIGTERM) is acted on while any of them is waited for."""
    if len(names) > MAX_ATTACHMENTS:
        raise UsageError(f"a message carries at most {MAX_ATTACHMENTS} attachments; {len(names)} were given")
    found: list[Attachment] = []
    for name in names:
        check_room(found)
        found.append(read_attachment(name, stopped))
    check_total(found)
    return found


def check_total(held: Sequence[Attachment], what: str = "a message") -> None:
    if sum(len(a.data) for a in held) > MAX_ATTACHED_BYTES:
        raise UsageError(f"{what} carries at most {MAX_ATTACHED_BYTES >> 20} MB of attachments in all")


def read_attachment(name: str, stopped: Callable[[], bool] = lambda: False) -> Attachment:
    """The file the user attached (a path, or an http(s) URL); a one-line error when it cannot be
    read, is larger than `MAX_ATTACHMENT_BYTES`, is not a kind quipu takes, or is not what its
    name (or its server) says. It is read in a thread of its own (a FIFO, a slow disk, a server
    may keep it waiting), so `stopped` is acted on meanwhile: `Interrupted`."""
    if name.startswith(("http://", "https://")):
        return _fetched(name, stopped)
    path = Path(name).expanduser()
    try:
        data = read_user_file(path, MAX_ATTACHMENT_BYTES, lambda: stopped() or told_to_stop())
    except IsADirectoryError:
        raise UsageError(f"cannot attach {path}: it is a folder, not a file") from None
    except OSError as exc:
        raise UsageError(f"cannot attach {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_ATTACHMENT_BYTES:
        raise UsageError(f"cannot attach {path}: it is larger than {MAX_ATTACHMENT_BYTES >> 20} MB")
    return attachment_of(path.name, data)


def _fetched(url: str, stopped: Callable[[], bool] = lambda: False) -> Attachment:
    """An attachment given by URL: fetched within the bounds a file has, what its server says it
    is checked against what its bytes are."""
    from urllib.parse import unquote, urlsplit

    from quipu.engine.http import download

    parts = urlsplit(url)
    name = unquote(parts.path.rstrip("/").rsplit("/", 1)[-1]) or parts.hostname or url
    data, content_type = download(url, MAX_ATTACHMENT_BYTES, stopped=stopped)
    found = attachment_of(name, data)
    said = content_type.split(";")[0].strip().lower()
    if found.kind is TEXT:
        fits = not said.startswith(("image/", "audio/", "video/"))
    else:
        fits = said in ("", "application/octet-stream", "binary/octet-stream") or said.split("/")[0] == found.kind.kind
    if not fits:
        raise UsageError(f"cannot attach {url}: its server says it is {said}, but its bytes are {found.kind.format}")
    return found


def attachment_of(name: str, data: bytes) -> Attachment:
    """An attachment from a name and its bytes (see `read_attachment`)."""
    kind = sniff(data)
    claimed = CLAIMED.get(Path(name).suffix.lower())
    if kind is None:
        if claimed is not None:
            raise UsageError(f"cannot attach {name}: its name says {claimed.format}, but its bytes are not "
                             f"{claimed.format}")
        taken = ", ".join(k.format for k in KINDS[1:])
        raise UsageError(f"cannot attach {name}: it is neither UTF-8 text nor a kind of image or audio quipu takes "
                         f"({taken})")
    if claimed is not None and claimed != kind:
        raise UsageError(f"cannot attach {name}: its name says {claimed.format}, but its bytes are {kind.format}")
    if kind is TEXT and not data.strip():
        raise UsageError(f"cannot attach {name}: it is empty")
    pixels = image_pixels(name, data, kind) if kind.kind == "image" else None
    if kind.kind == "audio":
        audio_seconds(name, data, kind)
    return Attachment(name, kind, data, pixels)


def sniff(data: bytes) -> Kind | None:
    """The kind a file's first bytes show; None for none quipu takes."""
    head = data[:16]
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return PNG
    if head.startswith(b"\xff\xd8\xff"):
        return JPEG
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return WEBP
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return WAV
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return GIF
    if head[:2] == b"BM" and len(data) >= 26:
        return BMP
    if head[:4] == b"fLaC":
        return FLAC
    if head[:3] == b"ID3" or (len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0
                              and (head[1] >> 1) & 3 == 1):  # (an MPEG frame's sync, layer III)
        return MP3
    if b"\x00" not in data:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return None
        return TEXT
    return None


def image_pixels(name: str, data: bytes, kind: Kind) -> tuple[int, int]:
    """An image's width and height, read from its header alone; a usage error when the header is
    broken or claims more than `MAX_IMAGE_PIXELS`."""
    try:
        size = _HEADERS[kind.format](data)
    except (struct.error, IndexError, ValueError):
        size = None
    if size is None or size[0] <= 0 or size[1] <= 0:
        raise UsageError(f"cannot attach {name}: its {kind.format} header is damaged or cut short")
    if size[0] * size[1] > MAX_IMAGE_PIXELS:
        raise UsageError(f"cannot attach {name}: its header claims {size[0]}x{size[1]} pixels, more than the "
                         f"{MAX_IMAGE_PIXELS // 1_000_000} million quipu takes")
    return size


def _png(data: bytes) -> tuple[int, int] | None:
    if data[12:16] != b"IHDR":
        return None
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _jpeg(data: bytes) -> tuple[int, int] | None:
    at = 2
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # (fill bytes)
            at += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            at += 2
            continue
        (length,) = struct.unpack(">H", data[at + 2:at + 4])
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # a start of frame
            height, width = struct.unpack(">HH", data[at + 5:at + 9])
            return width, height
        if length < 2:
            return None
        at += 2 + length
    return None


def _webp(data: bytes) -> tuple[int, int] | None:
    chunk = data[12:16]
    if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
        width, height = struct.unpack("<HH", data[26:30])
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L" and data[20] == 0x2F:
        (bits,) = struct.unpack("<I", data[21:25])
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":
        return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    return None


def _gif(data: bytes) -> tuple[int, int]:
    width, height = struct.unpack("<HH", data[6:10])
    return width, height


def _bmp(data: bytes) -> tuple[int, int]:
    (header,) = struct.unpack("<I", data[14:18])
    if header == 12:  # (the old OS/2 header)
        width, height = struct.unpack("<HH", data[18:22])
        return width, height
    width, height = struct.unpack("<ii", data[18:26])
    return width, abs(height)  # (a negative height is an image stored top-down)


_HEADERS = {"PNG": _png, "JPEG": _jpeg, "WebP": _webp, "GIF": _gif, "BMP": _bmp}


def audio_seconds(name: str, data: bytes, kind: Kind) -> float:
    """How long a recording's header says it is, read as llama.cpp's decoder reads it (the
    samples it claims, at the rate it claims); a usage error when the header is broken, its
    rate is none a recording has, or it claims more than `MAX_AUDIO_SECONDS`."""
    try:
        claimed = _AUDIO_HEADERS[kind.format](data)
    except (struct.error, IndexError, ValueError):
        claimed = None
    if claimed is None:
        raise UsageError(f"cannot attach {name}: its {kind.format} header is damaged or cut short")
    samples, rate = claimed
    if not AUDIO_RATES[0] <= rate <= AUDIO_RATES[1]:
        raise UsageError(f"cannot attach {name}: its header claims a sample rate of {rate} Hz; quipu takes "
                         f"{AUDIO_RATES[0]:,} to {AUDIO_RATES[1]:,} Hz")
    seconds = samples / rate
    if seconds > MAX_AUDIO_SECONDS:
        raise UsageError(f"cannot attach {name}: its header claims {seconds / 60:,.0f} minutes of sound, more than "
                         f"the {MAX_AUDIO_SECONDS // 60} quipu takes")
    return seconds


def _wav(data: bytes) -> tuple[int, int] | None:
    """(samples, rate): the data chunk's frames (as much of it as the file holds), or the fact
    chunk's count where it says more."""
    at, rate, frame_bytes, samples, fact = 12, 0, 0, None, 0
    while at + 8 <= len(data):
        chunk, size = data[at:at + 4], struct.unpack("<I", data[at + 4:at + 8])[0]
        body = at + 8
        if chunk == b"fmt ":
            channels, rate = struct.unpack("<HI", data[body + 2:body + 8])
            (frame_bytes,) = struct.unpack("<H", data[body + 12:body + 14])
            if channels == 0:
                return None
        elif chunk == b"fact" and size >= 4:
            (fact,) = struct.unpack("<I", data[body:body + 4])
        elif chunk == b"data":
            held = len(data) - body if size == 0xFFFFFFFF else min(size, len(data) - body)
            samples = held // frame_bytes if frame_bytes else None
            break
        at = body + size + (size & 1)
    if samples is None or not rate:
        return None
    return max(samples, fact), rate


def _flac(data: bytes) -> tuple[int, int] | None:
    """(samples, rate) from STREAMINFO, the first metadata block."""
    if data[4] & 0x7F != 0:
        return None
    (bits,) = struct.unpack(">Q", data[18:26])  # rate (20 bits), channels (3), depth (5), samples (36)
    return bits & ((1 << 36) - 1), bits >> 44


_MP3_RATES = {3: (44_100, 48_000, 32_000), 2: (22_050, 24_000, 16_000), 0: (11_025, 12_000, 8_000)}
_MP3_KBPS = {3: (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
             2: (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160)}


def _mp3_frame(data: bytes, at: int) -> tuple[int, int, int] | None:
    """(version, rate, length) of the layer III frame whose header is at `at`; None for none."""
    if at + 4 > len(data) or data[at] != 0xFF or data[at + 1] & 0xE0 != 0xE0 or (data[at + 1] >> 1) & 3 != 1:
        return None
    version, kbps_index, index = (data[at + 1] >> 3) & 3, data[at + 2] >> 4, (data[at + 2] >> 2) & 3
    if version == 1 or index == 3 or kbps_index in (0, 15):
        return None
    rate = _MP3_RATES[version][index]
    kbps = _MP3_KBPS[3 if version == 3 else 2][kbps_index]
    length = (144 if version == 3 else 72) * kbps * 1000 // rate + ((data[at + 2] >> 1) & 1)
    return version, rate, length


def _mp3(data: bytes) -> tuple[int, int] | None:
    """(samples, rate): the frames the file holds (walked as the decoder walks them), or the
    count a Xing, Info or VBRI header claims where it says more."""
    at = 0
    if data[:3] == b"ID3":
        size = 0
        for b in data[6:10]:
            size = size << 7 | (b & 0x7F)
        at = 10 + size + (10 if data[5] & 0x10 else 0)
    first = None
    frames = 0
    while True:
        at = data.find(b"\xff", at)
        if at < 0:
            break
        frame = _mp3_frame(data, at)
        if frame is None:
            at += 1
            continue
        if first is None:
            first = (at, frame)
        frames += 1
        at += max(frame[2], 1)
    if first is None:
        return None
    start, (version, rate, _length) = first
    head = data[start:start + 200]
    for tag in (b"Xing", b"Info"):
        found = head.find(tag)
        if found >= 0:
            flags, count = struct.unpack(">II", head[found + 4:found + 12])
            if flags & 1:
                frames = max(frames, count)
    if head[36:40] == b"VBRI":
        frames = max(frames, struct.unpack(">I", head[50:54])[0])
    return frames * (1152 if version == 3 else 576), rate


_AUDIO_HEADERS = {"WAV": _wav, "FLAC": _flac, "MP3": _mp3}


def message_with(text: str | None, attachments: Sequence[Attachment]) -> str:
    """A message with its attached text files before it, each delimited and named (the model
    reads the files, then what the user asks of them)."""
    blocks = [f'<file name="{a.name}">\n{a.text.rstrip()}\n</file>' for a in attachments if a.kind is TEXT]
    return "\n\n".join(blocks + ([text] if text else []))


def takes_documents(template: ChatTemplate | None) -> bool:
    """Whether a chat template (`sessions.template.ChatTemplate`, or None) has a slot for
    documents: it reads the `documents` transformers passes (Command R's, Granite's)."""
    return template is not None and re.search(r"\bdocuments\b", template.source) is not None


def split_media(attachments: Sequence[Attachment]) -> tuple[list[Attachment], list[Attachment]]:
    """(text files, media) of what is attached."""
    return [a for a in attachments if a.kind is TEXT], [a for a in attachments if a.kind is not TEXT]


def session_refusal(medium: Attachment) -> UsageError:
    return UsageError(f"cannot attach {medium.name} {medium.describe()} in a session on a server: such a session "
                      "keeps text files alone; attach it to a run without -S")


def cannot_take(medium: Attachment, why: str) -> UsageError:
    sense = "see images" if medium.kind.kind == "image" else "hear audio"
    return UsageError(f"cannot attach {medium.name} {medium.describe()}: this model cannot {sense} ({why})")


def describe_bytes(kind: str, data: bytes, mime: str = "") -> str:
    """A note of what some media bytes are, for a model that is not given them:
    `[image: PNG, 1.2 KB]` (the format as the bytes show it, else as `mime` says)."""
    found = sniff(data)
    shown = found.format if found is not None and found.kind == kind else (mime or "unknown format")
    return f"[{kind}: {shown}, {_size(len(data))}]"


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    return f"{n / 1024:.1f} KB" if n < 1 << 20 else f"{n / (1 << 20):.1f} MB"
