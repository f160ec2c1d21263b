"""A local model: the host that loads the GGUF file with llama.cpp, a session's context state
kept in a state file beside its transcript (restored instead of read again), and the prompt
cache that lets a new prompt restore the beginning it shares with earlier ones."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from quipu import __version__
from quipu.app.environment import (
    DEFAULT_MAX_STATE_BYTES,
    Environment,
    TurnOptions,
    context_settings,
    load_backend,
    parse_logit_bias,
    sampling_params,
    with_logit_biases,
)
from quipu.app.hosts import Opened, made_elsewhere, saved_params
from quipu.engine.base import KV_TYPES, ContextSettings, ProgressFn
from quipu.errors import EngineError, ModelMismatch, SnapshotError, UsageError
from quipu.models import fingerprint
from quipu.sessions.base import LOCAL, Message
from quipu.sessions.inference import InferenceSession, Snapshot
from quipu.store.cache import MIN_TOKENS, PromptCache
from quipu.store.store import KEEP_STATE, SessionStore
from quipu.store.transcript import Transcript


def tokens_digest(tokens: list[int]) -> str:
    return hashlib.sha256(json.dumps(tokens, separators=(",", ":")).encode()).hexdigest()


def state_key(session: InferenceSession) -> tuple:
    """What a state file's bytes depend on: the decoded tokens and the context settings."""
    key = session.backend.context.state_key()
    return (session.n_decoded, tokens_digest(session.tokens[: session.n_decoded]), tuple(sorted(key.items())))


def open_session(opts: TurnOptions, env: Environment) -> tuple[str, Path, InferenceSession]:
    """(model name, model file, a fresh session on it), with the load time in its stats. Options
    are checked before the model is loaded."""
    params = sampling_params(opts, env)
    settings = context_settings(opts, env)
    parse_logit_bias(opts.logit_bias)
    model_name, model_path = env.resolve_model(opts.model)
    started = time.perf_counter()
    backend = load_backend(model_path, settings, opts.verbose)
    try:
        session = InferenceSession(backend, with_logit_biases(params, backend, opts))
    except BaseException:
        backend.close()
        raise
    session.stats.load_s = time.perf_counter() - started
    return model_name, model_path, session


