"""Named sessions: a conversation resumed from the store (or created) on any host, turned, and
saved. One flow for every host; what differs (a state file, exact tokens and a slot file, or
messages alone) is the host's `Keeper`."""

from __future__ import annotations

import secrets
from typing import Any
from dataclasses import dataclass, field, replace

from quipu import __version__
from quipu.app.environment import Environment
from quipu.engine.base import UNTIL_IT_ENDS
from quipu.app.turn_options import (TurnOptions, chat_template_source, max_tokens, stop_strings, system_prompt,
                                     template_variables)
from quipu.app.hosts import Keeper, ModelHost
from quipu.engine.base import ProgressFn
from quipu.errors import InvalidParameter, UsageError
from quipu.options import OPTIONS, SAMPLING, SETTABLE
from quipu.sessions.base import Message, ModelSession
from quipu.sessions.stops import read_escapes
from quipu.sessions.conversation import Conversation, TurnSettings
from quipu.sessions.toolspec import ToolSpec
from quipu.store.branches import Branch, begins, current_branch, next_id, other_branches, tree_field
from quipu.store.store import SessionStore, validate_name
from quipu.store.transcript import Transcript, now_iso

ADJECTIVES = "amber brave calm clever eager fuzzy gentle happy jolly keen lucky merry noble quiet rapid shy sunny swift tidy witty".split()
NOUNS = "otter falcon maple river comet badger heron lynx meadow pebble quokka raven tulip walrus yak zebra cedar fjord ember harbor".split()


def generate_name(taken: set[str]) -> str:
    """A new session's name when none is given (`brave-otter-42`), none of `taken`."""
    while True:
        name = f"{secrets.choice(ADJECTIVES)}-{secrets.choice(NOUNS)}-{secrets.randbelow(90) + 10}"
        if name not in taken:
            return name


NO_TEMPLATE_NOTICE = ("this model has no chat template (a base model?): the conversation is written as ChatML, "
                      "which it may not know; --raw completes the text as it is, --chat-template FILE gives it one")
FOLD_NOTICE = ("the chat template has no system role; the system prompt was joined to the first user message, "
               "as llama.cpp does")


def store_for(env: Environment) -> SessionStore:
    return SessionStore(env.dirs.sessions)


