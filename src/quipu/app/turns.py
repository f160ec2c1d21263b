"""One turn of `quipu run`, from the user's options to a finished reply, with or without a
named session, on whichever host the model runs; and what such a turn would feed the model
(`--show-prompt`). Written once for every host."""

from __future__ import annotations

import json

from contextlib import closing
from dataclasses import dataclass, field, replace
from typing import Any, TYPE_CHECKING, Callable, Sequence

from quipu.app.environment import Environment
from quipu.app.turn_options import (TurnOptions, chat_template_source, max_tokens, stop_strings, system_prompt,
                                     template_variables)
from quipu.app.choose import open_host
from quipu.app.hosts import ModelHost
from quipu.app.modes import asked_of, check_options, mode_of
from quipu.app.named import FOLD_NOTICE, NO_TEMPLATE_NOTICE, NamedSession, store_for
from quipu.app.tools import (ToolHooks, OpenTools, answer_pending, follow_calls, offer, resume_pending, skip_pending,
                              open_tools)
from quipu.engine.base import MEDIA_MARK, defuse
from quipu.errors import BadInput, ContextOverflow, UsageError
from quipu.sessions.base import (LOCAL, SILENT, Capabilities, Generation, ModelSession, Stats,
                                 TokenSession, token_session)
from quipu.sessions.base import ReplySink as ReplySink  # (the CLI's sinks are made of it)
from quipu.sessions.conversation import Conversation, Message, TurnSettings
from quipu.store.store import validate_name

if TYPE_CHECKING:
    from quipu.app.attachments import Attachment
    from quipu.app.answer_log import Followed
    from quipu.engine.grammar import Grammar


@dataclass
class TurnResult:
    text: str  # the answer; a thinking model's reasoning is apart
    finish_reason: str
    model: str
    seed: int | None
    session: str | None
    stats: Stats = field(default_factory=Stats)
    notices: list[str] = field(default_factory=list)
    reasoning: str = ""
    failure: Exception | None = None  # a server failing mid-reply: raised once the result is out
    constrained_by: str | None = None  # which engine kept the reply to a grammar (said under --verbose)
    tool_calls: list[Any] = field(default_factory=list)  # app.tools.CallRecord: the calls run, then those left to run
    # A reply under a grammar cut (by the token limit or a full context) before the grammar was
    # done: its text will not parse.
    incomplete: bool = False
    fingerprint: str | None = None  # the model file's (a local model's), as the log keeps it
    system: str | None = None  # the system prompt the answer was given, as the log keeps it

    @classmethod
    def of(cls, gen: Generation, model: str, session: ModelSession, name: str | None, notices: list[str] | None = None,
           fingerprint: str | None = None, system: str | None = None, tool_calls: Sequence[Any] = ()) -> TurnResult:
        answer = gen.text if gen.answer is None else gen.answer
        return cls(answer, gen.finish_reason, model, session.params.seed, name, session.stats, list(notices or []),
                   gen.reasoning, gen.error, constrained_by(session.params.grammar, session.capabilities),
                   incomplete=cut_short(session.params.grammar, gen.finish_reason, answer), fingerprint=fingerprint,
                   system=system, tool_calls=list(tool_calls))

    def to_json(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "reasoning": self.reasoning or None,
            "finish_reason": self.finish_reason,
            "model": self.model,
            "seed": self.seed,
            "session": self.session,
            "usage": self.stats.usage(),
            "timings": self.stats.timings(),
            **({"placement": self.stats.placement} if self.stats.placement is not None else {}),
            **({"tool_calls": [c.to_json() for c in self.tool_calls]} if self.tool_calls else {}),
            **({"incomplete": self.incomplete} if self.constrained_by is not None else {}),
        }


def cut_short(grammar: Grammar | None, finish_reason: str, text: str) -> bool:
    """Whether a reply under `grammar` (None: none) was cut, by the token limit or a full
    context, before the grammar was done: for a schema, JSON that does not parse (a reply under
    any other grammar that was cut is taken for unfinished)."""
    if grammar is None or finish_reason not in ("length", "context_full"):
        return False
    if grammar.kind != "json_schema":
        return True
    try:
        json.loads(text)
    except ValueError:
        return True
    return False