class LocalHost:
    """Models loaded here, one per session."""

    capabilities = LOCAL

    def create(self, opts: TurnOptions, env: Environment, name: str | None = None) -> Opened:
        model_name, model_path, session = open_session(opts, env)
        return Opened(session, LocalKeeper(model_name, model_path, fingerprint(model_path), env.max_state_bytes))

    def resume(self, store: SessionStore, name: str, record: Transcript, messages: list[Message],
               opts: TurnOptions, env: Environment, on_progress: ProgressFn | None = None) -> Opened:
        params = sampling_params(opts, env, saved_params(store, name, record))
        parse_logit_bias(opts.logit_bias)
        saved_ctx = record.context
        if opts.kv_type is None and saved_ctx["kv_type"] not in KV_TYPES:
            raise SnapshotError(f"session '{name}' is damaged: its KV cache type '{saved_ctx['kv_type']}' is not one "
                                f"quipu knows ({', '.join(KV_TYPES)}); {store.transcript_path(name)} was left as it "
                                "is (--kv-type continues it with another)")
        model_name, model_path = self._resume_model(name, record.model, opts, env)
        model_fp = fingerprint(model_path)
        same_model = model_fp == record.model.get("fingerprint")
        settings = context_settings(opts, env)
        settings = ContextSettings(
            n_ctx=opts.ctx or saved_ctx["n_ctx"], n_batch=saved_ctx["n_batch"], n_threads=settings.n_threads,
            kv_type=opts.kv_type or saved_ctx["kv_type"],
        )
        started = time.perf_counter()
        backend = load_backend(model_path, settings, opts.verbose)
        notices: list[str] = []
        keeper = LocalKeeper(model_name, model_path, model_fp, env.max_state_bytes)
        try:
            load_s = time.perf_counter() - started
            params = with_logit_biases(params, backend, opts)
            if same_model:
                restoring = time.perf_counter()  # a rebuild from the transcript is part of restoring
                snap = Snapshot(record.tokens, record.n_decoded, record.draws, params, saved_ctx)
                reason = self._attach_state(store, name, snap, backend, model_fp)
                if reason:
                    notices.append(f"session '{name}': {reason}; re-reading its context from the transcript")
                try:
                    session = InferenceSession.from_snapshot(backend, snap, on_progress)
                except (EngineError, SnapshotError) as exc:
                    notices.append(f"session '{name}': {exc}; re-reading its context from the transcript")
                    snap.state = None
                    session = InferenceSession.from_snapshot(backend, snap, on_progress)
                session.stats.restore_s = time.perf_counter() - restoring
                if session.rebuilt_tokens == 0 and snap.state is not None:
                    keeper.saved_state = state_key(session)
            else:
                notices.append(made_elsewhere(name, record, model_name, messages))
                session = InferenceSession(backend, params)
                session.draws = record.draws
            session.stats.load_s = load_s
        except BaseException:
            backend.close()
            raise
        return Opened(session, keeper, notices)

    @staticmethod
    def _resume_model(name: str, saved: dict[str, Any], opts: TurnOptions, env: Environment) -> tuple[str, Path]:
        if opts.model:
            return env.resolve_model(opts.model, fall_back=False)
        path = Path(str(saved.get("path", "")))
        if path.is_file() and fingerprint(path) == saved.get("fingerprint"):
            return str(saved.get("name", path.stem)), path
        try:  # the file moved, or the bundled package was reinstalled elsewhere: look it up by name
            found = env.resolve_model(str(saved.get("name", "")), fall_back=False)
        except UsageError:
            found = None
        if found is not None and fingerprint(found[1]) == saved.get("fingerprint"):
            return found
        raise ModelMismatch(
            f"session '{name}' was made with {saved.get('name', '?')} ({saved.get('path', '?')}), which is gone "
            "or has changed; pass --model to continue it with another model (re-read from the transcript)"
        )

    @staticmethod
    def _attach_state(store: SessionStore, name: str, snap: Snapshot, backend, model_fp: str) -> str | None:
        """Puts the verified KV bytes into `snap`; returns why not, if they cannot be used."""
        blob, why = store.load_state(name)
        if blob is None:
            return why
        meta = blob.meta
        if meta.get("fingerprint") != model_fp:
            return "the saved context state belongs to another model"
        if meta.get("build") != backend.build:
            return f"the saved context state was made by {meta.get('build', 'another build')}"
        if meta.get("context") != backend.context.state_key():
            return "the saved context state was made with other context settings"
        if meta.get("n_decoded") != snap.n_decoded or meta.get("tokens_sha256") != tokens_digest(
            snap.tokens[: snap.n_decoded]
        ):
            return "the saved context state is from another turn"
        snap.state = blob.state
        snap.context = meta["context"]
        return None

    def close(self) -> None:
        pass  # each session's model is closed with the session