@dataclass
class NamedSession:
    """A Conversation bound to a session name. Open it under the store's lock for the name."""

    store: SessionStore
    name: str
    conversation: Conversation
    keeper: Keeper[Any]
    created: str
    notices: list[str] = field(default_factory=list)
    chat_template: str | None = None  # the user's template, remembered by the session
    # The reply's length and stop strings, when given (a command line, or `/set`): kept by the session.
    max_tokens: int | None = None
    stop: tuple[str, ...] | None = None
    origins: dict[str, str] = field(default_factory=dict)  # where each setting's value came from
    # Which branch of the conversation this is (id, the branch it was made from, when), and the
    # others, whole (`store/branches.py`); `next_branch`, the id the next one made takes.
    branch: tuple[int, int | None, str] = (1, None, "")
    others: list[Branch] = field(default_factory=list)
    next_branch: int = 2
    _told_fold: bool = False
    _told_template: bool = False

    @property
    def session(self) -> ModelSession:
        return self.conversation.session

    @property
    def model_name(self) -> str:
        return self.keeper.model_name

    @classmethod
    def open(cls, store: SessionStore, name: str, opts: TurnOptions, env: Environment, host: ModelHost,
             on_progress: ProgressFn | None = None) -> "NamedSession":
        validate_name(name)
        record = store.load_transcript(name) if store.exists(name) else None
        if opts.branch is not None:
            record = on_branch(store, name, record, opts.branch)
        source = chat_template_source(opts)
        if record is None:
            opened = host.create(opts, env, name)
            messages: list[Message] = []
            variables = template_variables(opts)
            system = system_prompt(opts, env)
            created = now_iso()
        else:
            opened = host.resume(store, name, record, opts, env, on_progress)
            messages = [Message.from_dict(m) for m in record.messages]
            if opened.reread:  # (the marks of a context that is not the saved one mean nothing)
                messages = [replace(m, context_before=None, decoded_before=None) for m in messages]
            source = source or record.chat_template
            variables = template_variables(opts, record.template_variables)
            system = opts.system
            created = record.created or now_iso()
        limits = record.limits if record is not None else {}
        # (a session's own tools, which a command's replace: `tools.offer`)
        tools = [ToolSpec(t["function"]["name"], str(t["function"].get("description") or ""),
                          t["function"].get("parameters") or {"type": "object"})
                 for t in (record.tools if record is not None else ())]
        try:
            conv = Conversation.start(opened.session, system, template=source, messages=messages,
                                      settings=TurnSettings().but(variables=variables, tools=tools,
                                                                  reasoning_budget=limits.get("reasoning_budget")))
            conv.set_reasoning(effort=opts.reasoning_effort, budget=opts.reasoning_budget)
        except BaseException:
            opened.session.close()
            raise
        here = current_branch(record) if record is not None else None
        return cls(store, name, conv, opened.keeper, created, list(opened.notices), chat_template=source,
                   max_tokens=opts.max_tokens if opts.max_tokens is not None else limits.get("max_tokens"),
                   stop=stop_strings(opts, env) if opts.stop else (tuple(limits["stop"]) if "stop" in limits else None),
                   origins=origins(opts, env, record),
                   branch=(here.id, here.parent, here.made) if here is not None else (1, None, created),
                   others=other_branches(record) if record is not None else [],
                   next_branch=next_id(record) if record is not None else 2)

    def reply_limits(self, opts: TurnOptions, env: Environment) -> tuple[int, tuple[str, ...]]:
        """The longest reply and the stop strings: the command line's, else the session's, else
        the config's or the defaults."""
        limit = self.max_tokens if self.max_tokens is not None else max_tokens(opts, env)
        return limit, self.stop if self.stop is not None else stop_strings(opts, env)

    def set(self, key: str, value: str) -> Any:
        """A setting for the next replies (`SETTABLE`; `/set KEY VALUE`), kept by the session; its value as read."""
        key = key.replace("-", "_")
        kind = SETTABLE.get(key)
        if kind is None:
            raise InvalidParameter(f"unknown setting '{key}' (settable: {', '.join(SETTABLE)})")
        try:
            parsed = kind(value)
        except ValueError:
            raise InvalidParameter(f"{key} takes {'an integer' if kind is int else 'a number'}, not '{value}'") from None
        if key == "max_tokens":
            bounds = OPTIONS["max_tokens"].bounds
            refused = bounds.refusal("max_tokens", parsed) if bounds is not None else None
            if refused is not None:
                raise InvalidParameter(refused)
            self.max_tokens = parsed
        elif key == "stop":  # a text, its escapes read (`/set stop \n\n`); off: none
            self.stop = () if parsed == "off" else (read_escapes(parsed),)
            parsed = list(self.stop)
        else:
            self.session.set_params(self.session.params.replace(**{key: parsed}))
        self.origins[key] = "set here"
        return parsed

    def settings(self, opts: TurnOptions, env: Environment) -> list[tuple[str, Any, str]]:
        """(setting, value, where it came from) for everything `set` can change."""
        limit, stop = self.reply_limits(opts, env)
        values = {**{k: getattr(self.session.params, k) for k in SAMPLING},
                  "max_tokens": limit if limit < UNTIL_IT_ENDS else "none (until the reply ends)",
                  "stop": list(stop) or "none"}
        return [(k, values[k], self.origins.get(k, "default")) for k in SETTABLE]

    def tell(self, notices: list[str]) -> None:
        """Notices for the user, said with the turn's."""
        self.notices.extend(notices)

    def note_template(self) -> None:
        """Says once that the model has no chat template, and once that the template had no
        system role, when the system prompt was folded."""
        if self.conversation.without_template and not self._told_template:
            self._told_template = True
            self.notices.append(NO_TEMPLATE_NOTICE)
        if self.conversation.folds_system and not self._told_fold:
            self._told_fold = True
            self.notices.append(FOLD_NOTICE)

    def warm(self, text: str) -> None:
        """Before the first turn of a new conversation: what the prompt cache holds of it is restored."""
        conv = self.conversation
        if all(m.role == "system" for m in conv.messages):
            self.keeper.warm(self.session, lambda: conv.tokens_with(text))

    def record(self) -> Transcript:
        """The transcript as the conversation stands (its other branches with it)."""
        conv = self.conversation
        limits = {k: v for k, v in (("max_tokens", self.max_tokens),
                                    ("stop", list(self.stop) if self.stop is not None else None),
                                    ("reasoning_budget", conv.settings.reasoning_budget)) if v is not None}
        record = Transcript(
            messages=[m.to_dict() for m in conv.messages], created=self.created, updated=now_iso(),
            quipu=__version__, chat_template=self.chat_template, template_variables=dict(conv.settings.variables),
            limits=limits, tools=[t.to_openai() for t in conv.settings.tools], **self.keeper.fields(self.session),
        )
        record.tree = tree_field(self.current(record), self.others, self.next_branch)
        return record

    def current(self, record: Transcript) -> Branch:
        """This branch, whole, as `record` (this conversation's) holds it."""
        id_, parent, made = self.branch
        return Branch(id_, parent, made or self.created, record.updated, record.messages, record.tokens,
                      record.n_decoded, record.draws, record.media)

    def stash(self) -> None:
        """Keeps the conversation as it stands as a branch of its own: what follows (an /edit, a
        /retry, an /undo) makes a new branch, and this one stays one /switch away. (A branch
        that only begins another is not kept apart: nothing of it would be lost.)"""
        here = self.current(self.record())
        if any(begins(here, o) for o in self.others):
            return
        self.others.append(here)
        self.branch = (self.next_branch, here.id, now_iso())
        self.next_branch += 1

    def save(self) -> None:
        """Saves the transcript (and what the host keeps beside it), each file atomically: at
        worst the turn in progress is lost."""
        self.notices += self.keeper.save(self.store, self.name, self.record(), self.session,
                                         self.conversation.kept_by_next_turn)

    def flush(self) -> None:
        """Waits for a state still being written in the background (a chat's)."""
        self.notices += self.keeper.wait()

    def close(self) -> None:
        """Done with the session: the media it took that nothing names any more (an image whose
        exchange was undone) leave its transcript and, where no other session names them, the
        media folder; then its context is freed."""
        dropped = self.keeper.trim_media(self.session, [m.content for m in self.conversation.messages])
        if dropped and self.store.exists(self.name):
            from quipu.app.local_media import forget_media

            self.save()
            self.flush()
            forget_media(self.store, dropped)
        self.flush()
        self.session.close()


