"""A local model: the host that loads the GGUF file with llama.cpp, and what a session keeps
besides its transcript (`LocalKeeper`), by job: its context state in a state file beside the
transcript, restored instead of read again (`state_file.py`; what the files hold is read from
their metadata by `store/chain.py`), the prompt cache that lets a new prompt restore the
beginning it shares with earlier ones (`prompt_cache.py`), and its media (`local_media.py`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from quipu.app.attachments import Attachment
from quipu.app.environment import Environment
from quipu.app.hosts import Opened, made_elsewhere, saved_params
from quipu.app.local_media import KeptMedia, given_projector, with_projector
from quipu.app.placing import load_where_it_ran, moved_notice, placement_notices, placement_of
from quipu.app.prompt_cache import CacheUse, PromptCache, open_cache
from quipu.app.state_file import APART, StateFile, saved_recurrent
from quipu.app.turn_options import (
    TurnOptions,
    context_settings,
    load_backend,
    offload,
    sampling_params,
    with_logit_biases,
)
from quipu.engine.base import Backend, ProgressFn
from quipu.engine.settings import (
    KV_TYPES,
    MAX_CTX,
    MIN_CTX,
    ContextSettings,
    layout_differs,
    remembered_flash_attn,
    saved_state_key,
)
from quipu.engine.kvstate import LAYOUT
from quipu.errors import EngineError, ModelMismatch, SnapshotError, UsageError
from quipu.models import file_identity, fingerprint, head_fingerprint, whole_file
from quipu.sessions.base import LOCAL, Stats
from quipu.sessions.inference import InferenceSession, Snapshot
from quipu.store.chain import Chain, held_cells
from quipu.store.fingerprints import Fingerprints
from quipu.store.store import SessionStore
from quipu.store.transcript import Transcript


def model_fingerprint(path: Path, env: Environment) -> str:
    """`models.fingerprint` of a model file, remembered across runs in the cache folder."""
    memo = Fingerprints(env.dirs.cache / "fingerprints.json")
    where, identity = path.resolve(), file_identity(path)
    found = memo.recall(where, identity)
    if found is None or not whole_file(found):  # (one of the first 8 MiB alone, as quipu kept them before)
        found = fingerprint(path)
        memo.keep(where, identity, found)
    return found


def names_model(saved: object, path: Path, current: str) -> bool:
    """Whether the fingerprint a session saved (`saved`) names the model file at `path`, whose
    fingerprint is `current`: the same, or, saved before fingerprints covered the whole file, the
    one its start gave then (the session is known again; its state is not trusted: `_with_state`)."""
    if saved == current:
        return True
    return isinstance(saved, str) and not whole_file(saved) and saved == head_fingerprint(path)


def open_session(opts: TurnOptions, env: Environment,
                 loaded: Backend | None = None) -> tuple[str, Path, str, InferenceSession]:
    """(model name, model file, its fingerprint, a fresh session on it), with the load time in its
    stats. Options are checked before the model is loaded; a model `loaded` already (a server's)
    is not loaded again: the session is a context of its own on it. A file quipu has not met is
    hashed while it loads."""
    params = sampling_params(opts, env)
    settings = context_settings(opts, env)
    where = offload(opts, env)
    model_name, model_path = env.resolve_model(opts.model)
    hashed = hashing(model_path, env)
    started = time.perf_counter()
    backend = _on(loaded, model_path, settings) or load_backend(model_path, settings, opts.verbose, where)
    try:
        stats = Stats(load_s=time.perf_counter() - started, placement=placement_of(backend))
        session = InferenceSession(backend, with_logit_biases(params, backend.vocab, opts), stats=stats)
        model_fp = hashed()
    except BaseException:
        backend.close()
        raise
    return model_name, model_path, model_fp, session


def hashing(path: Path, env: Environment) -> Callable[[], str]:
    """`model_fingerprint(path, env)` begun on a thread of its own (a new file's hash beside its
    load); what waits for it."""
    import threading

    done: list[str | BaseException] = []

    def run() -> None:
        try:
            done.append(model_fingerprint(path, env))
        except BaseException as exc:  # (raised where it is waited for)
            done.append(exc)

    thread = threading.Thread(target=run, name="quipu-fingerprint", daemon=True)
    thread.start()

    def result() -> str:
        thread.join()
        if isinstance(done[0], BaseException):
            raise done[0]
        return done[0]
    return result


def _on(loaded: Backend | None, model_path: Path, settings: ContextSettings) -> Backend | None:
    """A new context with `settings` on the model `loaded` already, where it is `model_path`'s."""
    if loaded is None or Path(loaded.model_path).resolve() != model_path.resolve():
        return None
    return loaded.reopen(settings)


class LocalHost:
    """Models loaded here, one per session; or, for sessions on the model `loaded` already (a
    server's), a context of their own on it."""

    capabilities = LOCAL

    def __init__(self, loaded: Backend | None = None):
        self.loaded = loaded

    def create(self, opts: TurnOptions, env: Environment, name: str | None = None,
               media: Sequence[Attachment] = ()) -> Opened[InferenceSession]:
        projector = given_projector(opts.mmproj)  # (a wrong one is said before the model loads)
        model_name, model_path, model_fp, session = open_session(opts, env, self.loaded)
        try:
            marks = with_projector(session.backend, model_path, projector, media,
                                   env.dirs.checked_projectors) if media else []
        except BaseException:
            session.close()
            raise
        keeper = self.keeper(model_name, model_path, model_fp, opts, env, projector)
        said = placement_notices(session.backend, ctx_given=opts.ctx is not None, verbose=opts.verbose)
        return Opened(session, keeper, said, media_marks=marks)

    @staticmethod
    def keeper(model_name: str, model_path: Path, model_fp: str, opts: TurnOptions, env: Environment,
                projector: str | None) -> LocalKeeper:
        return LocalKeeper(model_name, model_path, model_fp,
                           StateFile(model_fp, env.max_state_bytes, verbose=opts.verbose),
                           PromptCache(open_cache(env, opts.no_cache), model_fp,
                                       lambda projector: model_fingerprint(projector, env), verbose=opts.verbose),
                           KeptMedia(model_path, projector, env.dirs.checked_projectors))

    def resume(self, store: SessionStore, name: str, record: Transcript, opts: TurnOptions, env: Environment,
               on_progress: ProgressFn | None = None) -> Opened[InferenceSession]:
        params = sampling_params(opts, env, saved_params(store, name, record))
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
        same_model = names_model(record.model.get("fingerprint"), model_path, model_fp)
        settings = context_settings(opts, env)
        settings = ContextSettings(
            n_ctx=opts.ctx or saved_ctx["n_ctx"], n_batch=saved_ctx["n_batch"], n_threads=settings.n_threads,
            kv_type=opts.kv_type or saved_ctx["kv_type"], flash_attn=opts.flash_attn or remembered_flash_attn(saved_ctx),
            swa_full=settings.swa_full or saved_ctx.get("swa_full") is True,
        )
        started = time.perf_counter()
        backend = _on(self.loaded, model_path, settings) or \
            load_where_it_ran(model_path, settings, opts.verbose, where, record.model.get("placement"))
        notices: list[str] = placement_notices(backend, ctx_given=opts.ctx is not None, verbose=opts.verbose)
        saved = record.model.get("projector")
        keeper = self.keeper(model_name, model_path, model_fp, opts, env,
                              given or (saved if isinstance(saved, str) else None))
        try:
            load_s = time.perf_counter() - started

            def stats() -> Stats:  # (the session's figures so far: the model's load)
                return Stats(load_s=load_s, placement=placement_of(backend))

            params = with_logit_biases(params, backend.vocab, opts)
            if record.media:
                keeper.media.restore(backend, store, name, record)
            if same_model:
                moved = moved_notice(name, record.model.get("placement"), backend)
                if moved:
                    notices.append(moved)
                restoring = time.perf_counter()  # a rebuild from the transcript is part of restoring
                bare = Snapshot(record.tokens, record.n_decoded, record.draws, params, saved_ctx)
                snap, chain, reason = self._with_state(store, name, bare, backend, model_fp)
                if reason:
                    notices.append(f"session '{name}': {reason}; re-reading its context from the transcript")
                try:
                    session = InferenceSession.from_snapshot(backend, snap, on_progress, stats=stats(),
                                                             started=restoring)
                except (EngineError, SnapshotError) as exc:
                    notices.append(f"session '{name}': {exc}; re-reading its context from the transcript")
                    snap, chain = bare, None
                    session = InferenceSession.from_snapshot(backend, snap, on_progress, stats=stats(),
                                                             started=restoring)
                whole = session.rebuilt_tokens == 0 and snap.state is not None  # (the file is current for it)
                keeper.state.holds(chain, session if whole else None)
            else:
                notices.append(made_elsewhere(name, record, model_name))
                session = InferenceSession(backend, params, draws=record.draws, stats=stats())
        except BaseException:
            backend.close()
            raise
        return Opened(session, keeper, notices, reread=not same_model)

    @staticmethod
    def _resume_model(name: str, saved: dict[str, Any], opts: TurnOptions,
                      env: Environment) -> tuple[str, Path, str]:
        """(name, file, fingerprint) of the model a session continues with: --model's, else the
        one it was saved with, where it was or found again by name."""
        if opts.model:
            given, at = env.resolve_model(opts.model, fall_back=False)
            return given, at, model_fingerprint(at, env)
        path = Path(str(saved.get("path", "")))
        if path.is_file():
            model_fp = model_fingerprint(path, env)
            if names_model(saved.get("fingerprint"), path, model_fp):
                return str(saved.get("name", path.stem)), path, model_fp
        try:  # the file moved, or the bundled package was reinstalled elsewhere: look it up by name
            found = env.resolve_model(str(saved.get("name", "")), fall_back=False)
        except UsageError:
            found = None
        if found is not None:
            model_fp = model_fingerprint(found[1], env)
            if names_model(saved.get("fingerprint"), found[1], model_fp):
                return found[0], found[1], model_fp
        raise ModelMismatch(
            f"session '{name}' was made with {saved.get('name', '?')} ({saved.get('path', '?')}), which is gone "
            "or has changed; pass --model to continue it with another model (re-read from the transcript)"
        )

    @staticmethod
    def _with_state(store: SessionStore, name: str, snap: Snapshot, backend: Backend,
                    model_fp: str) -> tuple[Snapshot, Chain | None, str | None]:
        """`snap` with the verified KV bytes of its state file, and what the file holds; or `snap`
        as it is, and why they cannot be used."""
        blob, why = store.load_state(name)
        if blob is None:
            return snap, None, why
        meta = blob.meta
        saved = meta.get("context")
        saved_fp = meta.get("fingerprint")
        refused = ("the saved context state names its model by the start of its file alone, as quipu did before"
                   if isinstance(saved_fp, str) and not whole_file(saved_fp) and names_model(saved_fp, backend.model_path,
                                                                                           model_fp) else
                   "the saved context state belongs to another model" if saved_fp != model_fp else
                   f"the saved context state was made by {meta.get('build', 'another build')}"
                   if meta.get("build") != backend.build else
                   "the saved context state names no context settings" if not isinstance(saved, dict) else None)
        if refused is not None or not isinstance(saved, dict):
            return snap, None, refused
        saved = saved_state_key(saved)
        refused = layout_differs(saved, backend.context) or (
            "the saved context state was made with other context settings" if saved != backend.context.state_key()
            else "the saved context state is from another turn"
            if not isinstance(meta.get("n_decoded"), int) or meta["n_decoded"] < 0 else None)
        if refused is not None:
            return snap, None, refused
        # The pieces after it, then: what the tokens beyond them are is read again (a turn whose
        # state was not written, or a damaged piece and those after it).
        tokens = snap.tokens[:snap.n_decoded]
        held = held_cells(meta, store.load_pieces(name), tokens, LAYOUT)
        if held.cells == 0 and not held.pieces:
            return snap, None, held.why
        cells, recurrent = held.cells, []
        if backend.memory.recurrent:  # (its recurrent state kept apart: the cells end where the last one usable is)
            if meta.get("recurrent") != APART:
                return snap, None, "the saved context state keeps its recurrent state as quipu did before"
            found, wrong = store.load_recurrent(name)
            recurrent = saved_recurrent(found, meta, tokens, held.cells)
            if not recurrent:
                return snap, None, wrong or ("the saved recurrent state is from another turn" if found
                                             else "its recurrent state was not saved")
            cells = recurrent[-1].n
        restored = replace(snap, state=blob.state, pieces=[(p.meta["start"], p.state) for p in held.pieces],
                           state_decoded=cells if cells < snap.n_decoded else None, context=saved,
                           recurrent=recurrent)
        return restored, held.chain(meta, len(blob.state)), held.why

    def close(self) -> None:
        pass  # each session's model is closed with the session


@dataclass
class LocalKeeper:
    """A local session's model, and what it keeps besides its transcript, each part by its job:
    the state file (`state`), the prompt cache (`cache`), its media (`media`)."""

    model_name: str
    model_path: Path
    model_fingerprint: str
    state: StateFile
    cache: PromptCache
    media: KeptMedia

    def fields(self, session: InferenceSession) -> dict[str, Any]:
        loaded = session.backend.media.projector_path
        projector = str(loaded.resolve()) if loaded is not None else self.media.projector
        return {
            "model": {"name": self.model_name, "path": str(self.model_path.resolve()),
                      "fingerprint": self.model_fingerprint, "placement": session.backend.placement.key(),
                      **({"projector": projector} if projector is not None else {})},
            "media": self.media.saved(session.backend),
            "params": session.params.to_dict(), "context": session.backend.context.state_key(),
            "tokens": list(session.tokens), "n_decoded": session.n_decoded, "draws": session.draws,
            "build": session.backend.build,
        }

    def save(self, store: SessionStore, name: str, record: Transcript, session: InferenceSession,
             next_keeps: Callable[[], int] | None = None) -> list[str]:
        # (a recurrent state is saved as of where the next turn goes back to, if before its end)
        until = next_keeps() if next_keeps is not None and session.backend.memory.recurrent else None
        return self.state.save(store, name, record, session, until)

    def wait(self) -> list[str]:
        return self.state.wait()

    def write_behind(self) -> None:
        self.state.write_behind()

    def take_media(self, session: InferenceSession, store: SessionStore | None, media: Sequence[Attachment]) -> str:
        return self.media.take(session.backend, store, media)

    def trim_media(self, session: InferenceSession, texts: Sequence[str]) -> list[str]:
        return self.media.trim(session.backend, session.tokens, texts)

    def warm(self, session: InferenceSession, tokens: Callable[[], list[int]]) -> CacheUse | None:
        return self.cache.warm(session, tokens)

    def remember(self, session: InferenceSession, use: CacheUse | None) -> list[str]:
        return self.cache.remember(session, use)

    def cached(self, session: InferenceSession, tokens: list[int]) -> int:
        return self.cache.cached(session, tokens)

    def model_for_new(self, opts: TurnOptions, env: Environment) -> str | None:
        # (by its name where the name finds this very file, so that the new session records the
        # model as this one does; else by its file)
        try:
            if env.resolve_model(self.model_name)[1].resolve() == self.model_path.resolve():
                return self.model_name
        except UsageError:
            pass
        return str(self.model_path)