@dataclass
class PromptView:
    """What `--show-prompt` shows: the exact context a turn would feed, without generating."""

    text: str
    tokens: list[int]
    reused: int  # how many of them need not be read: a session's context, or the prompt cache
    model: str
    session: str | None

    @classmethod
    def of(cls, held: TokenSession, tokens: list[int], reused: int, model: str, session: str | None) -> PromptView:
        """The view of `tokens` as `held`'s model spells them (a medium as llama.cpp's marker for one)."""
        return cls(MEDIA_MARK.sub("<__media__>", held.spell(tokens)), tokens, reused, model, session)

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "tokens": self.tokens, "reused_tokens": self.reused, "model": self.model,
                "session": self.session}


def run_turn(prompt: str | None, opts: TurnOptions, env: Environment, sink: ReplySink = SILENT, *,
             on_result: Callable[[TurnResult], None] | None = None, hooks: ToolHooks | None = None) -> TurnResult:
    """Runs one prompt to a reply on the host the options name; `sink` receives the answer and a
    thinking model's reasoning as they are generated, and says when to stop; `on_result` the
    result before anything else is written (a session's save comes first; the prompt cache's
    after, so a reader of the answer does not wait for it). A failure mid-reply is raised once
    the result is out."""
    opts, history = _followed(opts, env)
    with closing(open_host(opts.server)) as host:
        check_options(asked_of(opts.given), mode_of(opts.given), host.capabilities)
        files, media = attached(opts, host.capabilities, sink.stopped)
        tools = open_tools(opts.tool_options, env, constrained=opts.constrained, stopped=sink.stopped,
                           on_output=hooks.on_output if hooks is not None else None)
        try:
            if opts.session is not None:
                result = run_session_turn(prompt, opts, env, host, sink, tools, hooks, files, media)
                if on_result is not None:
                    on_result(result)
            else:
                result = _one_shot(prompt, opts, env, host, sink, on_result, tools, hooks, files, media,
                                   history.messages if history is not None else ())
        finally:
            if tools is not None:
                tools.close()
    from quipu.app.answer_log import log_answer

    unlogged = log_answer(env, opts.logged, "run", prompt, result, system=result.system,
                          conversation=history.conversation if history is not None else
                          f"session:{opts.session}" if opts.session is not None else "",
                          attachments=[*files, *media])
    if unlogged:
        result.notices.append(unlogged)
    if opts.verbose and result.constrained_by:
        result.notices.append(result.constrained_by)
    if result.failure is not None:
        raise result.failure
    return result


def _followed(opts: TurnOptions, env: Environment) -> tuple[TurnOptions, "Followed | None"]:
    """A follow-up's logged conversation (None for a turn that is none), and the options with its
    system prompt where none is given."""
    if not opts.follow_up and opts.cid is None:
        return opts, None
    from quipu.app.answer_log import followed

    check_options(asked_of(opts.given), mode_of(opts.given))
    history = followed(env, opts.cid)
    if opts.system is None and history.system is not None:
        opts = replace(opts, system=history.system)
    return opts, history


def attached(opts: TurnOptions, host: Capabilities, stopped: Callable[[], bool] = lambda: False) -> tuple[list[Any], list[Any]]:
    """The text files and the images and recordings `--attach` gives (`attachments.Attachment`),
    all read, and refused in one line, before the model is loaded; `compose` puts them in the
    message."""
    if not opts.attach:
        return [], []
    from quipu.app.attachments import read_attachments, split_media

    files, media = split_media(read_attachments(opts.attach, stopped))
    if media:
        host.require("media")
        for medium in media:
            if opts.raw:
                raise UsageError(f"cannot attach {medium.name} {medium.describe()} with --raw: a medium goes in a "
                                 "chat message")
    return files, media


