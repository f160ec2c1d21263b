"""Turns and sessions on llama.cpp's llama-server, kept as exact tokens (`sessions/served.py`).

A server is taken for llama-server when its `/props` says so. Then `run`, `run -S NAME`
(with `--continue`, `--raw`, `--show-prompt`, grammars, schemas, logit biases, `--think`)
and `chat` (every slash command) work as on a local model, through the same `Conversation`:
the transcript keeps the context's exact tokens, the text they spell and the model they were
made on, and the session's context is kept in a slot file between turns (`SlotKeeper`) when
the server allows slot files. A session made elsewhere (a local model, another server model,
a server without token arrays) is read again from its messages.
"""

from __future__ import annotations

import re
import uuid
import zlib
from dataclasses import dataclass
from typing import Callable

from quipu import __version__
from quipu.app.environment import (
    Environment,
    TurnOptions,
    chat_template_source,
    max_tokens,
    sampling_params,
    system_prompt,
    template_variables,
    with_logit_biases,
)
from quipu.app.named import FOLD_NOTICE, NamedSession, made_elsewhere, resumed, saved_params
from quipu.app.turns import (
    PromptView,
    ReplyStream,
    StopFn,
    TextFn,
    TurnResult,
    progress_callback,
    run_session_turn,
    show_prompt,
)
from quipu.engine.base import ContextSettings, ProgressFn
from quipu.errors import BadInput, CapabilityError
from quipu.sessions.conversation import Message
from quipu.sessions.params import SamplingParams
from quipu.sessions.served import ServedConversation, ServedSession
from quipu.store.store import SessionStore, validate_name
from quipu.store.transcript import Transcript, now_iso


def open_served(settings):
    """The server as a `ServedModel` when it is llama.cpp's llama-server, else None."""
    from quipu.engine.remote import RemoteModel
    from quipu.engine.server import ServedModel

    remote = RemoteModel(settings)
    try:
        props = remote.props()
    except BaseException:
        remote.close()
        raise
    if props is None:
        remote.close()
        return None
    return ServedModel(remote, props)


def refuse_server_settings(opts: TurnOptions) -> None:
    if opts.kv_type is not None or opts.ctx is not None or opts.threads is not None:
        raise CapabilityError("--ctx, --threads and --kv-type cannot be used with a server: they are the "
                              "server's own settings")


def served_params(served, opts: TurnOptions, env: Environment, base: SamplingParams | None = None) -> SamplingParams:
    return with_logit_biases(sampling_params(opts, env, base), served, opts)


def open_one_shot(served, opts: TurnOptions, env: Environment) -> ServedConversation:
    """A new conversation on the server, with no name: `quipu run --url`."""
    session = ServedSession(served, served_params(served, opts, env))
    return ServedConversation.start(session, system_prompt(opts, env), template=chat_template_source(opts),
                                    variables=template_variables(opts))


class SlotKeeper:
    """A named session's context on llama.cpp's llama-server, kept in a slot file between turns
    (the server must be started with --slot-save-path). Before a turn the file is restored into
    the session's slot, unless the slot is as the last save left it (the same last task, the same
    size: a chat's next turn), after it the slot is saved; the conversation is sent whole all the
    same, so the server reuses what the slot holds and reads only the rest. That it was reused is
    checked on the reply's cached-token count against what the new prompt shares with the held
    context: when it was not, the turn was read again (correct, only slower), and a warning says
    so. Other servers: nothing is done."""

    def __init__(self, name: str, filename: str | None):
        self.name = name
        self.filename = filename
        self.restored = 0  # the tokens the slot holds for the session when a turn starts
        self.slot = -1
        self.why_not = ""
        self.saved = 0
        self.left: tuple | None = None  # how the slot looked after the last save

    def before(self, remote) -> int:
        """Restores the session's file into its slot; the slot to use (-1: the server has none)."""
        from quipu.engine.remote import RemoteError

        slots = remote.slots()
        if not slots:
            return -1
        self.why_not, self.restored = "", 0
        fresh = self.filename is None  # a new session (or a server that kept no file): nothing to restore
        if fresh:
            self.filename = f"quipu-{uuid.uuid4().hex}.bin"
        self.slot = self.slot_of(slots)
        if fresh:
            return self.slot
        if self.left is not None and remote.slot_look(self.slot) == self.left:
            self.restored = self.saved  # nobody used the slot since: it holds the session still
            return self.slot
        try:
            self.restored = remote.slot_file(self.slot, "restore", self.filename)
        except RemoteError as exc:
            self.restored, self.why_not = 0, str(exc)
        return self.slot

    def slot_of(self, slots: int) -> int:
        return zlib.crc32(self.filename.encode()) % slots

    def after(self, remote, cached_tokens: int, held: int) -> list[str]:
        """Saves the slot; notices of a context that was not reused (`held`: the tokens the turn's
        prompt shared with the session's context)."""
        from quipu.engine.remote import RemoteError

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
        try:
            self.saved = remote.slot_file(self.slot, "save", self.filename)
        except RemoteError:
            self.filename = None  # the server keeps no slot files (no --slot-save-path): nothing to restore
            return notices
        self.left = remote.slot_look(self.slot)
        return notices


def slot_file_of(record) -> str | None:
    """The llama-server slot file a session's transcript names, if it is one quipu made."""
    name = record.model.get("slot_file") if record is not None else None
    return name if isinstance(name, str) and re.fullmatch(r"quipu-[0-9a-f]{32}\.bin", name) else None



