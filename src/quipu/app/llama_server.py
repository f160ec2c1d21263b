"""llama.cpp's llama-server, driven by tokens (`sessions/llama_server.py`): the host.

A server is taken for llama-server when its `/props` says so. Then everything a local model
does works, through the same `Conversation`, named sessions and chat: the transcript keeps the
context's exact tokens, the text they spell and the model they were made on, and the session's
context is kept in a slot file between turns (`SlotFile`) when the server allows slot files.
A session made elsewhere (a local model, another server model, a chat API) is read again from
its messages.
"""

from __future__ import annotations

import re
from typing import Any, Callable, TYPE_CHECKING

from quipu.app.environment import Environment
from quipu.app.turn_options import TurnOptions, sampling_params, with_logit_biases
from quipu.app.hosts import NoCache, Opened, made_elsewhere, saved_params
from quipu.engine.base import ProgressFn
from quipu.engine.settings import ContextSettings
from quipu.sessions.base import LLAMA_SERVER
from quipu.sessions.llama_server import LlamaServerSession
from quipu.sessions.slot_file import SlotFile
from quipu.sessions.params import SamplingParams
from quipu.store.store import SessionStore
from quipu.store.transcript import Transcript

if TYPE_CHECKING:
    from typing import Sequence

    from quipu.app.attachments import Attachment
    from quipu.app.chat_api import ChatApiHost
    from quipu.engine.http import ServerSettings
    from quipu.sessions.chat_api import ChatApiSession
    from quipu.engine.llama_server import LlamaServerModel


def open_llama_server(settings: ServerSettings) -> "LlamaServerHost | None":
    """The server as a host driven by tokens when it is llama.cpp's llama-server, else None."""
    from quipu.engine.http import ServerClient
    from quipu.engine.llama_server import LlamaServerModel, llama_server_props

    client = ServerClient(settings)
    try:
        props = llama_server_props(client)
    except BaseException:
        client.close()
        raise
    if props is None:
        client.close()
        return None
    return LlamaServerHost(LlamaServerModel(client, props), settings.url, settings)


class LlamaServerHost:
    """A model on llama-server; one connection for every session of the command."""

    capabilities = LLAMA_SERVER

    def __init__(self, served: LlamaServerModel, url: str, settings: "ServerSettings | None" = None):
        self.served, self.url = served, url
        self.settings = settings
        self._chat: "ChatApiHost | None" = None  # (its chat API, for a turn with media)

    def _params(self, opts: TurnOptions, env: Environment, base: SamplingParams | None = None) -> SamplingParams:
        return with_logit_biases(sampling_params(opts, env, base, self.capabilities), self.served, opts)

    def _open(self, params: SamplingParams, slot: SlotFile | None,
              draws: int = 0) -> tuple[LlamaServerSession, "LlamaServerKeeper"]:
        """A session, and its keeper; with `slot`, the session's slot is kept between turns;
        `draws`, the draws its seed has made."""
        session = LlamaServerSession(self.served, params, slot_file=slot, draws=draws)
        return session, LlamaServerKeeper(self.served, self.url, slot)

    def create(self, opts: TurnOptions, env: Environment, name: str | None = None,
               media: Sequence[Attachment] = ()) -> Opened[LlamaServerSession] | Opened[ChatApiSession]:
        if media and name is None and self.settings is not None:
            # A one-shot with images goes through the server's chat API, which reads media: its
            # prompt by tokens takes none.
            from quipu.app.chat_api import ChatApiHost

            if self._chat is None:
                self._chat = ChatApiHost(self.settings)
            opened = self._chat.create(opts, env, name, media)
            if opts.verbose:
                opened.notices.append("llama-server is given this turn's media through its chat API, which renders "
                                      "the prompt with the server's template")
            return opened
        # (a one-shot keeps no slot file)
        session, keeper = self._open(self._params(opts, env), SlotFile(None, name) if name is not None else None)
        return Opened(session, keeper)

    def resume(self, store: SessionStore, name: str, record: Transcript, opts: TurnOptions, env: Environment,
               on_progress: ProgressFn | None = None) -> Opened[LlamaServerSession]:
        session, keeper = self._open(self._params(opts, env, saved_params(store, name, record)),
                                     SlotFile(slot_file_of(record), name), record.draws)
        saved = record.served
        if saved is not None and saved["identity"] == self.served.identity:
            session.restore(record.tokens, saved["text"], [tuple(m) for m in saved["marks"]])
            return Opened(session, keeper)
        return Opened(session, keeper, [made_elsewhere(name, record, self.served.name)] if record.tokens else [],
                      reread=True)

    def close(self) -> None:
        if self._chat is not None:
            self._chat.close()
        self.served.close()


class LlamaServerKeeper(NoCache):
    """A session's exact tokens on llama-server, and its slot file."""

    def __init__(self, served: LlamaServerModel, url: str, slot: SlotFile | None):
        self.served, self.url, self.slot = served, url, slot
        self.model_name = served.name
        self.notices = slot.notices if slot is not None else []  # (what the session's slot file says)

    def fields(self, session: LlamaServerSession) -> dict[str, Any]:
        where = {"name": self.model_name, "url": self.url}
        if self.slot is not None and self.slot.filename:
            where["slot_file"] = self.slot.filename
        return {
            "model": where, "params": session.params.to_dict(),
            "context": ContextSettings(n_ctx=session.n_ctx).state_key(), "tokens": list(session.tokens),
            "n_decoded": len(session.tokens), "draws": session.draws, "build": "server",
            "served": {"identity": self.served.identity, "text": session.text,
                       "marks": [list(m) for m in session.marks]},
        }

    def save(self, store: SessionStore, name: str, record: Transcript, session: LlamaServerSession,
             next_keeps: Callable[[], int] | None = None) -> list[str]:
        store.save(name, record, None)
        out, self.notices[:] = list(self.notices), []
        return out


def slot_file_of(record: Transcript | None) -> str | None:
    """The llama-server slot file a session's transcript names, if it is one quipu made."""
    name = record.model.get("slot_file") if record is not None else None
    return name if isinstance(name, str) and re.fullmatch(r"quipu-[0-9a-f]{32}\.bin", name) else None
