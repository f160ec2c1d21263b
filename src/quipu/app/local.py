"""A local model: the host that loads the GGUF file with llama.cpp, a session's context state
kept in a state file beside its transcript (restored instead of read again), and the prompt
cache that lets a new prompt restore the beginning it shares with earlier ones (`prompt_cache.py`).
What the state files hold is read from their metadata by `store/chain.py`."""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from quipu import __version__
from quipu.app.attachments import SENSE_WORDS, Attachment, cannot_take
from quipu.app.environment import DEFAULT_MAX_STATE_BYTES, Environment
from quipu.app.turn_options import (
    TurnOptions,
    context_settings,
    load_backend,
    offload,
    parse_logit_bias,
    sampling_params,
    with_logit_biases,
)
from quipu.app.hosts import Opened, made_elsewhere, saved_params
from quipu.app.prompt_cache import CacheUse, cache_lookup, cache_save, cached_count, open_cache
from quipu.store.cache import PromptCache
from quipu.store.media import MediaStore
from quipu.engine.base import (
    KV_TYPES,
    MAX_CTX,
    MEDIA_BASE,
    MEDIA_MARK,
    MEDIA_SPAN,
    MIN_CTX,
    Backend,
    ContextSettings,
    ProgressFn,
    layout_differs,
    remembered_flash_attn,
    saved_state_key,
)
from quipu.engine.kvstate import LAYOUT, check_piece
from quipu.app.placing import load_where_it_ran, moved_notice, placement_notices, placement_of
from quipu.errors import EngineError, ModelMismatch, SessionNotFound, SnapshotError, UsageError
from quipu.models import file_identity, fingerprint, projector_beside
from quipu.sessions.base import LOCAL, Message, Stats
from quipu.sessions.inference import InferenceSession, Snapshot
from quipu.store.chain import Chain, held_cells, tokens_digest
from quipu.store.fingerprints import Fingerprints
from quipu.store.store import KEEP_STATE, MEDIA_FOLDER, SessionStore
from quipu.store.transcript import Transcript


def state_key(session: InferenceSession) -> tuple[Any, ...]:
    """What a state file's bytes depend on: the decoded tokens and the context settings."""
    key = session.backend.context.state_key()
    return (session.n_decoded, tokens_digest(session.tokens[: session.n_decoded]), tuple(sorted(key.items())))


def model_fingerprint(path: Path, env: Environment) -> str:
    """`models.fingerprint` of a model file, remembered across runs in the cache folder."""
    memo = Fingerprints(env.dirs.cache / "fingerprints.json")
    where, identity = path.resolve(), file_identity(path)
    found = memo.recall(where, identity)
    if found is None:
        found = fingerprint(path)
        memo.keep(where, identity, found)
    return found


def open_session(opts: TurnOptions, env: Environment) -> tuple[str, Path, InferenceSession]:
    """(model name, model file, a fresh session on it), with the load time in its stats. Options
    are checked before the model is loaded."""
    params = sampling_params(opts, env)
    settings = context_settings(opts, env)
    where = offload(opts, env)
    parse_logit_bias(opts.logit_bias)
    model_name, model_path = env.resolve_model(opts.model)
    started = time.perf_counter()
    backend = load_backend(model_path, settings, opts.verbose, where)
    try:
        stats = Stats(load_s=time.perf_counter() - started, placement=placement_of(backend))
        session = InferenceSession(backend, with_logit_biases(params, backend, opts), stats=stats)
    except BaseException:
        backend.close()
        raise
    return model_name, model_path, session


def with_projector(backend: Backend, model_path: Path, mmproj: str | None,
                   media: Sequence[Attachment], checked: Path | None) -> list[str]:
    """Loads the model's projector (`mmproj`: --mmproj, or the one a session was given; else the
    one beside the model) into the session's context, once it is checked (`projector_check.py`;
    `checked`: the folder of marks of those checked before), and makes `media` ready in it: the
    marker of each, for a message's text."""
    if backend.projector_path is None:
        given = given_projector(mmproj)
        path = Path(given) if given is not None else projector_beside(model_path)
        if path is None:
            raise cannot_take(media[0], f"no projector beside {model_path.name}; --mmproj FILE gives one")
        from quipu.engine.projector_check import check_encodes, check_keys

        check_keys(path)
        check_encodes(path, model_path, checked)
        backend.open_projector(path)
    path = backend.projector_path
    assert path is not None
    for medium in media:
        if medium.kind.kind not in backend.senses:
            takes = " and ".join(SENSE_WORDS[k] for k in sorted(backend.senses)) or "nothing"
            raise cannot_take(medium, f"its projector {path.name} takes {takes}")
        if medium.kind.format not in READ_HERE:
            raise UsageError(f"cannot attach {medium.name} {medium.describe()}: llama.cpp reads "
                             f"{', '.join(READ_HERE[:-1])} and {READ_HERE[-1]} files, not {medium.kind.format}; "
                             "convert it (to PNG, say)")
    marks = []
    for medium in media:
        try:
            marks.append(backend.media_mark(medium.data))
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
    """The SHA-256 of every medium a session's transcript names; None while a transcript cannot
    be read (what it names is not known, so nothing may be removed)."""
    referenced: set[str] = set()
    for name in store.names():
        try:
            referenced |= {m["sha256"] for m in store.load_transcript(name).media}
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


