"""Named sessions: a conversation resumed from the store (or created), turned, and saved."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quipu import __version__
from quipu.app.environment import (
    DEFAULT_MAX_STATE_BYTES,
    Environment,
    TurnOptions,
    chat_template_source,
    context_settings,
    load_backend,
    parse_logit_bias,
    sampling_params,
    system_prompt,
    template_variables,
    with_logit_biases,
)
from quipu.engine.base import Backend, ContextSettings, ProgressFn
from quipu.errors import EngineError, InvalidParameter, ModelMismatch, SnapshotError, UsageError
from quipu.models import fingerprint
from quipu.sessions.conversation import Conversation, Message
from quipu.sessions.inference import InferenceSession, Snapshot
from quipu.sessions.params import SamplingParams
from quipu.sessions.template import ChatTemplate
from quipu.store.store import KEEP_STATE, SessionStore, validate_name
from quipu.store.transcript import Transcript, now_iso


FOLD_NOTICE = ("the chat template has no system role; the system prompt was joined to the first user message, "
               "as llama.cpp does")


def tokens_digest(tokens: list[int]) -> str:
    return hashlib.sha256(json.dumps(tokens, separators=(",", ":")).encode()).hexdigest()


def store_for(env: Environment) -> SessionStore:
    return SessionStore(env.dirs.sessions)


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


def saved_params(store: SessionStore, name: str, record: Transcript) -> SamplingParams:
    """A transcript's sampling parameters; damaged ones are said, and the file left as it is."""
    try:
        return SamplingParams.from_dict(record.params)
    except (TypeError, InvalidParameter) as exc:
        raise SnapshotError(f"session '{name}' is damaged: {exc}; {store.transcript_path(name)} was left "
                            "as it is") from None


def made_elsewhere(name: str, record: Transcript, model_name: str, messages: list[Message]) -> str:
    """The notice for a session continued on another model (its context is read again from the
    messages, whose token counts then mean nothing)."""
    for m in messages:
        m.context_before = None
    return (f"session '{name}' was made with {record.model.get('name', 'another model')}; continuing with "
            f"{model_name}, re-read from the transcript")


def resumed(kind: type[Conversation], session, messages: list[Message], template: str | None, record: Transcript,
            opts: TurnOptions) -> Conversation:
    """A saved conversation on `session` (a `kind` of Conversation), with the options that change it."""
    conv = kind(session, ChatTemplate.of(session.backend, template), messages,
                variables=template_variables(opts, record.template_variables))
    if opts.system is not None:
        conv.set_system(opts.system)
    return conv


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
    # What the state file on disk holds (decoded tokens and context settings), when it is
    # known to be current: a save with nothing new in the context leaves the file alone.
    saved_state: tuple | None = None
    chat_template: str | None = None  # the user's template, remembered by the session
    _told_fold: bool = False

    def note_template(self) -> None:
        """Says once that the template had no system role, when the system prompt was folded."""
        if self.conversation.template.folds_system and not self._told_fold:
            self._told_fold = True
            self.notices.append(FOLD_NOTICE)

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
        named.max_state_bytes = env.max_state_bytes
        return named

    @classmethod
    def _create(cls, store: SessionStore, name: str, opts: TurnOptions, env: Environment) -> "NamedSession":
        source = chat_template_source(opts)
        model_name, model_path, session = open_session(opts, env)
        try:
            conv = Conversation.start(session, system_prompt(opts, env), template=source,
                                      variables=template_variables(opts))
        except BaseException:
            session.backend.close()
            raise
        return cls(store, name, model_name, model_path, fingerprint(model_path), conv, now_iso(),
                   chat_template=source)

    @classmethod
    def _resume(cls, store: SessionStore, name: str, record: Transcript, opts: TurnOptions,
                env: Environment, on_progress: ProgressFn | None) -> "NamedSession":
        params = sampling_params(opts, env, saved_params(store, name, record))
        messages = [Message.from_dict(m) for m in record.messages]
        parse_logit_bias(opts.logit_bias)
        saved_ctx = record.context
        model_name, model_path = cls._resume_model(name, record.model, opts, env)
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
        saved_state = None
        try:
            load_s = time.perf_counter() - started
            params = with_logit_biases(params, backend, opts)
            if same_model:
                restoring = time.perf_counter()  # a rebuild from the transcript is part of restoring
                snap = Snapshot(record.tokens, record.n_decoded, record.draws, params, saved_ctx)
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
                if session.rebuilt_tokens == 0 and snap.state is not None:
                    saved_state = state_key(session)
            else:
                notices.append(made_elsewhere(name, record, model_name, messages))
                session = InferenceSession(backend, params)
                session.draws = record.draws
            session.stats.load_s = load_s
            template = chat_template_source(opts) or record.chat_template
            conv = resumed(Conversation, session, messages, template, record, opts)
        except BaseException:
            backend.close()
            raise
        return cls(store, name, model_name, model_path, model_fp, conv, record.created or now_iso(), notices,
                   saved_state=saved_state, chat_template=template)

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
        """Saves transcript and state, each atomically: at worst the turn in progress is lost.
        The state file is rewritten only when the context's decoded tokens or settings changed."""
        key = state_key(self.session)
        unchanged = key == self.saved_state and self.store.has_state(self.name)
        snap = self.session.snapshot(with_state=not unchanged)
        updated = now_iso()
        record = Transcript(
            model={"name": self.model_name, "path": str(self.model_path.resolve()), "fingerprint": self.model_fingerprint},
            params=snap.params.to_dict(),
            context=snap.context,
            messages=[m.to_dict() for m in self.conversation.messages],
            tokens=snap.tokens,
            n_decoded=snap.n_decoded,
            draws=snap.draws,
            created=self.created,
            updated=updated,
            quipu=__version__,
            build=self.backend.build,
            chat_template=self.chat_template,
            template_variables=self.conversation.variables,
        )
        if unchanged:
            self.store.save(self.name, record, KEEP_STATE)
        else:
            meta = {
                "fingerprint": self.model_fingerprint,
                "build": self.backend.build,
                "context": snap.context,
                "n_decoded": snap.n_decoded,
                "tokens_sha256": key[1],
                "quipu": __version__,
                "created": updated,
            }
            self.store.save(self.name, record, snap.state, meta)
            self.saved_state = key if snap.state is not None else None
        for dropped in self.store.enforce_budget(self.max_state_bytes, keep=self.name):
            self.notices.append(f"session '{dropped}' lost its saved context to the disk budget; it will be re-read")

    def close(self) -> None:
        self.backend.close()


def state_key(session: InferenceSession) -> tuple:
    """What a state file's bytes depend on: the decoded tokens and the context settings."""
    key = session.backend.context.state_key()
    return (session.n_decoded, tokens_digest(session.tokens[: session.n_decoded]), tuple(sorted(key.items())))