def with_marks(prompt: str | None, marks: str) -> str | None:
    """A message with its media (their markers) before its text, nothing between them: as
    llama.cpp's server joins a message's content parts (no new line before or after a medium)."""
    return marks + (prompt or "") if marks else prompt


def compose(conv: Conversation | None, prompt: str | None, files: Sequence[Attachment], marks: str) -> str | None:
    """A message with what is attached to it: its media (their markers) first, then its text
    files, delimited, then its text. Where the chat template has a slot for documents (Command
    R's, Granite's), the files go there instead, as the conversation's `documents`, and stay."""
    from quipu.app.attachments import message_with, takes_documents

    if files and conv is not None and conv.template is not None and takes_documents(conv.template):
        named = "doc_id" in conv.template.source  # (Granite's names a document so; others print every key)
        variables = conv.settings.variables
        conv.update(variables={**variables, "documents": [
            *(variables.get("documents") or []),
            *({**({"doc_id": f.name} if named else {}), "title": f.name, "text": f.text} for f in files)]})
        files = []
    prompt = defuse(prompt) if prompt else prompt  # (text from outside is never taken for a marker)
    return with_marks(message_with(prompt, files) if files else prompt, marks)


def constrained_by(grammar: Grammar | None, host: Capabilities = LOCAL) -> str | None:
    """Which engine keeps replies to `grammar` on `host`, in words (None: no grammar)."""
    if grammar is None:
        return None
    if not host.own_grammar:
        from quipu.engine.constraint import describe

        return describe(grammar)
    return f"llama-server's own grammar engine enforces the {grammar.what}"


def _one_shot(prompt: str | None, opts: TurnOptions, env: Environment, host: ModelHost, sink: ReplySink,
              on_result: Callable[[TurnResult], None] | None, tools: OpenTools | None = None,
              hooks: ToolHooks | None = None, files: Sequence[Attachment] = (),
              media: Sequence[Attachment] = (), history: Sequence[Message] = ()) -> TurnResult:
    if not prompt and not opts.messages and not media and not files:
        raise BadInput("no prompt: give one as an argument or on standard input")
    limit, stop = max_tokens(opts, env), stop_strings(opts, env)
    source = chat_template_source(opts)
    messages, theirs = file_messages(opts, host.capabilities)
    messages = messages or list(history)
    opened = host.create(opts, env, media=[*media, *theirs])
    session: ModelSession = opened.session  # (what any host's is: `ModelHost`)
    keeper = opened.keeper
    ours = opened.media_marks[:len(media)]
    try:
        conv = None if opts.raw else _conversation(session, opts, env, source, messages,
                                                   opened.media_marks[len(media):], bool(history))
        prompt = compose(conv, prompt, files, "".join(ours))
        if prompt:
            session.check_text_fits(prompt)
        notices = []
        if conv is None:
            raw = token_session(session, "raw")
            tokens = raw.raw_tokens(prompt or "")
            cached = keeper.warm(session, lambda: tokens)
            gen = raw.complete(tokens, limit, stop, sink)
        else:
            offer(conv, tools, opts.tool_options)
            if prompt:
                cached = keeper.warm(session, lambda: conv.tokens_with(prompt))
                gen = conv.send(prompt, max_tokens=limit, stop=stop, sink=sink)
            else:  # --messages alone: the reply to its last message, or its last reply continued
                last = conv.messages[-1]
                cached = keeper.warm(session, conv.continued_tokens if last.role == "assistant" else
                                     conv.context_tokens)
                if last.role == "assistant":
                    gen = conv.continue_reply(max_tokens=limit, stop=stop, sink=sink)
                else:
                    gen = conv.answer(max_tokens=limit, stop=stop, sink=sink)
            gen, calls, tool_notes = follow_calls(conv, tools, gen, opts.tool_options, limit, stop, sink, hooks,
                                                  lambda found: keeper.take_media(session, None, found))
            notices = opened.notices + ([NO_TEMPLATE_NOTICE] if conv.without_template else []) + \
                ([FOLD_NOTICE] if conv.folds_system else []) + tool_notes
        result = TurnResult.of(gen, keeper.model_name, session, None, notices, keeper.model_fingerprint,
                               conv.system if conv is not None else None, calls if conv is not None else ())
        if on_result is not None:
            on_result(result)  # the answer is out before the cache is written
        result = replace(result, notices=result.notices + keeper.remember(session, cached))
        return result
    finally:
        session.close()