@dataclass
class LocalKeeper:
    """A local session's model, and the state file beside its transcript."""

    model_name: str
    model_path: Path
    model_fingerprint: str
    max_state_bytes: int = DEFAULT_MAX_STATE_BYTES
    # What the state file on disk holds (decoded tokens and context settings), when it is
    # known to be current: a save with nothing new in the context leaves the file alone.
    saved_state: tuple | None = None

    def fields(self, session: InferenceSession) -> dict:
        return {
            "model": {"name": self.model_name, "path": str(self.model_path.resolve()),
                      "fingerprint": self.model_fingerprint},
            "params": session.params.to_dict(), "context": session.backend.context.state_key(),
            "tokens": list(session.tokens), "n_decoded": session.n_decoded, "draws": session.draws,
            "build": session.backend.build,
        }

    def save(self, store: SessionStore, name: str, record: Transcript, session: InferenceSession) -> list[str]:
        """Transcript and state, each atomically: at worst the turn in progress is lost. The
        state file is rewritten only when the context's decoded tokens or settings changed."""
        key = state_key(session)
        if key == self.saved_state and store.has_state(name):
            store.save(name, record, KEEP_STATE)
        else:
            meta = {
                "fingerprint": self.model_fingerprint,
                "build": session.backend.build,
                "context": record.context,
                "n_decoded": session.n_decoded,
                "tokens_sha256": key[1],
                "quipu": __version__,
                "created": record.updated,
            }
            store.save(name, record, session.backend.snapshot_bytes(), meta)
            self.saved_state = key
        return [f"session '{dropped}' lost its saved context to the disk budget; it will be re-read"
                for dropped in store.enforce_budget(self.max_state_bytes, keep=name)]

    def warm(self, session: InferenceSession, tokens: Callable[[], list[int]], opts: TurnOptions,
             env: Environment) -> "CacheUse | None":
        """A new context's first prompt begins, perhaps, as earlier runs' did (a long system
        prompt): the cached beginning is restored, and the turn reads only the rest."""
        if session.n_decoded:
            return None
        return cache_lookup(session, tokens(), self.model_path, opts, env)

    def remember(self, session: InferenceSession, use: "CacheUse | None", opts: TurnOptions) -> list[str]:
        """After a one-shot answer is out: the prompt's state joins the cache."""
        if use is None:
            return []
        cache_save(session, use)
        return use.cache.notes if opts.verbose else []  # a damaged entry is dropped quietly, said when asked

    def cached(self, session: InferenceSession, tokens: list[int], opts: TurnOptions, env: Environment) -> int:
        """How many of `tokens` the prompt cache would restore (`--show-prompt`)."""
        return cached_count(session, tokens, self.model_path, opts, env)

    def model_for_new(self, opts: TurnOptions) -> str | None:
        return str(self.model_path)


# ---- the prompt cache --------------------------------------------------------------------------

@dataclass
class CacheUse:
    cache: PromptCache
    key: dict
    tokens: list[int]
    reused: int


def cache_key(session: InferenceSession, model_path) -> dict:
    """What a cache entry's state bytes are valid under: the model, the native build, the context."""
    backend = session.backend
    return {"fingerprint": fingerprint(model_path), "build": backend.build, "context": backend.context.state_key()}


def cache_lookup(session: InferenceSession, tokens: list[int], model_path, opts: TurnOptions,
                 env: Environment) -> CacheUse | None:
    """Restores the longest cached beginning of `tokens` into the session, if any; None when the
    cache is off for this run."""
    if opts.no_cache:
        return None
    cache = PromptCache(env.dirs.prompt_cache, env.cache_max_bytes)
    key = cache_key(session, model_path)
    hit = cache.lookup(key, tokens)
    reused = 0
    if hit is not None:
        keep = min(hit.reuse, len(tokens) - 1)  # the last token is read again, for its logits
        try:
            session.restore_prefix(hit.state, hit.tokens, keep)
            reused = keep
        except EngineError as exc:
            cache.drop(hit.path, str(exc))
    return CacheUse(cache, key, tokens, reused)


def cached_count(session: InferenceSession, tokens: list[int], model_path, opts: TurnOptions,
                 env: Environment) -> int:
    """How many of `tokens` a run would restore from the prompt cache (`--show-prompt`)."""
    if opts.no_cache:
        return 0
    found = PromptCache(env.dirs.prompt_cache, env.cache_max_bytes).peek(cache_key(session, model_path), tokens)
    return min(found, len(tokens) - 1) if found else 0


def cache_save(session: InferenceSession, use: CacheUse) -> None:
    """Keeps the state of the prompt (not the reply), unless the cache had nearly all of it
    already: questions after one long beginning share one entry."""
    tokens = use.tokens
    if len(tokens) - use.reused < MIN_TOKENS or session.n_decoded < len(tokens):
        return
    try:
        session.rewind(len(tokens))
        use.cache.save(use.key, tokens, session.backend.snapshot_bytes())
    except (EngineError, OSError):
        pass  # a cache never fails a run
