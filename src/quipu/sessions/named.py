"""Named sessions: a conversation resumed from the store (or created), turned, and saved."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from quipu import __version__
from quipu.engine.base import Backend, ContextSettings, ProgressFn
from quipu.errors import (
    BadInput,
    ContextOverflow,
    EngineError,
    InvalidParameter,
    ModelMismatch,
    SnapshotError,
    UsageError,
)
from quipu.models import fingerprint
from quipu.sessions.conversation import ChatTemplate, Conversation, Message
from quipu.sessions.inference import InferenceSession, Snapshot, TokenFn
from quipu.sessions.params import SamplingParams
from quipu.sessions.runner import (
    Environment,
    TurnOptions,
    TurnResult,
    context_settings,
    load_backend,
    max_tokens,
    open_session,
    system_prompt,
)
from quipu.sessions.store import DEFAULT_MAX_STATE_BYTES, TRANSCRIPT_FORMAT, TRANSCRIPT_VERSION, SessionStore, validate_name


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def tokens_digest(tokens: list[int]) -> str:
    return hashlib.sha256(json.dumps(tokens, separators=(",", ":")).encode()).hexdigest()


def store_for(env: Environment) -> SessionStore:
    return SessionStore(env.dirs.sessions)


@dataclass
class NamedSession:
    """A Conversation bound to a session name. Open it under the store's lock for the name."""

    store: SessionStore
    name: str
    model_name: str
    model_path: Path
    model_fingerprint: str
    conversation: Conversation
    created: str
    notices: list[str] = field(default_factory=list)
    max_state_bytes: int = DEFAULT_MAX_STATE_BYTES

    @property
    def session(self) -> InferenceSession:
        return self.conversation.session

    @property
    def backend(self) -> Backend:
        return self.session.backend

    @classmethod
    def open(cls, store: SessionStore, name: str, opts: TurnOptions, env: Environment,
             on_progress: ProgressFn | None = None) -> "NamedSession":
        validate_name(name)
        record = store.load_transcript(name) if store.exists(name) else None
        if record is None:
            named = cls._create(store, name, opts, env)
        else:
            named = cls._resume(store, name, record, opts, env, on_progress)
        named.max_state_bytes = env.config.sessions.get("max_state_bytes", DEFAULT_MAX_STATE_BYTES)
        return named

    @classmethod
    def _create(cls, store: SessionStore, name: str, opts: TurnOptions, env: Environment) -> "NamedSession":
        model_name, model_path, session = open_session(opts, env)
        try:
            conv = Conversation.start(session, system_prompt(opts, env))
        except BaseException:
            session.backend.close()
            raise
        return cls(store, name, model_name, model_path, fingerprint(model_path), conv, now_iso())

    @classmethod
    def _resume(cls, store: SessionStore, name: str, record: dict[str, Any], opts: TurnOptions,
                env: Environment, on_progress: ProgressFn | None) -> "NamedSession":
        try:
            messages = [Message.from_dict(m) for m in record["messages"]]
            params = SamplingParams.from_dict(record["params"])
            saved_ctx = record["context"]
            n_ctx, n_batch, kv_type = int(saved_ctx["n_ctx"]), int(saved_ctx["n_batch"]), str(saved_ctx["kv_type"])
        except (ValueError, TypeError, KeyError, InvalidParameter) as exc:
            raise SnapshotError(
                f"session '{name}' is damaged: {exc}; {store.transcript_path(name)} was left as it is"
            ) from None
        params = params.replace(**opts.sampling())
        saved_model = record["model"]
        model_name, model_path = cls._resume_model(name, saved_model, opts, env)
        model_fp = fingerprint(model_path)
        same_model = model_fp == saved_model.get("fingerprint")
        settings = context_settings(opts, env)
        settings = ContextSettings(
            n_ctx=opts.ctx or n_ctx, n_batch=n_batch, n_threads=settings.n_threads, kv_type=opts.kv_type or kv_type
        )
        started = time.perf_counter()
        backend = load_backend(model_path, settings, opts.verbose)
        notices: list[str] = []
        try:
            load_s = time.perf_counter() - started
            if same_model:
                restoring = time.perf_counter()
                snap = Snapshot(record["tokens"], record["n_decoded"], record["draws"], params, saved_ctx)
                reason = cls._attach_state(store, name, snap, backend, model_fp)
                if reason:
                    notices.append(f"session '{name}': {reason}; re-reading its context from the transcript")
                try:
                    session = InferenceSession.from_snapshot(backend, snap, on_progress)
                except (EngineError, SnapshotError) as exc:
                    notices.append(f"session '{name}': {exc}; re-reading its context from the transcript")
                    snap.state = None
                    session = InferenceSession.from_snapshot(backend, snap, on_progress)
                session.stats.restore_s = time.perf_counter() - restoring
            else:
                notices.append(
                    f"session '{name}' was made with {saved_model.get('name', 'another model')}; "
                    f"continuing with {model_name}, re-read from the transcript"
                )
                for m in messages:
                    m.tokens, m.context_before = None, None
                session = InferenceSession(backend, params)
                session.draws = record["draws"]
            session.stats.load_s = load_s
            conv = Conversation(session, ChatTemplate(backend.chat_template(), backend.special_token_text("bos"),
                                                      backend.special_token_text("eos")), messages)
            if opts.system is not None:
                conv.set_system(opts.system)
        except BaseException:
            backend.close()
            raise
        return cls(store, name, model_name, model_path, model_fp, conv, record.get("created", now_iso()), notices)

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
    def _attach_state(store: SessionStore, name: str, snap: Snapshot, backend: Backend, model_fp: str) -> str | None:
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

    def save(self) -> None:
        """Saves transcript and state, each atomically: at worst the turn in progress is lost."""
        snap = self.session.snapshot(with_state=True)
        record = {
            "format": TRANSCRIPT_FORMAT,
            "version": TRANSCRIPT_VERSION,
            "created": self.created,
            "updated": now_iso(),
            "model": {"name": self.model_name, "path": str(self.model_path.resolve()), "fingerprint": self.model_fingerprint},
            "params": snap.params.to_dict(),
            "context": snap.context,
            "messages": [m.to_dict() for m in self.conversation.messages],
            "tokens": snap.tokens,
            "n_decoded": snap.n_decoded,
            "draws": snap.draws,
            "quipu": __version__,
            "build": self.backend.build,
        }
        meta = {
            "fingerprint": self.model_fingerprint,
            "build": self.backend.build,
            "context": snap.context,
            "n_decoded": snap.n_decoded,
            "tokens_sha256": tokens_digest(snap.tokens[: snap.n_decoded]),
            "quipu": __version__,
            "created": record["updated"],
        }
        self.store.save(self.name, record, snap.state, meta)
        for dropped in self.store.enforce_budget(self.max_state_bytes, keep=self.name):
            self.notices.append(f"session '{dropped}' lost its saved context to the disk budget; it will be re-read")

    def close(self) -> None:
        self.backend.close()