def file_messages(opts: TurnOptions, host: Capabilities) -> tuple[list[Any], list[Any]]:
    """--messages' conversation, and the media its messages hold (read before the model is)."""
    if not opts.messages:
        return [], []
    from quipu.app.tool_files import messages_from_file

    media: list[Any] = []
    messages = messages_from_file(opts.messages, media)
    if media:
        host.require("media")
    return messages, media


def _conversation(session: ModelSession, opts: TurnOptions, env: Environment, source: str | None,
                  messages: Sequence[Message] = (),
                  marks: Sequence[str] = (), follows: bool = False) -> Conversation:
    """A one-shot run's conversation: the system prompt alone, --messages' conversation
    (`messages`, their media's markers in `marks`), or the logged exchanges a follow-up goes on
    with (`follows`: `messages`, with the system prompt)."""
    settings = TurnSettings().but(variables=template_variables(opts))
    if follows:
        conv = Conversation.start(session, system_prompt(opts, env), template=source, messages=list(messages),
                                  settings=settings)
    elif not opts.messages:
        conv = Conversation.start(session, system_prompt(opts, env), template=source, settings=settings)
    else:
        from quipu.app.tool_files import media_placeholder

        def marked(text: str) -> str:
            for n, mark in enumerate(marks):
                text = text.replace(media_placeholder(n), mark)
            return text

        conv = Conversation.start(session, None, template=source, settings=settings,
                                  messages=[replace(m, content=marked(m.content)) for m in messages])
        if opts.system is not None:
            conv.set_system(opts.system)
    conv.set_reasoning(effort=opts.reasoning_effort, budget=opts.reasoning_budget)
    return conv


def run_session_turn(prompt: str | None, opts: TurnOptions, env: Environment, host: ModelHost,
                     sink: ReplySink = SILENT, tools: OpenTools | None = None, hooks: ToolHooks | None = None,
                     files: Sequence[Attachment] = (), media: Sequence[Attachment] = ()) -> TurnResult:
    """`quipu run --session NAME` (see run_turn): continue or create the session, run one turn,
    save it (a reply cut short by a failing server is saved with what came); `files` and
    `media`, what its message carries."""
    name = check_session_turn(prompt, opts, bool(media or files))
    store = store_for(env)
    store.clean_temporaries()
    with store.lock(name):
        named = NamedSession.open(store, name, opts, env, host, sink.reading)
        try:
            marks = named.keeper.take_media(named.session, store, media) if media else ""
            if files or media:
                prompt = compose(named.conversation, prompt, files, marks)
            conv = named.conversation
            limit, stop = named.reply_limits(opts, env)
            offer(conv, tools, opts.tool_options)
            try:
                if opts.tool_results:
                    gen = answer_pending(conv, opts.tool_options, limit, stop, sink)
                elif not prompt and not opts.continue_reply:
                    resumed = resume_pending(conv)  # a loop that stopped before its calls ran goes on
                    if resumed is None:
                        raise BadInput("no prompt: give one as an argument or on standard input (session "
                                       f"'{name}' has no calls waiting to run)")
                    gen = resumed
                elif opts.continue_reply:
                    gen = resume_pending(conv) or conv.continue_reply(max_tokens=limit, stop=stop, sink=sink)
                else:
                    assert prompt  # (a turn without a prompt went another way above)
                    skip_pending(conv)  # (calls left waiting are answered "not run")
                    named.warm(prompt)
                    gen = conv.send(prompt, max_tokens=limit, stop=stop, sink=sink)
                gen, calls, tool_notes = follow_calls(
                    conv, tools, gen, opts.tool_options, limit, stop, sink, hooks,
                    lambda found: named.keeper.take_media(named.session, store, found))
                named.tell(tool_notes)
            except ContextOverflow as exc:
                if named.session.used < exc.n_ctx // 2:
                    raise  # the prompt alone is too long
                raise ContextOverflow(exc.prompt_tokens, exc.n_ctx, at_least=exc.at_least, hint=(
                    f"session '{name}' is full; continue it with a larger --ctx, or free room with /trim "
                    f"in `quipu chat -S {name}`"
                )) from None
            named.note_template()
            named.save()
        finally:
            named.close()
    return TurnResult.of(gen, named.model_name, named.session, name, named.notices, named.keeper.model_fingerprint,
                         named.conversation.system, calls)


