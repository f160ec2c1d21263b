"""The chat loop's library side: a named conversation that is saved after every turn, on
whichever host the model runs (a local model, llama-server, a chat API): one class for all."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import replace
from typing import Any, Callable, Sequence

from quipu.app.answer import Answer
from quipu.app.turn import Ask, Turn, compose
from quipu.app.attachments import Attachment
from quipu.app.compact import refuse_if_it_never_fits
from quipu.app.environment import Environment
from quipu.app.turn_options import TurnOptions
from quipu.app.choose import open_host
from quipu.app.hosts import ModelHost
from quipu.app.modes import CHAT, asked_of, check_options
from quipu.app.tools import ToolHooks, offer, resume_pending, skip_pending, open_tools, waiting_notice
from quipu.app.named import NamedSession, generate_name, store_for
from quipu.engine.base import ProgressFn
from quipu.errors import ContextOverflow, UsageError
from quipu.sessions.base import SILENT, Capabilities, Message, ReplySink, Stats
from quipu.sessions.params import SamplingParams
from quipu.sessions.trim import drop_oldest
from quipu.store.branches import Branch
from quipu.store.store import SessionInfo, validate_name

# Warn when the context is this full; drop old exchanges to leave this much free.
WARN_FRACTION = 0.85
KEEP_FREE_FRACTION = 0.5


class ChatSession:
    """An open, locked, named conversation. Every finished turn is saved before it returns."""

    def __init__(self, env: Environment, opts: TurnOptions, host: ModelHost,
                 shape: Callable[[str], str | None] | None = None, conversation: str | None = None,
                 on_output: Callable[[str], None] | None = None, *, keep_unnamed: bool = True):
        self.env = env
        self.opts = opts
        self.host = host
        self._shape = shape
        self._conversation = conversation  # the logged conversation a follow-up's turns go on with
        self.store = store_for(env)
        self.named: NamedSession | None = None
        self.kept = True  # whether this session's turns are saved (a piped chat without a name keeps none)
        self.keep_unnamed = keep_unnamed  # whether a session given a generated name (here or by /new) is kept
        self._stack = ExitStack()
        self.last_stats: Stats | None = None
        self.resumed = False
        self.attached: list[Attachment] = []  # files the next message carries (`/attach`)
        self._marks = ""  # where its media go in its text
        # (a bad file is said before anything is loaded; `on_output`: what the user's functions write on stderr)
        self.tools = open_tools(opts.tool_options, env, constrained=opts.constrained, on_output=on_output)

    # ---- opening and closing ---------------------------------------------------------------

    @classmethod
    def open(cls, env: Environment, opts: TurnOptions, *, name: str | None = None, resume_latest: bool = False,
             keep_unnamed: bool = True, on_progress: ProgressFn | None = None,
             shape: Callable[[str], str | None] | None = None,
             on_output: Callable[[str], None] | None = None) -> "ChatSession":
        """The chat on the host the options name (a local model, or `opts.server`); without
        `keep_unnamed`, a session that was not named (nor resumed) is never written to disk;
        `shape`, what a message becomes before it is sent (a role's prompt holding it);
        `on_output`, where the lines the user's functions write on stderr go."""
        host = open_host(opts.server)
        chat = None
        try:
            check_options(asked_of(opts.given), CHAT, host.capabilities)
            history = None
            if opts.follow_up or opts.cid is not None:  # (a new session, going on with a logged conversation)
                from quipu.app.answer_log import followed

                if name is not None or resume_latest:
                    raise UsageError("--follow-up and --cid start a new session from the log; --session and "
                                     "--resume open one that is saved")
                history = followed(env, opts.cid)
                if opts.system is None and history.system is not None:
                    opts = replace(opts, system=history.system)
            chat = cls(env, opts, host, shape, history.conversation if history is not None else None, on_output,
                       keep_unnamed=keep_unnamed)
            chat._switch(chat._name_to_open(name, resume_latest), on_progress,
                         kept=keep_unnamed or name is not None or resume_latest)
            chat.opts = replace(chat.opts, branch=None)  # (--branch chose where it opens; no later /load's)
            if history is not None:
                chat._named.conversation.extend(history.messages)
        except BaseException:
            if chat is not None and chat.tools is not None:
                chat.tools.close()
            host.close()
            raise
        return chat

    def _name_to_open(self, name: str | None, resume_latest: bool) -> str:
        """The session to open: the one named, the most recently used (--resume), or a new name."""
        if name is None and resume_latest:
            infos, _ = self.store.list()
            if not infos:
                raise UsageError("there is no session to resume yet; start one with `quipu chat`")
            return infos[0].name
        return name or generate_name(set(self.store.names()))

    def _switch(self, name: str, on_progress: ProgressFn | None = None, opts: TurnOptions | None = None, *,
                kept: bool = True) -> None:
        validate_name(name)
        stack = ExitStack()
        try:
            stack.enter_context(self.store.lock(name))
            resumed = self.store.exists(name)
            named = NamedSession.open(self.store, name, opts or self.opts, self.env, self.host, on_progress)
            stack.callback(self._close_named)  # (the one open when the lock goes: a branch's, see `switch`)
        except BaseException:
            stack.close()
            raise
        self._ready(named, opts or self.opts)
        self._release()
        self._stack, self.named = stack, named
        self.attached, self._marks = [], ""  # (what waited was made ready in the context left)
        self.resumed = resumed
        self.kept = kept
        self.last_stats = None

    def _ready(self, named: NamedSession, opts: TurnOptions) -> None:
        offer(named.conversation, self.tools, opts.tool_options)
        named.keeper.write_behind()  # the prompt comes back before the state is on disk
        waiting = waiting_notice(named.conversation, "/continue runs them (asking first); a new message goes on "
                                                      "without them")
        if waiting:
            named.notices.append(waiting)

    def _close_named(self) -> None:
        if self.named is not None:
            self.named.close()

    def _release(self) -> None:
        if self.named is not None and not self.kept and self.store.exists(self.name):  # (written for a /save)
            self.named.flush()
            self.store.drop_locked(self.name)
        self._stack.close()
        self.named = None

    def close(self) -> None:
        self._release()
        if self.tools is not None:
            self.tools.close()
        self.host.close()

    @property
    def name(self) -> str:
        return self._named.name

    @property
    def _named(self) -> NamedSession:
        if self.named is None:
            raise UsageError("no session is open")
        return self.named

    @property
    def capabilities(self) -> Capabilities:
        return self.host.capabilities

    @property
    def notices(self) -> list[str]:
        out, self._named.notices[:] = list(self._named.notices), []
        return out

    @property
    def model_name(self) -> str:
        return self._named.model_name

    @property
    def messages(self) -> list[Message]:
        return self._named.conversation.messages

    @property
    def params(self) -> SamplingParams:
        return self._named.session.params

    # ---- turns -------------------------------------------------------------------------------

    def _turn(self, ask: Ask, sink: ReplySink, hooks: ToolHooks | None, message: str | None = None,
              said: tuple[str, Sequence[Attachment]] | None = None) -> Answer:
        """One turn (`turn.Turn`): the reply into `sink`, and the calls it makes run as `hooks`
        (the front end's) approve and show them; the answer is saved and logged before it returns
        (`said`: the message as typed and the files it carries, as the log keeps them, as `-a`'s)."""
        named = self._named
        session = named.session
        turn = Turn(session, named.keeper, named.conversation, self.opts.tool_options, named=named, tools=self.tools,
                    hooks=hooks)
        try:
            limit, stop = named.reply_limits(self.opts, self.env)
            answer = turn.answer(ask, limit, stop, sink)
        except ContextOverflow as exc:
            if message is not None:
                refuse_if_it_never_fits(self._named.conversation, message, exc)
            return Answer("", "context_full", named.model_name, session.params.seed, self.name, session.stats)
        if not self.kept:
            answer = replace(answer, session=None)
        self._log(answer, said or (message, ()) if message is not None else None)  # (first: its id is saved with it)
        self.save()
        self.last_stats = session.stats
        if answer.failure is not None:
            raise answer.failure  # a server failed mid-reply: what came is kept and saved
        return answer

    def _log(self, answer: Answer, said: tuple[str, Sequence[Attachment]] | None) -> None:
        """The turn's answer in the log of answers (a warning where it could not be written)."""
        from quipu.app.answer_log import follows, log_answer, mark_logged

        named = self._named
        messages = named.conversation.messages
        asked, files = said if said is not None else \
            (next((m.content for m in reversed(messages) if m.role == "user"), ""), ())
        # (it follows up the last reply before its exchange on the branch the chat is on: an /edit,
        # /undo, /retry or /switch goes on from where that branch is)
        made, unlogged = log_answer(self.env, self.opts.logged, "chat", asked, answer, system=answer.system,
                                    attachments=list(files),
                                    conversation=self._conversation or (f"session:{self.name}" if self.kept
                                                                        else f"chat:{self.name}"),
                                    parent=follows(messages))
        mark_logged(messages, made)
        if unlogged:
            named.notices.append(unlogged)

    def send(self, text: str, sink: ReplySink = SILENT, hooks: ToolHooks | None = None) -> Answer:
        if self._shape is not None:
            text = self._shape(text) or ""
        conv = self._named.conversation
        skip_pending(conv)  # (calls left waiting are answered "not run")
        before = conv.settings  # (the documents a message that is not sent gave are taken back)
        from quipu.app.attachments import split_media

        typed, carried = text, list(self.attached)
        text = compose(conv, text, split_media(self.attached)[0], self._marks) or ""  # (its text never a marker)
        try:
            outcome = self._turn(Ask("send", text), sink, hooks, message=text, said=(typed, carried))
        except UsageError as exc:  # it can never fit: what it carried is not left waiting for the next one
            if not self.attached:
                raise
            dropped = self.drop_attached()
            raise UsageError(f"{exc}; {', '.join(dropped)} {'was' if len(dropped) == 1 else 'were'} dropped with it "
                             "(/attach gives a file again)") from None
        if not (outcome.context_full and not outcome.tokens):
            self.attached, self._marks = [], ""
        elif self.attached:  # (not sent: they wait for it again, its documents not yet given)
            conv.update(variables=before.variables)
        return outcome

    def attach(self, name: str) -> Attachment:
        """A file for the next message to carry; what cannot be attached, or what this model cannot
        take, is refused now (an image or a recording is made ready in the context at once)."""
        from quipu.app.attachments import TEXT, check_room, check_total, read_attachment

        check_room(self.attached, "the next message")
        found = read_attachment(name)
        check_total([*self.attached, found], "the next message")
        if found.kind is not TEXT:
            self.capabilities.require("media", chat=True)
            named = self._named
            self._marks += named.keeper.take_media(named.session, self.store, [found])
        self.attached.append(found)
        return found

    def drop_attached(self) -> list[str]:
        """Forgets the files waiting for the next message (an image made ready in the context is
        left unused there); returns their names."""
        names = [a.name for a in self.attached]
        self.attached, self._marks = [], ""
        return names

    def retry(self, sink: ReplySink = SILENT, hooks: ToolHooks | None = None) -> Answer:
        """The last reply made again, with new draws; the one it replaces stays a branch."""
        if any(m.role == "assistant" for m in self._named.conversation.messages):
            self._named.stash()
        return self._turn(Ask("retry"), sink, hooks)

    def continue_reply(self, sink: ReplySink = SILENT, hooks: ToolHooks | None = None) -> Answer:
        """Goes on with the last reply: runs its calls where they wait (a loop stopped at its
        approval), else continues its text."""
        if resume_pending(self._named.conversation) is None:
            self.capabilities.require("continue", chat=True)
        return self._turn(Ask("continue"), sink, hooks)

    def constrain(self, schema: str | None = None, grammar: str | None = None, regex: str | None = None) -> bool:
        """The next replies keep to a JSON Schema, a grammar file (GBNF, or Lark for .lark) or a
        regular expression ("off" for none). Returns whether a constraint is now on."""
        from quipu.app.turn_options import sampling_params

        self.capabilities.require("grammar", chat=True)
        session = self._named.session
        # A bad file, schema or grammar is refused before anything changes.
        asked = TurnOptions(schema=schema, grammar=grammar, regex=regex)
        session.set_params(sampling_params(asked, self.env, session.params, self.capabilities))
        self.save()
        return session.params.grammar is not None

    def set_thinking(self, on: bool) -> bool:
        """Sets the template's `enable_thinking` for the next replies; False when the template
        has no such switch."""
        self.capabilities.require("think", chat=True)
        conv = self._named.conversation
        if conv.template is None or not conv.template.features()["thinking_switch"]:
            return False
        conv.update(variables={**conv.settings.variables, "enable_thinking": on})
        self.save()
        return True

    def set_reasoning(self, *, effort: str | None = None, budget: int | None = None) -> None:
        """How the model reasons in the next replies (see `Conversation.set_reasoning`); kept by the session."""
        self._named.conversation.set_reasoning(effort=effort, budget=budget, chat=True)
        self.save()

    @property
    def reasoning(self) -> tuple[str | None, int | None]:
        """(the reasoning effort, the reasoning budget) the next replies are given."""
        conv = self._named.conversation
        return conv.settings.variables.get("reasoning_effort"), conv.settings.reasoning_budget

    def undo(self) -> bool:
        """Goes back to before the last exchange; the conversation as it was stays a branch."""
        named = self._named
        if not any(m.role == "user" for m in named.conversation.messages):
            return False
        named.stash()
        named.conversation.undo()
        self.save()
        return True

    # ---- branches ----------------------------------------------------------------------------

    def edit(self, text: str, n: int | None = None, sink: ReplySink = SILENT, hooks: ToolHooks | None = None) -> Answer:
        """Your `n`-th message (the last by default) said as `text` instead: the reply goes on
        from before it, a new branch; the conversation as it was stays one /switch away."""
        at = self.yours(n)
        self._named.stash()
        self._named.conversation.back_to(at)
        return self.send(text, sink, hooks)

    def yours(self, n: int | None = None) -> int:
        """Where your `n`-th message is (the last by default) among the messages; UsageError
        where there is none such to edit."""
        yours = [i for i, m in enumerate(self.messages) if m.role == "user"]
        if not yours:
            raise UsageError("nothing to edit yet: no message of yours")
        if n is not None and not 1 <= n <= len(yours):
            raise UsageError(f"/edit takes which of your {len(yours)} messages (1 is the first), not {n}")
        return yours[(n or len(yours)) - 1]

    def branches(self) -> tuple[Branch, list[Branch]]:
        """This branch and the others, whole."""
        named = self._named
        return named.current(named.record()), list(named.others)

    def switch(self, word: str, on_progress: ProgressFn | None = None) -> int:
        """Goes to another branch (by its id, or `parent`, `next`, `prev`: `branches.chosen`):
        its context restored from its saved state, as a resume restores it; returns its id."""
        from quipu.app.branches import chosen
        from quipu.store.branches import switched
        from quipu.store.store import KEEP_STATE

        named = self._named
        record = named.record()
        to = chosen(word, named.current(record), named.others)
        if to == named.branch[0]:
            return to
        if not self.kept:
            raise UsageError("this chat is not saved, nor its branches: /save NAME keeps it, then /switch")
        named.flush()
        self.store.save(self.name, switched(record, to), KEEP_STATE)
        self.reload(on_progress)
        return to

    def reload(self, on_progress: ProgressFn | None = None) -> None:
        """The session opened again as its files now are (what changed since it was last saved
        is dropped), on the model loaded already: its context restored exactly."""
        from quipu.app.local import LocalHost
        from quipu.sessions.inference import InferenceSession

        old = self._named
        loaded = old.session.backend if isinstance(old.session, InferenceSession) else None
        host = LocalHost(loaded) if loaded is not None and isinstance(self.host, LocalHost) else self.host
        named = NamedSession.open(self.store, self.name, self.opts, self.env, host, on_progress)
        self._ready(named, self.opts)
        self.named = named
        old.session.close()  # (its context: the model stays, the new context holds it)

    def reset(self) -> None:
        self._named.conversation.reset()
        self.drop_attached()
        self.save()

    def set_system(self, text: str | None) -> None:
        self._named.conversation.set_system(text or None)
        self.save()

    def drop_oldest(self, for_message: str | None = None) -> int:
        """Drops old exchanges so that half the context is free again, or more if `for_message`
        needs more (with room left for a reply); where the context's size is the server's own,
        the oldest exchange. Without a message waiting, the last exchange (the reply the context
        filled up in, the one a /trim follows) stays, though it holds more than half."""
        named = self._named
        before = (list(named.others), named.branch, named.next_branch)
        named.stash()  # (nothing is dropped for good: the conversation as it was stays a branch)
        conv = named.conversation
        n_ctx = conv.session.n_ctx
        keep_free = int(n_ctx * KEEP_FREE_FRACTION)
        if for_message is not None and self.capabilities.context_size:
            size, _ = conv.size_alone(for_message)
            keep_free = max(keep_free, min(size + n_ctx // 8, n_ctx - 1))
        dropped = drop_oldest(conv, keep_free, keep_latest=for_message is None)
        if not dropped:  # (nothing changed: no branch of it)
            named.others, named.branch, named.next_branch = before
            return 0
        self.save()
        return dropped

    def new_session_with_system(self, on_progress: ProgressFn | None = None) -> str:
        """Leaves this session as it is and starts a new one with the same system prompt."""
        system = self._named.conversation.system
        model = self._named.keeper.model_for_new(self.opts, self.env)
        opts = TurnOptions(**{**self.opts.__dict__, "system": system or "", "model": model})
        name = generate_name(set(self.store.names()))
        self.leave()
        self._switch(name, on_progress, opts, kept=self.keep_unnamed)
        return name

    def leave(self) -> bool:
        """As the chat ends, or before another session is opened: this one saved, unless it is new
        and nothing was said in it (a session comes to be on disk with its first turn, as a chat
        begun and left does not). Whether it is kept."""
        if any(m.role != "system" for m in self.messages) or self.store.exists(self.name):
            self.save()
            return self.kept
        return False

    def set_option(self, key: str, value: str) -> Any:
        """`/set KEY VALUE`: a setting for the next replies, kept by the session; its value as read."""
        parsed = self._named.set(key, value)
        self.save()
        return parsed

    def settings(self) -> list[tuple[str, Any, str]]:
        """(setting, value, where it came from) for everything `/set` can change; all are kept by
        the session."""
        return self._named.settings(self.opts, self.env)

    # ---- saving and switching -------------------------------------------------------------------

    def save(self) -> None:
        if self.kept:
            self._named.save()

    def save_as(self, name: str) -> None:
        """Saves a copy of this session under `name`; this one stays open."""
        validate_name(name)
        if name == self.name:
            self.save()
            return
        if self.store.exists(name):
            raise UsageError(f"a session named '{name}' exists already")
        self._named.save()
        self._named.flush()  # (the copy is of the state on disk)
        self.store.fork(self.name, name, src_locked=True)  # (the copy is kept; an unkept one goes when left)

    def load(self, name: str, on_progress: ProgressFn | None = None) -> None:
        if name == self.name:
            raise UsageError(f"session '{name}' is already open")
        if not self.store.exists(name):
            raise UsageError(f"no session named '{name}'")
        self.leave()
        self._switch(name, on_progress, TurnOptions(verbose=self.opts.verbose, threads=self.opts.threads,
                                                    server=self.opts.server))

    def sessions(self) -> list[SessionInfo]:
        return self.store.list()[0]

    # ---- figures ---------------------------------------------------------------------------------

    @property
    def context_used(self) -> int:
        return self._named.session.used

    @property
    def context_size(self) -> int:
        return self._named.session.n_ctx  # 0: unknown, the server's own

    def size_of(self, text: str) -> int:
        """The tokens `text` takes as a message."""
        return self._named.conversation.size_alone(text)[0]

    @property
    def context_nearly_full(self) -> bool:
        return bool(self.context_size) and self.context_used >= WARN_FRACTION * self.context_size

    def tool_list(self) -> list[tuple[str, str, str]]:
        """(name, where it comes from, description) of each tool the model is told of."""
        conv = self._named.conversation
        sources = {name: t.source for name, t in self.tools.box.tools.items()} if self.tools else {}
        return [(t.name, sources.get(t.name, "the session (the caller runs it)"), t.description) for t in conv.settings.tools]


def history_file(env: Environment) -> str:
    """The chat's input history (what the user typed: kept to the user, 0600 in a 0700 folder),
    made private before prompt_toolkit appends to it."""
    import os

    from quipu.paths import open_private, private_dir

    path = private_dir(env.dirs.state) / "chat_history"
    os.close(open_private(path, os.O_WRONLY | os.O_APPEND))
    return str(path)
