"""Any server's OpenAI chat API (vLLM, Ollama, LM Studio, llama-cpp-python's): the host.

A named session on it keeps its transcript as the truth, and each turn sends the whole
conversation (such servers keep prompt caches of their own). The transcript holds no token
history or context state, so a session can move between servers and a local model: continued
elsewhere, it is read again from its messages. What the chat API cannot be asked is declared in
the session layer's `CHAT_API` capabilities and refused before anything is sent.
"""

from __future__ import annotations

from typing import Any, Callable, TYPE_CHECKING

from quipu.app.environment import Environment
from quipu.app.turn_options import TurnOptions
from quipu.app.hosts import NoCache, Opened
from quipu.engine.base import ProgressFn
from quipu.engine.settings import ContextSettings
from quipu.errors import UsageError
from quipu.options import REQUEST
from quipu.sessions.base import CHAT_API
from quipu.sessions.chat_api import ChatApiSession
from quipu.store.store import SessionStore
from quipu.store.transcript import Transcript

if TYPE_CHECKING:
    from typing import Sequence

    from quipu.app.attachments import Attachment
    from quipu.engine.http import ServerSettings


def request_params(opts: TurnOptions, env: Environment, saved: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sampling parameters given (command line, then config, then a session's) that a chat
    API takes (`quipu.options.REQUEST`); what is not given is left to the server."""
    given = {k: v for k, v in (saved or {}).items() if k in REQUEST and v is not None}
    given.update({k: v for k, v in env.config.generation.items() if k in REQUEST})
    given.update({k: v for k, v in opts.sampling.items() if k in REQUEST})
    return given


class ChatApiHost:
    """A server spoken to through its chat API; one connection for every session of the command."""

    capabilities = CHAT_API

    def __init__(self, settings: "ServerSettings"):
        from quipu.engine.chat_api import ChatApiModel

        self.settings = settings
        self.client = ChatApiModel(settings)

    def create(self, opts: TurnOptions, env: Environment, name: str | None = None,
               media: Sequence[Attachment] = ()) -> Opened[ChatApiSession]:
        for medium in media:
            if not medium.kind.mime:
                raise UsageError(f"cannot attach {medium.name} {medium.describe()}: the chat API takes recordings as "
                                 "WAV or MP3")
        session = ChatApiSession(self.client, request_params(opts, env))
        marks = [session.media_mark(m.data, m.kind.mime) for m in media]
        return Opened(session, ChatApiKeeper(self.settings, session), media_marks=marks)

    def resume(self, store: SessionStore, name: str, record: Transcript, opts: TurnOptions, env: Environment,
               on_progress: ProgressFn | None = None) -> Opened[ChatApiSession]:
        session = ChatApiSession(self.client, request_params(opts, env, record.params))
        # (the server reads the messages again each turn: token counts of another host mean nothing here)
        return Opened(session, ChatApiKeeper(self.settings, session, record.model.get("name")), reread=True)

    def close(self) -> None:
        self.client.close()

    def models(self) -> list[dict[str, Any]]:
        return [{"name": m["id"], "owned_by": m.get("owned_by"), "url": self.settings.url}
                for m in self.client.models()]


class ChatApiKeeper(NoCache):
    """A session's transcript on a chat API: the messages and the parameters given; no tokens
    or state (the server's context is not ours to keep)."""

    def __init__(self, settings: ServerSettings, session: ChatApiSession, saved_name: str | None = None):
        self.url = settings.url
        self.session = session
        self._named = settings.model or (saved_name if isinstance(saved_name, str) else None)

    @property
    def model_name(self) -> str:
        """The name the server answered to, else the one asked for (or saved), else "?"."""
        return self.session.model or self._named or "?"

    def fields(self, session: ChatApiSession) -> dict[str, Any]:
        return {"model": {"name": self.model_name, "url": self.url}, "params": dict(session.request),
                "context": ContextSettings().state_key(), "tokens": [], "n_decoded": 0, "draws": 0,
                "build": "server"}

    def save(self, store: SessionStore, name: str, record: Transcript, session: ChatApiSession,
             next_keeps: Callable[[], int] | None = None) -> list[str]:
        store.save(name, record, None)
        return []


def list_remote_models(settings: ServerSettings) -> list[dict[str, Any]]:
    """The models a server lists (`quipu models list --url`)."""
    host = ChatApiHost(settings)
    try:
        return host.models()
    finally:
        host.close()