def check_session_turn(prompt: str | None, opts: TurnOptions, media: bool = False) -> str:
    """The session's name, once the options make sense for a session turn (its mode's are checked
    already: `modes.py`); `media`: the message carries images or recordings."""
    assert opts.session is not None  # (a session turn is one with --session)
    if opts.continue_reply and (prompt or media):
        raise UsageError("--continue keeps generating the last reply; it takes no prompt")
    if opts.tool_results and (prompt or media or opts.continue_reply):
        raise UsageError("--tool-result gives the model what its calls returned; it takes no prompt")
    if not opts.continue_reply and not opts.tool_results and not prompt and not media and not (
            opts.functions or opts.mcp or opts.tools_file):
        raise BadInput("no prompt: give one as an argument or on standard input")
    return validate_name(opts.session)


def show_prompt(prompt: str | None, opts: TurnOptions, env: Environment) -> PromptView:
    """The context `run_turn` would feed for this prompt (a session's included), without
    generating or saving anything."""
    opts, history = _followed(opts, env)
    with closing(open_host(opts.server)) as host:
        check_options(asked_of(opts.given, own=("show",)), mode_of(opts.given), host.capabilities)
        files, media = attached(opts, host.capabilities)
        if opts.session is not None:
            return _show_session_prompt(prompt, opts, env, host, files, media)
        if not prompt and not opts.messages and not media and not files:
            raise BadInput("no prompt: give one as an argument or on standard input")
        messages, theirs = file_messages(opts, host.capabilities)
        messages = messages or (history.messages if history is not None else [])
        opened = host.create(opts, env, media=[*media, *theirs])
        session: ModelSession = opened.session
        ours = "".join(opened.media_marks[:len(media)])
        # (the tools are part of the context their definitions are written into)
        tools = open_tools(opts.tool_options, env, constrained=opts.constrained)
        try:
            held = token_session(session, "show_prompt")
            if opts.raw:
                tokens = held.raw_tokens(compose(None, prompt, files, ours) or "")
            else:
                conv = _conversation(session, opts, env, chat_template_source(opts), messages,
                                     opened.media_marks[len(media):], history is not None)
                prompt = compose(conv, prompt, files, ours)
                offer(conv, tools, opts.tool_options)
                if prompt:
                    tokens = conv.tokens_with(prompt)
                elif conv.messages[-1].role == "assistant":
                    tokens = conv.continued_tokens()
                else:
                    tokens = conv.context_tokens()
            return PromptView.of(held, tokens, opened.keeper.cached(session, tokens), opened.keeper.model_name, None)
        finally:
            if tools is not None:
                tools.close()
            session.close()


def _show_session_prompt(prompt: str | None, opts: TurnOptions, env: Environment, host: ModelHost,
                         files: Sequence[Attachment] = (), media: Sequence[Attachment] = ()) -> PromptView:
    name = check_session_turn(prompt, opts, bool(media or files))
    store = store_for(env)
    with store.lock(name):
        named = NamedSession.open(store, name, opts, env, host)
        try:
            marks = named.keeper.take_media(named.session, store, media) if media else ""
            if files or media:
                prompt = compose(named.conversation, prompt, files, marks)
            conv = named.conversation
            if opts.continue_reply:
                tokens = conv.continued_tokens()
            else:
                tokens = conv.tokens_with(prompt or "")
            held = conv.tokens_side
            return PromptView.of(held, tokens, held.reused(tokens), named.model_name, name)
        finally:
            named.close()
