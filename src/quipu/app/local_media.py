"""A local session's images and recordings: the projector that reads them (checked first),
their markers in its messages, what its transcript says of each, and their bytes kept in the
sessions' media folder (`store/media.py`) for a resume to make them ready again."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from quipu.app.attachments import SENSE_WORDS, Attachment, cannot_take
from quipu.engine.base import MEDIA_BASE, MEDIA_MARK, MEDIA_SPAN, Backend
from quipu.errors import SessionNotFound, SnapshotError, UsageError
from quipu.models import projector_beside
from quipu.store.media import MediaStore
from quipu.store.store import MEDIA_FOLDER, SessionStore
from quipu.store.transcript import Transcript


def with_projector(backend: Backend, model_path: Path, mmproj: str | None,
                   media: Sequence[Attachment], checked: Path | None) -> list[str]:
    """Loads the model's projector (`mmproj`: --mmproj, or the one a session was given; else the
    one beside the model) into the session's context, once it is checked (`projector_check.py`;
    `checked`: the folder of marks of those checked before), and makes `media` ready in it: the
    marker of each, for a message's text."""
    if backend.media.projector_path is None:
        given = given_projector(mmproj)
        path = Path(given) if given is not None else projector_beside(model_path)
        if path is None:
            raise cannot_take(media[0], f"no projector beside {model_path.name}; --mmproj FILE gives one")
        from quipu.engine.projector_check import check_encodes, check_keys

        check_keys(path)
        check_encodes(path, model_path, checked)
        backend.media.open_projector(path)
    path = backend.media.projector_path
    assert path is not None
    for medium in media:
        if medium.kind.kind not in backend.media.senses:
            takes = " and ".join(SENSE_WORDS[k] for k in sorted(backend.media.senses)) or "nothing"
            raise cannot_take(medium, f"its projector {path.name} takes {takes}")
        if medium.kind.format not in READ_HERE:
            raise UsageError(f"cannot attach {medium.name} {medium.describe()}: llama.cpp reads "
                             f"{', '.join(READ_HERE[:-1])} and {READ_HERE[-1]} files, not {medium.kind.format}; "
                             "convert it (to PNG, say)")
    marks = []
    for medium in media:
        try:
            marks.append(backend.media.media_mark(medium.data))
        except UsageError as exc:
            raise UsageError(f"cannot attach {medium.name} {medium.describe()}: {exc}") from None
    return marks


# The formats llama.cpp's multimodal helpers decode (stb_image's, miniaudio's).
READ_HERE = ("PNG", "JPEG", "GIF", "BMP", "WAV", "MP3", "FLAC")


def given_projector(mmproj: str | None) -> str | None:
    """--mmproj as a session keeps it: the file's whole path (a one-line error when it is none)."""
    if mmproj is None:
        return None
    path = Path(mmproj).expanduser()
    if not path.is_file():
        raise UsageError(f"the projector {path} is not a file")
    return str(path.resolve())


def media_store(store: SessionStore) -> MediaStore:
    """The media of the sessions of `store`, kept beside them."""
    return MediaStore(store.root / MEDIA_FOLDER)


def referenced_media(store: SessionStore) -> set[str] | None:
    """The SHA-256 of every medium a session's transcript names, in any of its branches; None while a transcript cannot
    be read (what it names is not known, so nothing may be removed)."""
    referenced: set[str] = set()
    for name in store.names():
        try:
            record = store.load_transcript(name)
            branches = (record.tree or {}).get("branches", ())  # (each branch's own: another may be switched to)
            referenced |= {m["sha256"] for m in [*record.media, *(m for b in branches for m in b.get("media") or ())]}
        except SessionNotFound:
            continue  # (removed meanwhile)
        except (SnapshotError, OSError):
            return None
    return referenced


def forget_media(store: SessionStore, digests: Sequence[str]) -> None:
    """Removes from the media folder each of `digests` that no session's transcript names."""
    referenced = referenced_media(store)
    if referenced is None:
        return
    kept = media_store(store)
    for digest in set(digests) - referenced:
        kept.path(digest).unlink(missing_ok=True)


@dataclass
class KeptMedia:
    """The media a local session took: what its transcript says of each (by SHA-256), the
    projector it was given (--mmproj, kept for the media it is given later), and where the marks
    of projectors checked before are (`with_projector`)."""

    model_path: Path
    projector: str | None = None
    checked: Path | None = None
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)

    def saved(self, backend: Backend) -> list[dict[str, Any]]:
        """What the transcript says of the media the context holds, in its order."""
        return [self.entries[d] for d in backend.media.media_digests() if d in self.entries]

    def take(self, backend: Backend, store: SessionStore | None, media: Sequence[Attachment]) -> str:
        """Makes `media` ready in the context (their bytes kept in `store`, a named session's,
        before the transcript that names them); their markers."""
        marks = "".join(with_projector(backend, self.model_path, self.projector, media, self.checked))
        for medium in media:
            if store is not None:
                media_store(store).put(medium.data)
            self.entries.setdefault(medium.digest, medium.entry())
        return marks

    def trim(self, backend: Backend, tokens: Sequence[int], texts: Sequence[str]) -> list[str]:
        """Forgets the media the context took last that neither its `tokens` nor `texts` (its
        messages) name any more; their SHA-256s."""
        named = {(t - MEDIA_BASE) // MEDIA_SPAN for t in tokens if t >= MEDIA_BASE}
        named |= {int(found.group(1)) for text in texts for found in MEDIA_MARK.finditer(text)}
        dropped = backend.media.drop_media_after(max(named) + 1 if named else 0)
        kept = set(backend.media.media_digests())
        for digest in dropped:
            if digest not in kept:
                self.entries.pop(digest, None)
        return [d for d in dropped if d not in kept]

    def restore(self, backend: Backend, store: SessionStore, name: str, record: Transcript) -> None:
        """A resumed session's media made ready again in its new context, in the order it first
        took them (so its token history's placeholders mean the same media): its projector (the
        one it was saved with, unless --mmproj names another), their bytes from the media folder."""
        from quipu.app.attachments import attachment_of

        kept = media_store(store)
        media = []
        for entry in record.media:
            try:
                data = kept.get(entry["sha256"])
            except SnapshotError as exc:
                raise SnapshotError(f"session '{name}': {exc}; its transcript was left as it is") from None
            media.append(attachment_of(entry["name"], data))
            self.entries[entry["sha256"]] = entry
        with_projector(backend, self.model_path, self.projector, media, self.checked)
