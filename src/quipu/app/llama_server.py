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
import uuid
import zlib
from typing import Any, Callable, TYPE_CHECKING

from quipu.app.environment import Environment
from quipu.app.turn_options import TurnOptions, sampling_params, with_logit_biases
from quipu.app.hosts import NoCache, Opened, made_elsewhere, saved_params
from quipu.engine.base import ProgressFn
from quipu.engine.settings import ContextSettings
from quipu.sessions.base import LLAMA_SERVER
from quipu.sessions.llama_server import LlamaServerSession
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

    def _open(self, params: SamplingParams, slot: "SlotFile | None",
              draws: int = 0) -> tuple[LlamaServerSession, "LlamaServerKeeper"]:
        """A session, and its keeper; with `slot`, the session's slot is kept between turns;
        `draws`, the draws its seed has made."""
        notices: list[str] = []
        holder = HeldSlot(self.served, slot, notices) if slot is not None else None
        session = LlamaServerSession(self.served, params, slot_holder=holder, draws=draws)
        return session, LlamaServerKeeper(self.served, self.url, slot, notices)

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

    def __init__(self, served: LlamaServerModel, url: str, slot: "SlotFile | None", notices: list[str]):
        self.served, self.url, self.slot = served, url, slot
        self.model_name = served.name
        self.notices = notices  # (what the session's held slot says, shared with it)

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


class SlotFile:
    """A named session's context on llama.cpp's llama-server, kept in a slot file between turns
    (the server must be started with --slot-save-path). Before a turn the file is restored into
    the session's slot, unless the slot is as the last save left it (the same last task, the same
    size: a chat's next turn), after it the slot is saved; the conversation is sent whole all the
    same, so the server reuses what the slot holds and reads only the rest. That it was reused is
    checked on the reply's cached-token count against what the new prompt shares with the held
    context: when it was not, the turn was read again (correct, only slower), and a warning says
    so. Other servers: nothing is done."""

    def __init__(self, filename: str | None, name: str = ""):
        self.name = name  # the session's, for the notices
        self.filename = filename
        self.restored = 0  # the tokens the slot holds for the session when a turn starts
        self.slot = -1
        self.why_not = ""
        self.saved = 0
        self.left: tuple[Any, ...] | None = None  # how the slot looked after the last save

    def before(self, served: "LlamaServerModel") -> int:
        """Restores the session's file into its slot; the slot to use (-1: the server has none)."""
        from quipu.engine.http import ServerError

        slots = served.slots()
        if not slots:
            return -1
        self.why_not, self.restored = "", 0
        filename = self.filename
        if filename is None:  # a new session (or a server that kept no file): nothing to restore
            self.filename = f"quipu-{uuid.uuid4().hex}.bin"
            self.slot = self.slot_of(slots)
            return self.slot
        self.slot = self.slot_of(slots)
        if self.left is not None and served.slot_look(self.slot) == self.left:
            self.restored = self.saved  # nobody used the slot since: it holds the session still
            return self.slot
        try:
            self.restored = served.slot_file(self.slot, "restore", filename)
        except ServerError as exc:
            self.restored, self.why_not = 0, str(exc)
        return self.slot

    def slot_of(self, slots: int) -> int:
        return zlib.crc32((self.filename or "").encode()) % slots

    def after(self, served: "LlamaServerModel", cached_tokens: int, held: int) -> list[str]:
        """Saves the slot; notices of a context that was not reused (`held`: the tokens the turn's
        prompt shared with the session's context)."""
        from quipu.engine.http import ServerError

        if self.slot < 0:
            return []
        notices = []
        expected = min(self.restored, held)
        if self.why_not:
            notices.append(f"session '{self.name}': its context could not be restored on llama-server "
                           f"({self.why_not}); the conversation was read again")
        elif expected and cached_tokens < expected * 0.9:
            notices.append(f"session '{self.name}': llama-server did not reuse its context ({cached_tokens} of "
                           f"{expected} tokens); the conversation was read again")
        self.left = None
        assert self.filename is not None  # (named by `before`, which gave the slot)
        try:
            self.saved = served.slot_file(self.slot, "save", self.filename)
        except ServerError:
            self.filename = None  # the server keeps no slot files (no --slot-save-path): nothing to restore
            return notices
        self.left = served.slot_look(self.slot)
        return notices


def slot_file_of(record: Transcript | None) -> str | None:
    """The llama-server slot file a session's transcript names, if it is one quipu made."""
    name = record.model.get("slot_file") if record is not None else None
    return name if isinstance(name, str) and re.fullmatch(r"quipu-[0-9a-f]{32}\.bin", name) else None



class HeldSlot:
    """A session's slot on llama-server, kept in a slot file between turns (see SlotFile): the
    session layer's `SlotHolder`."""

    def __init__(self, served: LlamaServerModel, slot_file: SlotFile, notices: list[str]):
        self.served, self.slot_file, self.notices = served, slot_file, notices

    def before(self) -> int:
        return self.slot_file.before(self.served)

    def after(self, cached_tokens: int, held: int) -> None:
        self.notices += self.slot_file.after(self.served, cached_tokens, held)