def take_saved_media(backend: Backend, store: SessionStore, name: str, record: Transcript, model_path: Path,
                     keeper: "LocalKeeper") -> None:
    """A resumed session's media made ready again in its new context, in the order it first took
    them (so its token history's placeholders mean the same media): its projector (the keeper's:
    the one it was saved with, unless --mmproj names another), their bytes from the media folder."""
    from quipu.app.attachments import attachment_of

    kept = media_store(store)
    media = []
    for entry in record.media:
        try:
            data = kept.get(entry["sha256"])
        except SnapshotError as exc:
            raise SnapshotError(f"session '{name}': {exc}; its transcript was left as it is") from None
        media.append(attachment_of(entry["name"], data))
        keeper.media[entry["sha256"]] = entry
    with_projector(backend, model_path, keeper.projector, media, keeper.checked)


class LocalHost:
    """Models loaded here, one per session."""

    capabilities = LOCAL

    def create(self, opts: TurnOptions, env: Environment, name: str | None = None,
               media: Sequence[Attachment] = ()) -> Opened:
        projector = given_projector(opts.mmproj)  # (a wrong one is said before the model loads)
        model_name, model_path, session = open_session(opts, env)
        try:
            marks = with_projector(session.backend, model_path, projector, media,
                                   env.dirs.checked_projectors) if media else []
        except BaseException:
            session.close()
            raise
        return Opened(session, LocalKeeper(model_name, model_path, model_fingerprint(model_path, env),
                                           env.max_state_bytes,
                                           verbose=opts.verbose, cache=open_cache(env, opts.no_cache),
                                           projector=projector, checked=env.dirs.checked_projectors),
                      placement_notices(session.backend, opts), media_marks=marks)

    def resume(self, store: SessionStore, name: str, record: Transcript, messages: list[Message],
               opts: TurnOptions, env: Environment, on_progress: ProgressFn | None = None) -> Opened:
        params = sampling_params(opts, env, saved_params(store, name, record))
        parse_logit_bias(opts.logit_bias)
        saved_ctx = record.context
        if opts.kv_type is None and saved_ctx["kv_type"] not in KV_TYPES:
            raise SnapshotError(f"session '{name}' is damaged: its KV cache type '{saved_ctx['kv_type']}' is not one "
                                f"quipu knows ({', '.join(KV_TYPES)}); {store.transcript_path(name)} was left as it "
                                "is (--kv-type continues it with another)")
        if not ((saved_ctx["n_ctx"] == 0 or MIN_CTX <= saved_ctx["n_ctx"] <= MAX_CTX)
                and 1 <= saved_ctx["n_batch"] <= MAX_CTX):
            raise SnapshotError(f"session '{name}' is damaged: its context of {saved_ctx['n_ctx']} tokens (in steps of "
                                f"{saved_ctx['n_batch']}) is none llama.cpp can make; {store.transcript_path(name)} "
                                "was left as it is")
        given = given_projector(opts.mmproj)
        where = offload(opts, env)
        model_name, model_path, model_fp = self._resume_model(name, record.model, opts, env)
        same_model = model_fp == record.model.get("fingerprint")
        settings = context_settings(opts, env)
        settings = ContextSettings(
            n_ctx=opts.ctx or saved_ctx["n_ctx"], n_batch=saved_ctx["n_batch"], n_threads=settings.n_threads,
            kv_type=opts.kv_type or saved_ctx["kv_type"], flash_attn=opts.flash_attn or remembered_flash_attn(saved_ctx),
            swa_full=settings.swa_full or saved_ctx.get("swa_full") is True,
        )
        started = time.perf_counter()
        backend = load_where_it_ran(model_path, settings, opts, where, record.model.get("placement"))
        notices: list[str] = placement_notices(backend, opts)
        saved = record.model.get("projector")
        keeper = LocalKeeper(model_name, model_path, model_fp, env.max_state_bytes, verbose=opts.verbose,
                             cache=open_cache(env, opts.no_cache),
                             projector=given or (saved if isinstance(saved, str) else None),
                             checked=env.dirs.checked_projectors)
        try:
            load_s = time.perf_counter() - started

            def stats() -> Stats:  # (the session's figures so far: the model's load)
                return Stats(load_s=load_s, placement=placement_of(backend))

            params = with_logit_biases(params, backend, opts)
            if record.media:
                take_saved_media(backend, store, name, record, model_path, keeper)
            if same_model:
                moved = moved_notice(name, record.model.get("placement"), backend)
                if moved:
                    notices.append(moved)
                restoring = time.perf_counter()  # a rebuild from the transcript is part of restoring
                snap = Snapshot(record.tokens, record.n_decoded, record.draws, params, saved_ctx)
                reason = self._attach_state(store, name, snap, backend, model_fp, keeper)
                if reason:
                    notices.append(f"session '{name}': {reason}; re-reading its context from the transcript")
                try:
                    session = InferenceSession.from_snapshot(backend, snap, on_progress, stats=stats(),
                                                             started=restoring)
                except (EngineError, SnapshotError) as exc:
                    notices.append(f"session '{name}': {exc}; re-reading its context from the transcript")
                    snap.state, snap.pieces, snap.state_decoded, keeper.chain = None, (), None, None
                    session = InferenceSession.from_snapshot(backend, snap, on_progress, stats=stats(),
                                                             started=restoring)
                if session.rebuilt_tokens == 0 and snap.state is not None:
                    keeper.saved_state = state_key(session)
                elif snap.state is None:
                    keeper.chain = None
            else:
                notices.append(made_elsewhere(name, record, model_name, messages))
                session = InferenceSession(backend, params, draws=record.draws, stats=stats())
        except BaseException:
            backend.close()
            raise
        return Opened(session, keeper, notices)

    @staticmethod
    def _resume_model(name: str, saved: dict[str, Any], opts: TurnOptions,
                      env: Environment) -> tuple[str, Path, str]:
        """(name, file, fingerprint) of the model a session continues with: --model's, else the
        one it was saved with, where it was or found again by name."""
        if opts.model:
            given, at = env.resolve_model(opts.model, fall_back=False)
            return given, at, model_fingerprint(at, env)
        path = Path(str(saved.get("path", "")))
        if path.is_file() and model_fingerprint(path, env) == saved.get("fingerprint"):
            return str(saved.get("name", path.stem)), path, saved["fingerprint"]
        try:  # the file moved, or the bundled package was reinstalled elsewhere: look it up by name
            found = env.resolve_model(str(saved.get("name", "")), fall_back=False)
        except UsageError:
            found = None
        if found is not None and model_fingerprint(found[1], env) == saved.get("fingerprint"):
            return found[0], found[1], saved["fingerprint"]
        raise ModelMismatch(
            f"session '{name}' was made with {saved.get('name', '?')} ({saved.get('path', '?')}), which is gone "
            "or has changed; pass --model to continue it with another model (re-read from the transcript)"
        )

    @staticmethod
    def _attach_state(store: SessionStore, name: str, snap: Snapshot, backend: Backend, model_fp: str,
                      keeper: "LocalKeeper") -> str | None:
        """Puts the verified KV bytes into `snap`; returns why not, if they cannot be used."""
        blob, why = store.load_state(name)
        if blob is None:
            return why
        meta = blob.meta
        if meta.get("fingerprint") != model_fp:
            return "the saved context state belongs to another model"
        if meta.get("build") != backend.build:
            return f"the saved context state was made by {meta.get('build', 'another build')}"
        saved = meta.get("context")
        if not isinstance(saved, dict):
            return "the saved context state names no context settings"
        saved = saved_state_key(saved)
        layout = layout_differs(saved, backend.context)
        if layout:
            return layout
        if saved != backend.context.state_key():
            return "the saved context state was made with other context settings"
        if not isinstance(meta.get("n_decoded"), int) or meta["n_decoded"] < 0:
            return "the saved context state is from another turn"
        # The pieces after it, then: what the tokens beyond them are is read again (a turn whose
        # state was not written, or a damaged piece and those after it).
        held = held_cells(meta, store.load_pieces(name), snap.tokens[:snap.n_decoded], LAYOUT)
        if held.cells == 0 and not held.pieces:
            return held.why
        snap.state, snap.pieces = blob.state, [(p.meta["start"], p.state) for p in held.pieces]
        snap.state_decoded = held.cells if held.cells < snap.n_decoded else None
        snap.context = saved
        keeper.chain = held.chain(meta, len(blob.state))
        return held.why

    def close(self) -> None:
        pass  # each session's model is closed with the session