def run_session_turn(prompt: str | None, opts: TurnOptions, env: Environment, on_token: TokenFn,
                     progress: ProgressFn) -> TurnResult:
    """`quipu run --session NAME` (see run_turn): continue or create the session, run one turn, save it."""
    if opts.session is None:
        raise UsageError("--continue needs --session NAME")
    if opts.raw:
        raise UsageError("--raw cannot be used with --session: sessions are conversations")
    if opts.continue_reply and prompt:
        raise UsageError("--continue keeps generating the last reply; it takes no prompt")
    if not opts.continue_reply and not prompt:
        raise BadInput("no prompt: give one as an argument or on standard input")
    name = validate_name(opts.session)
    limit = max_tokens(opts, env)
    store = store_for(env)
    store.clean_temporaries()
    with store.lock(name):
        named = NamedSession.open(store, name, opts, env, progress)
        try:
            conv = named.conversation
            try:
                if opts.continue_reply:
                    gen = conv.continue_reply(max_tokens=limit, stop=opts.stop, on_token=on_token, on_progress=progress)
                else:
                    gen = conv.send(prompt, max_tokens=limit, stop=opts.stop, on_token=on_token, on_progress=progress)
            except ContextOverflow as exc:
                if len(named.session.tokens) < exc.n_ctx // 2:
                    raise  # the prompt alone is too long
                raise ContextOverflow(exc.prompt_tokens, exc.n_ctx, at_least=exc.at_least, hint=(
                    f"session '{name}' is full; continue it with a larger --ctx, or free room with /trim "
                    f"in `quipu chat -S {name}`"
                )) from None
            named.save()
        finally:
            named.close()
    stats = named.session.stats
    return TurnResult(gen.text, gen.finish_reason, named.model_name, named.session.params.seed, name, stats, named.notices)