def on_branch(store: SessionStore, name: str, record: Transcript | None, branch: int) -> Transcript:
    """The session's transcript with `branch` its current one (written so, the state files as
    they are: each branch's state is found in them by its tokens)."""
    from quipu.store.branches import switched
    from quipu.store.store import KEEP_STATE

    if record is None:
        raise UsageError(f"--branch {branch}: there is no session '{name}' yet to have branches")
    if current_branch(record).id == branch:
        return record
    try:
        record = switched(record, branch)
    except KeyError:
        ids = sorted([current_branch(record).id, *(b.id for b in other_branches(record))])
        raise UsageError(f"session '{name}' has no branch {branch} (it has {', '.join(map(str, ids))}: "
                         f"`quipu sessions tree {name}`)") from None
    store.save(name, record, KEEP_STATE)
    return record


def origins(opts: TurnOptions, env: Environment, record: Transcript | None) -> dict[str, str]:
    """Where each setting of a session came from: "command line", "session", "config" or "default"."""
    out = {}
    given = opts.sampling
    for key in SAMPLING:
        if key in given:
            out[key] = "command line"
        elif record is not None and key in record.params:
            out[key] = "session"
        elif key in env.config.generation:
            out[key] = "config"
        else:
            out[key] = "default"
    if opts.max_tokens is not None:
        out["max_tokens"] = "command line"
    elif record is not None and "max_tokens" in record.limits:
        out["max_tokens"] = "session"
    else:
        out["max_tokens"] = "config" if "max_tokens" in env.config.generation else "default"
    if opts.stop:
        out["stop"] = "command line"
    elif record is not None and "stop" in record.limits:
        out["stop"] = "session"
    else:
        out["stop"] = "config" if "stop" in env.config.generation else "default"
    return out