MAX_PIECES = 64  # a longer chain is saved whole again (as is one whose pieces outgrow the state file)


@dataclass
class LocalKeeper:
    """A local session's model, and the state file beside its transcript."""

    model_name: str
    model_path: Path
    model_fingerprint: str
    max_state_bytes: int = DEFAULT_MAX_STATE_BYTES
    # What the state file on disk holds (decoded tokens and context settings), when it is
    # known to be current: a save with nothing new in the context leaves the file alone.
    saved_state: tuple[Any, ...] | None = None
    chain: Chain | None = None  # what the state file and its log hold, when known
    verbose: bool = False
    cache: PromptCache | None = None  # the prompt cache this run uses (None: --no-cache)
    background: bool = False  # (a chat's: the state written while the user types)
    media: dict[str, dict[str, Any]] = field(default_factory=dict)  # what the transcript says of each medium, by SHA-256
    # The projector the session was given (--mmproj), kept for the media it is given later.
    projector: str | None = None
    checked: Path | None = None  # the marks of projectors checked before (`with_projector`)
    _writer: threading.Thread | None = None
    _failed: str | None = None

    def fields(self, session: InferenceSession) -> dict[str, Any]:
        loaded = session.backend.projector_path
        projector = str(loaded.resolve()) if loaded is not None else self.projector
        return {
            "model": {"name": self.model_name, "path": str(self.model_path.resolve()),
                      "fingerprint": self.model_fingerprint, "placement": session.backend.placement.key(),
                      **({"projector": projector} if projector is not None else {})},
            "media": [self.media[d] for d in session.backend.media_digests() if d in self.media],
            "params": session.params.to_dict(), "context": session.backend.context.state_key(),
            "tokens": list(session.tokens), "n_decoded": session.n_decoded, "draws": session.draws,
            "build": session.backend.build,
        }

    def take_media(self, session: InferenceSession, store: SessionStore | None, media: Sequence[Attachment]) -> str:
        marks = "".join(with_projector(session.backend, self.model_path, self.projector, media, self.checked))
        for medium in media:
            if store is not None:  # (a session's: kept before the transcript that names it)
                media_store(store).put(medium.data)
            self.media.setdefault(medium.digest, medium.entry())
        return marks

    def trim_media(self, session: InferenceSession, texts: Sequence[str]) -> list[str]:
        backend = session.backend
        named = {(t - MEDIA_BASE) // MEDIA_SPAN for t in session.tokens if t >= MEDIA_BASE}
        named |= {int(found.group(1)) for text in texts for found in MEDIA_MARK.finditer(text)}
        dropped = backend.drop_media_after(max(named) + 1 if named else 0)
        kept = set(backend.media_digests())
        for digest in dropped:
            if digest not in kept:
                self.media.pop(digest, None)
        return [d for d in dropped if d not in kept]

    def save(self, store: SessionStore, name: str, record: Transcript, session: InferenceSession) -> list[str]:
        """Transcript and state, each atomically: at worst the turn in progress is lost. The
        state is written only when the context's decoded tokens or settings changed, and then
        only what the turn added where it can be (a piece of the state log). With `background`
        (a chat), the state's bytes are taken now, the transcript written, and the state
        written while the user types: a crash before it is on disk costs re-reading that turn."""
        notices = self.wait()
        key = state_key(session)
        if key == self.saved_state and store.has_state(name):
            store.save(name, record, KEEP_STATE)
        else:
            write, why = self._piece(store, name, session, key, session.take_low_water())
            if write is None:
                if self.verbose and self.chain is not None:
                    notices.append(f"session '{name}': the context state is saved whole ({why})")
                write = self._whole(store, name, record, session, key)
            self.saved_state = key
            if self.background:
                store.save(name, record, KEEP_STATE)
                self._writer = threading.Thread(target=self._write, args=(write, name), daemon=True)
                self._writer.start()
            else:
                write()
                store.save(name, record, KEEP_STATE)
        return notices + [f"session '{dropped}' lost its saved context to the disk budget; it will be re-read"
                          for dropped in store.enforce_budget(self.max_state_bytes, keep=name)]

    def _write(self, write: Callable[[], None], name: str) -> None:
        try:
            write()
        except Exception as exc:  # (the transcript is safe: the turn is read again on resume)
            self.saved_state, self.chain = None, None
            self._failed = f"session '{name}': its context state could not be written ({exc}); it will be re-read"

    def wait(self) -> list[str]:
        """Waits for a state being written in the background; what went wrong with it."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        failed, self._failed = self._failed, None
        return [failed] if failed else []

    def _whole(self, store: SessionStore, name: str, record: Transcript, session: InferenceSession,
               key: tuple[Any, ...]) -> Callable[[], None]:
        """The state saved whole (a new state file; the log after the old one goes), to write."""
        nonce = secrets.token_hex(8)
        meta = {
            "fingerprint": self.model_fingerprint,
            "build": session.backend.build,
            "context": record.context,
            "n_decoded": session.n_decoded,
            "tokens_sha256": key[1],
            "quipu": __version__,
            "created": record.updated,
            "nonce": nonce,  # (the pieces of the log after it name it)
            "tokens": session.tokens[:session.n_decoded],
        }
        state = session.backend.snapshot_bytes()
        held = session.n_decoded

        def write() -> None:
            store.write_state(name, state, meta)
            self.chain = Chain(nonce, held, base_bytes=len(state))

        return write

    def _piece(self, store: SessionStore, name: str, session: InferenceSession, key: tuple[Any, ...],
               low_water: int) -> tuple[Callable[[], None] | None, str | None]:
        """Only the cells the context gained since the last save (the context has held no fewer
        than `low_water` tokens since), as a piece of the state log, to write; or None and why it
        cannot be (the state is then saved whole)."""
        chain, backend = self.chain, session.backend
        if chain is None or chain.nonce is None or not store.has_state(name):
            return None, "no state file to add to"
        # The piece replaces the cells from where the context went back to, if it did (the
        # last reply's end token, which the template writes its own way; an /undo), and adds the new.
        start = min(low_water, chain.held)
        unsupported = backend.partial_state(start)
        if unsupported:
            return None, f"{unsupported} is saved whole"
        if (session.n_decoded - start) * 2 > session.n_decoded:  # (none new: a piece that only cuts)
            return None, "most of the context is new"
        if chain.pieces >= MAX_PIECES or chain.piece_bytes > chain.base_bytes:
            return None, "the pieces are many: put together again"
        piece = backend.state_since(start)
        try:
            made = check_piece(piece, seq_id=1, cells=session.n_decoded - start, first=start, n_layer=backend.n_layer,
                               window=backend.piece_window())
        except SnapshotError as exc:
            return None, f"the state's layout is not the one quipu reads: {exc}"
        if made.v_trans != backend.context.v_trans:
            return None, "the state's V layout is not the one its context settings record"
        meta = {"base": chain.nonce, "start": start, "n_decoded": session.n_decoded, "tokens_sha256": key[1],
                "layout": LAYOUT, "build": backend.build}
        held = session.n_decoded

        def write() -> None:
            end = store.append_piece(name, meta, piece, chain.log_end)
            self.chain = Chain(chain.nonce, held, chain.pieces + 1, chain.piece_bytes + len(piece),
                               chain.base_bytes, end)

        return write, None

    def warm(self, session: InferenceSession, tokens: Callable[[], list[int]]) -> "CacheUse | None":
        """A new context's first prompt begins, perhaps, as earlier runs' did (a long system
        prompt): the cached beginning is restored, and the turn reads only the rest."""
        if session.n_decoded or self.cache is None:
            return None
        return cache_lookup(session, tokens(), self.model_fingerprint, self.cache)

    def remember(self, session: InferenceSession, use: "CacheUse | None") -> list[str]:
        """After a one-shot answer is out: the prompt's state joins the cache."""
        if use is None:
            return []
        cache_save(session, use)
        return use.cache.notes if self.verbose else []  # a damaged entry is dropped quietly, said when asked

    def cached(self, session: InferenceSession, tokens: list[int]) -> int:
        """How many of `tokens` the prompt cache would restore (`--show-prompt`)."""
        return cached_count(session, tokens, self.model_fingerprint, self.cache) if self.cache is not None else 0

    def model_for_new(self, opts: TurnOptions) -> str | None:
        return str(self.model_path)