class HeldSlot:
    """A session's slot on llama-server, kept in a slot file between turns (see SlotKeeper)."""

    def __init__(self, served, keeper: SlotKeeper, notices: list[str]):
        self.served, self.keeper, self.notices = served, keeper, notices

    def before(self) -> int:
        return self.keeper.before(self.served.remote)

    def after(self, cached_tokens: int, held: int) -> None:
        self.notices += self.keeper.after(self.served.remote, cached_tokens, held)


@dataclass
class ServedNamedSession(NamedSession):
    """A NamedSession whose conversation is kept on llama-server."""

    url: str = ""
    keeper: SlotKeeper | None = None

    @classmethod
    def opener(cls, served, url: str) -> Callable[..., "ServedNamedSession"]:
        """What opens a named session on this server (as `NamedSession.open` does locally)."""

        def open_(store: SessionStore, name: str, opts: TurnOptions, env: Environment,
                  on_progress: ProgressFn | None = None) -> "ServedNamedSession":
            return cls.open_on(served, url, store, name, opts, env)

        return open_

    @classmethod
    def open_on(cls, served, url: str, store: SessionStore, name: str, opts: TurnOptions,
                env: Environment) -> "ServedNamedSession":
        validate_name(name)
        refuse_server_settings(opts)
        record = store.load_transcript(name) if store.exists(name) else None
        notices: list[str] = []
        source = chat_template_source(opts)
        if record is None:
            conv = open_one_shot(served, opts, env)
            created = now_iso()
        else:
            session = ServedSession(served, served_params(served, opts, env, saved_params(store, name, record)))
            messages = [Message.from_dict(m) for m in record.messages]
            saved = record.served
            if saved is not None and saved["identity"] == served.identity:
                session.restore(record.tokens, saved["text"], [tuple(m) for m in saved["marks"]], record.draws)
            else:
                notice = made_elsewhere(name, record, served.name, messages)
                if record.tokens:
                    notices.append(notice)
                session.draws = record.draws
            source = source or record.chat_template
            conv = resumed(ServedConversation, session, messages, source, record, opts)
            created = record.created or now_iso()
        named = cls(store, name, served.name, None, "", conv, created, notices, chat_template=source, url=url,
                    keeper=SlotKeeper(name, slot_file_of(record)))
        conv.session.slot_holder = HeldSlot(served, named.keeper, named.notices)
        return named

    def save(self) -> None:
        session: ServedSession = self.session
        where = {"name": self.model_name, "url": self.url}
        if self.keeper is not None and self.keeper.filename:
            where["slot_file"] = self.keeper.filename
        self.store.save(self.name, Transcript(
            model=where, params=session.params.to_dict(), context=ContextSettings(n_ctx=session.n_ctx).state_key(),
            messages=[m.to_dict() for m in self.conversation.messages], tokens=list(session.tokens),
            n_decoded=len(session.tokens), draws=session.draws, created=self.created, updated=now_iso(),
            quipu=__version__, build="server", chat_template=self.chat_template,
            template_variables=self.conversation.variables,
            served={"identity": self.backend.identity, "text": session.text,
                    "marks": [list(m) for m in session.marks]}), None)


def run_served_turn(served, prompt: str | None, opts: TurnOptions, env: Environment, url: str, *,
                    on_text: TextFn | None = None, on_reasoning: TextFn | None = None,
                    should_stop: StopFn | None = None,
                    on_result: Callable[[TurnResult], None] | None = None) -> TurnResult:
    """`quipu run --url` on llama-server: a one-shot turn, or a named session's (see run_turn)."""
    refuse_server_settings(opts)
    if opts.session is not None or opts.continue_reply:
        result = run_session_turn(prompt, opts, env, progress_callback(None, should_stop), on_text=on_text,
                                  on_reasoning=on_reasoning, should_stop=should_stop,
                                  opener=ServedNamedSession.opener(served, url))
    else:
        if not prompt:
            raise BadInput("no prompt: give one as an argument or on standard input")
        conv = open_one_shot(served, opts, env)
        session = conv.session
        session.check_text_fits(prompt)
        stream = ReplyStream(on_text, should_stop, on_reasoning, lambda: conv.reply_starts_thinking)
        limit = max_tokens(opts, env)
        if opts.raw:
            session.begin_turn()
            tokens = served.tokenize(prompt, add_special=True, parse_special=False)
            gen = session.generate(tokens, prompt, limit, opts.stop, stream.on_token)
        else:
            gen = conv.send(prompt, max_tokens=limit, stop=opts.stop, on_token=stream.on_token)
        result = stream.result(gen, served.name, session, None, [FOLD_NOTICE] if conv.template.folds_system else [])
    if on_result is not None:
        on_result(result)  # what came is shown, then a failure is said
    if result.failure is not None:
        raise result.failure
    return result


def show_served_prompt(served, prompt: str | None, opts: TurnOptions, env: Environment, url: str) -> PromptView:
    """`--show-prompt` on llama-server: the exact tokens a turn would send."""
    refuse_server_settings(opts)
    if opts.session is not None or opts.continue_reply:
        return show_prompt(prompt, opts, env, ServedNamedSession.opener(served, url))
    if not prompt:
        raise BadInput("no prompt: give one as an argument or on standard input")
    if opts.raw:
        tokens = served.tokenize(prompt, add_special=True, parse_special=False)
    else:
        conv = open_one_shot(served, opts, env)
        conv.messages.append(Message("user", prompt))
        tokens = conv.context_tokens()
    return PromptView(served.detokenize(tokens), tokens, 0, served.name, None)
