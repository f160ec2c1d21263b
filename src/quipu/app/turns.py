"""`quipu run`'s turn, from the user's options to a finished reply, with or without a named
session, on whichever host the model runs, and what such a turn would feed the model
(`--show-prompt`): the turn opened (its session, conversation and what it asks), then run by
`turn.Turn`."""

from __future__ import annotations

from contextlib import closing
from dataclasses import dataclass, replace
from typing import Any, TYPE_CHECKING, Callable, Sequence

from quipu.app.answer import Answer
from quipu.app.environment import Environment
from quipu.app.turn_options import (TurnOptions, chat_template_source, effort_of, max_tokens, stop_strings,
                                   system_prompt, template_variables)
from quipu.app.choose import open_host
from quipu.app.hosts import ModelHost
from quipu.app.modes import asked_of, check_options, mode_of
from quipu.app.named import NamedSession, store_for
from quipu.app.tools import OpenTools, ToolHooks, offer, open_tools
from quipu.app.turn import Ask, PromptView, Turn, compose
from quipu.errors import BadInput, ContextOverflow, UsageError
from quipu.sessions.base import SILENT, Capabilities, Generation, ModelSession, common_prefix
from quipu.sessions.base import ReplySink as ReplySink  # (the CLI's sinks are made of it)
from quipu.sessions.conversation import Conversation, Message, TurnSettings
from quipu.store.store import validate_name

if TYPE_CHECKING:
    from quipu.app.attachments import Attachment
    from quipu.app.logprobs import Recorded
    from quipu.app.answer_log import Followed
    from quipu.store.store import SessionStore
    from quipu.store.transcript import Transcript


def run_turn(prompt: str | None, opts: TurnOptions, env: Environment, sink: ReplySink = SILENT, *,
             on_result: Callable[[Answer], None] | None = None, hooks: ToolHooks | None = None) -> Answer:
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

        def logged(answer: Answer, conversation: str, parent: int | None) -> tuple[int | None, str | None]:
            from quipu.app.answer_log import log_answer

            return log_answer(env, opts.logged, "run", prompt, answer, system=answer.system,
                              conversation=conversation, attachments=[*files, *media],
                              unkept=opts.messages is not None, parent=parent)

        try:
            if opts.session is not None:  # (logged before it is saved, which keeps its id in the log)
                result = run_session_turn(prompt, opts, env, host, sink, tools, hooks, files, media,
                                          log=lambda answer, parent: logged(answer, f"session:{opts.session}",
                                                                            parent))
                if on_result is not None:
                    on_result(result)
            else:
                result = _one_shot(prompt, opts, env, host, sink, on_result, tools, hooks, files, media,
                                   history.messages if history is not None else ())
                _, unlogged = logged(result, history.conversation if history is not None else "",
                                     history.parent if history is not None else None)
                if unlogged:
                    result.notices.append(unlogged)
        finally:
            if tools is not None:
                tools.close()
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


@dataclass(frozen=True)
class Given:
    """A conversation given whole in memory (a server's request), where `--messages` reads one
    from a file: its messages, and the images and recordings they hold (each where
    `tool_files.media_placeholder` stands in a message)."""

    messages: Sequence[Message]
    media: Sequence[Attachment] = ()
    # What the context held before them (Ollama's `context`: the tokens of an exchange before),
    # which they go on from as the template renders them alone.
    before: Sequence[int] = ()


def _one_shot(prompt: str | None, opts: TurnOptions, env: Environment, host: ModelHost, sink: ReplySink,
              on_result: Callable[[Answer], None] | None, tools: OpenTools | None = None,
              hooks: ToolHooks | None = None, files: Sequence[Attachment] = (),
              media: Sequence[Attachment] = (), history: Sequence[Message] = (), given: Given | None = None,
              logprobs: int | None = None) -> Answer:
    """A one-shot turn, from its options to its answer; `given`, a conversation given whole;
    `logprobs`, each drawn token's log probability recorded (with so many likeliest beside it)."""
    if not prompt and not opts.messages and not media and not files and given is None:
        raise BadInput("no prompt: give one as an argument or on standard input")
    limit, stop = max_tokens(opts, env), stop_strings(opts, env)
    turn, ask = _one_shot_turn(prompt, opts, env, host, files, media, history, tools, hooks, given)
    try:
        if ask.text:
            turn.session.check_text_fits(ask.text)
        recorded = with_logprobs(turn.session, sink, logprobs)
        answer = turn.answer(ask, limit, stop, recorded or sink)
        if recorded is not None:
            recorded.finish(answer)
        if on_result is not None:
            on_result(answer)  # the answer is out before the cache is written
        return turn.remember(answer)
    finally:
        turn.session.close()


def with_logprobs(session: ModelSession, sink: ReplySink, top: int | None) -> Recorded | None:
    """`sink` with each drawn token's log probability given before its piece (`top` likeliest
    beside it; None: not asked for, and None is returned)."""
    if top is None:
        return None
    from quipu.app.logprobs import Recorded
    from quipu.sessions.inference import InferenceSession

    assert isinstance(session, InferenceSession)  # (a server's requests run on a local model)
    return Recorded(sink, session, top)


def _one_shot_turn(prompt: str | None, opts: TurnOptions, env: Environment, host: ModelHost,
                   files: Sequence[Attachment], media: Sequence[Attachment], history: Sequence[Message],
                   tools: OpenTools | None, hooks: ToolHooks | None = None,
                   given: Given | None = None) -> tuple[Turn, Ask]:
    """A one-shot run's turn (its session open: the caller closes it), and what it asks: the
    prompt with what is attached to it; --messages' last message's reply (or its last reply
    continued); or a plain completion (--raw)."""
    source = chat_template_source(opts)
    messages, theirs = file_messages(opts, host.capabilities)
    if given is not None:
        messages, theirs = list(given.messages), list(given.media)
    messages = messages or list(history)
    opened = host.create(opts, env, media=[*media, *theirs])
    ours = "".join(opened.media_marks[:len(media)])
    try:
        if opts.raw:
            text = compose(None, prompt, files, ours) or ""
            return Turn(opened.session, opened.keeper, None, opts.tool_options, notices=opened.notices), \
                Ask("raw", text)
        conv = _conversation(opened.session, opts, env, source, messages, opened.media_marks[len(media):],
                             bool(history))
        prompt = compose(conv, prompt, files, ours)
        offer(conv, tools, opts.tool_options)
        turn = Turn(opened.session, opened.keeper, conv, opts.tool_options, tools=tools, hooks=hooks,
                    notices=opened.notices)
    except BaseException:
        opened.session.close()
        raise
    if prompt:
        return turn, Ask("send", prompt)
    # --messages alone: the reply to its last message, or its last reply continued
    ask = Ask("continue" if conv.messages[-1].role == "assistant" else "answer")
    if given is None or not given.before:
        return turn, ask
    rendered = turn.tokens(ask)  # (the exchange before holds the model's BOS already)
    if rendered and rendered[0] == opened.session.vocab.bos_token():
        rendered = rendered[1:]
    return Turn(opened.session, opened.keeper, None, opts.tool_options, notices=opened.notices), \
        Ask("raw", tokens=[*given.before, *rendered])


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
    elif not messages:
        conv = Conversation.start(session, system_prompt(opts, env), template=source, settings=settings)
    else:
        from quipu.app.tool_files import placed

        conv = Conversation.start(session, None, template=source, settings=settings, messages=placed(messages, marks))
        if opts.system is not None:
            conv.set_system(opts.system)
    conv.set_reasoning(effort=effort_of(opts, conv), budget=opts.reasoning_budget)
    return conv


def run_session_turn(prompt: str | None, opts: TurnOptions, env: Environment, host: ModelHost,
                     sink: ReplySink = SILENT, tools: OpenTools | None = None, hooks: ToolHooks | None = None,
                     files: Sequence[Attachment] = (), media: Sequence[Attachment] = (), *,
                     request: SessionRequest | None = None,
                     log: Callable[[Answer, int | None], tuple[int | None, str | None]] | None = None) -> Answer:
    """`quipu run --session NAME` (see run_turn): continue or create the session, run one turn,
    save it (a reply cut short by a failing server is saved with what came); `files` and
    `media`, what its message carries. `request`: a server's request instead of a prompt (its
    messages go on from the session's; its own options are not kept by the session; the turn is
    kept once `SessionRequest.took` says its client has the whole answer, and the same request
    again is answered from it). `log` writes the answer to the log of answers, given the answer it
    follows up (the branch's last reply before it), before the session is saved with its id."""
    name = check_session_turn(prompt, opts, bool(media or files)) if request is None else \
        validate_name(opts.session or "")
    store = store_for(env)
    store.clean_temporaries()
    with store.lock(name):
        before = None  # the session as it was, where its current branch was switched for this turn
        if request is not None and request.follows is not None and store.exists(name):
            before = onto(store, name, request.follows)
        named = NamedSession.open(store, name, request.own if request is not None else opts, env, host, sink.reading)
        kept = False
        try:
            sent = request.messages(named) if request is not None else None
            # (going on from a kept response, the same request again makes a new branch)
            again = retried(named.conversation.messages, sent) if sent is not None and request is not None \
                and request.follows is None else None
            if again is not None:  # (a client's retry of the turn just kept, whose answer it never had)
                turn = Turn(named.session, named.keeper, named.conversation, opts.tool_options, named=named)
                return turn.finished(Generation(again.content, finish_reason="stop", reasoning=again.reasoning or ""))
            own = request.take(named, opts, env) if request is not None else None
            turn, ask = _session_turn(named, prompt, opts, files, media, tools, hooks, sent)
            limit, stop = named.reply_limits(opts, env)
            if request is not None:  # (a request's own length and stop strings, where it gives them)
                limit = max_tokens(opts, env) if opts.max_tokens is not None else limit
                stop = stop_strings(opts, env) if opts.stop else stop
            recorded = with_logprobs(named.session, sink, request.logprobs if request is not None else None)
            try:
                answer = turn.answer(ask, limit, stop, recorded or sink)
            except ContextOverflow as exc:
                if named.session.used < exc.n_ctx // 2:
                    raise  # the prompt alone is too long
                raise ContextOverflow(exc.prompt_tokens, exc.n_ctx, at_least=exc.at_least, hint=(
                    f"session '{name}' is full; continue it with a larger --ctx, or free room with /trim "
                    f"in `quipu chat -S {name}`"
                )) from None
            if recorded is not None:
                recorded.finish(answer)
            if own is not None:
                own()
            if log is not None:
                from quipu.app.answer_log import follows, mark_logged

                messages = named.conversation.messages
                made, unlogged = log(answer, follows(messages))
                mark_logged(messages, made)
                named.tell([unlogged] if unlogged else [])
            if request is not None and request.whole_read:
                as_sent_back(named.conversation, answer)
            if request is None or request.took(answer):  # (a server's turn: kept once its client has it whole)
                named.save()
                kept = True
                if request is not None and request.kept is not None:
                    request.kept(answer, named.conversation.messages)
        finally:
            named.close()
            if before is not None and not kept:  # (a turn not kept leaves the session as it was, on disk too)
                from quipu.store.store import KEEP_STATE

                store.save(name, before, KEEP_STATE)
    return replace(answer, notices=list(named.notices))  # (the session's, its save's included)


def _session_turn(named: NamedSession, prompt: str | None, opts: TurnOptions, files: Sequence[Attachment],
                  media: Sequence[Attachment], tools: OpenTools | None = None,
                  hooks: ToolHooks | None = None, sent: Sequence[Message] | None = None) -> tuple[Turn, Ask]:
    """A session's turn, and what it asks: the results of its calls (--tool-result), its last
    reply continued (--continue), calls left waiting run (no prompt), the prompt with what is
    attached to it, or (`sent`, a server's request) the reply to the messages sent past the
    session's."""
    if sent is not None:
        conv = named.conversation
        new = going_on(conv.messages, sent, named.name)
        offer(conv, tools, opts.tool_options)
        conv.messages.extend(new)
        turn = Turn(named.session, named.keeper, conv, opts.tool_options, named=named, tools=tools)
        return turn, Ask("continue" if new[-1].role == "assistant" else "answer")
    marks = named.keeper.take_media(named.session, named.store, media) if media else ""
    if files or media:
        prompt = compose(named.conversation, prompt, files, marks)
    offer(named.conversation, tools, opts.tool_options)
    turn = Turn(named.session, named.keeper, named.conversation, opts.tool_options, named=named, tools=tools,
                hooks=hooks)
    if opts.tool_results:
        return turn, Ask("results")
    if opts.continue_reply:
        return turn, Ask("continue")
    return turn, Ask("send", prompt) if prompt else Ask("resume")


@dataclass
class SessionRequest:
    """A server's request as a turn of a named session: the options the session is opened with
    (`own`: the server's, which the session keeps), the messages the request sends (`sent`: the
    session's, then new ones), and the log probabilities it asks for. The request's own sampling
    options, schema and tools hold for its turn alone (`take`). The turn is a transaction: `took`
    hands its answer to the client and says whether the client took it whole; only then is it kept."""

    own: TurnOptions
    sent: Sequence[Message]
    logprobs: int | None = None
    took: Callable[[Answer], bool] = lambda answer: True
    # (a kept response's conversation it goes on from: `sent` holds the new messages alone)
    follows: Following | None = None
    kept: Callable[[Answer, Sequence[Message]], None] | None = None  # called once the turn is kept
    # Its prompt read on from where a step of a whole read starts, so that the answer is the one
    # the whole conversation read at once gives (as a server's other APIs answer it).
    whole_read: bool = False

    def messages(self, named: NamedSession) -> Sequence[Message]:
        """The messages the request sends: `sent`, or, going on from a kept response, its
        conversation (on the branch `onto` made current; its system prompt the request's own) and
        then `sent`. Where they part from the session's, the session's stay a branch and the new
        one goes on from where they part."""
        follows = self.follows
        if follows is None:
            return self.sent
        conv = named.conversation
        held = conv.messages
        if digest(held[:follows.at]) != follows.digest:
            raise SessionConflict(f"session '{named.name}' no longer holds the conversation this goes on from")
        rest = held[1:follows.at] if held and held[0].role == "system" else held[:follows.at]
        sent = ([Message("system", follows.system)] if follows.system else []) + list(rest) + list(self.sent)
        # (the same request again, a retry or a regeneration: its last message is said again, its
        # reply made anew beside the one kept)
        parts = min(common_prefix([said(m) for m in held], [said(m) for m in sent]), len(sent) - 1)
        if parts < len(held):
            named.stash()
            conv.back_to(parts)
        return sent

    def take(self, named: NamedSession, opts: TurnOptions, env: Environment) -> Callable[[], None]:
        """Gives the session the request's options for this turn; what sets its own back (before it is saved)."""
        from quipu.app.turn_options import sampling_params, with_logit_biases

        session, conv = named.session, named.conversation
        params, settings = session.params, conv.settings
        from quipu.sessions.inference import InferenceSession

        assert isinstance(session, InferenceSession)  # (a server's requests run on a local model)
        asked = with_logit_biases(sampling_params(opts, env, params), session.vocab, opts)
        if asked != params:
            session.set_params(asked)
        session.whole_read = self.whole_read
        if opts.think is not None:  # (the request's reasoning, for its turn)
            conv.update(variables={**conv.settings.variables, "enable_thinking": opts.think})
        conv.set_reasoning(effort=effort_of(opts, conv), budget=opts.reasoning_budget)

        def back() -> None:
            budget = settings.reasoning_budget if opts.reasoning_budget is not None else conv.settings.reasoning_budget
            conv.settings = settings.but(reasoning_budget=budget)  # (its variables as they were: effort, thinking)
            session.whole_read = False
            if session.params != params:
                session.set_params(params)
        return back


@dataclass(frozen=True)
class Following:
    """Where a request goes on from in its session: the first `at` messages of one of its
    branches, whose `digest` (`digest`) was kept with a response; `system`, the request's own
    system prompt in place of theirs (none: none)."""

    at: int
    digest: str
    system: str | None = None


def said(m: Message) -> tuple[str, str, list[tuple[str, str]]]:
    """What a message says, as a client sends it back: its role, text and calls (its reasoning,
    which clients leave out, aside)."""
    return m.role, m.content.strip(), [(c["function"]["name"], c["function"]["arguments"]) for c in m.tool_calls or ()]


def digest(messages: Sequence[Message]) -> str:
    """The digest of what `messages` say (`said`), by which a kept response finds its conversation."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps([said(m) for m in messages], ensure_ascii=False).encode()).hexdigest()


def as_sent_back(conv: Conversation, answer: Answer) -> None:
    """The reply a turn ends with, where it calls the client's tools, kept as the client sends it
    back (its text besides the calls, and the calls), not as the model wrote it: the next turn's
    prompt is then laid out as the whole conversation sent at once is (a Responses chain answers
    as the same conversation sent whole does)."""
    last = conv.messages[-1] if conv.messages else None
    if last is not None and last.role == "assistant" and last.tool_calls:
        conv.messages[-1] = replace(last, content=answer.text, spelled=None)


def onto(store: SessionStore, name: str, follows: Following) -> Transcript | None:
    """Makes current the branch of session `name` whose first `follows.at` messages are those a
    kept response ended (the session locked); SessionConflict where no branch holds them. The
    session as it was, where it made another branch current."""
    from quipu.store.branches import current_branch, other_branches, switched
    from quipu.store.store import KEEP_STATE

    record = store.load_transcript(name)

    def holds(messages: list[dict[str, Any]]) -> bool:
        return len(messages) >= follows.at and \
            digest([Message.from_dict(m) for m in messages[:follows.at]]) == follows.digest

    if holds(record.messages):
        return None
    other = next((b for b in other_branches(record) if holds(b.messages)), None)
    if other is None or current_branch(record).id == other.id:
        raise SessionConflict(f"session '{name}' no longer holds the conversation this goes on from")
    store.save(name, switched(record, other.id), KEEP_STATE)
    return record

class SessionConflict(UsageError):
    """A request whose messages do not go on from its session's."""


def retried(held: Sequence[Message], sent: Sequence[Message]) -> Message | None:
    """The session's last reply, where a request sends the session's messages but that reply
    (a client's retry of a turn that was kept, but whose answer it never had); else None."""
    if len(held) < 2 or len(sent) != len(held) - 1 or held[-1].role != "assistant" or held[-1].tool_calls:
        return None
    try:
        going_on(held[:-1], [*sent, held[-1]], "")
    except SessionConflict:
        return None
    return held[-1]


def going_on(held: Sequence[Message], sent: Sequence[Message], name: str) -> list[Message]:
    """The messages a request sends past session `name`'s (`held`), which it must begin with:
    the same roles, texts and calls (a reply's reasoning, which clients leave out, aside)."""
    for i, (mine, theirs) in enumerate(zip(held, sent, strict=False)):
        if said(mine) != said(theirs):
            raise SessionConflict(f"messages[{i}] differs from message {i} of session '{name}' ({mine.role}: "
                                  f"{mine.content[:60]!r}): send the session's messages as they are, then the new "
                                  "ones")
    if len(sent) <= len(held):
        raise SessionConflict(f"the messages hold nothing past the {len(held)} of session '{name}': send the new "
                              "message after them")
    return list(sent[len(held):])


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
    generating or saving anything: its turn, stopped before the model runs."""
    opts, history = _followed(opts, env)
    with closing(open_host(opts.server)) as host:
        check_options(asked_of(opts.given, own=("show",)), mode_of(opts.given), host.capabilities)
        files, media = attached(opts, host.capabilities)
        if opts.session is not None:
            return _show_session_prompt(prompt, opts, env, host, files, media)
        if not prompt and not opts.messages and not media and not files:
            raise BadInput("no prompt: give one as an argument or on standard input")
        # (the tools are part of the context their definitions are written into)
        tools = open_tools(opts.tool_options, env, constrained=opts.constrained)
        try:
            turn, ask = _one_shot_turn(prompt, opts, env, host, files, media,
                                       history.messages if history is not None else [], tools)
            try:
                return turn.shown(ask)
            finally:
                turn.session.close()
        finally:
            if tools is not None:
                tools.close()


def _show_session_prompt(prompt: str | None, opts: TurnOptions, env: Environment, host: ModelHost,
                         files: Sequence[Attachment] = (), media: Sequence[Attachment] = ()) -> PromptView:
    name = check_session_turn(prompt, opts, bool(media or files))
    store = store_for(env)
    with store.lock(name):
        named = NamedSession.open(store, name, opts, env, host)
        try:
            turn, ask = _session_turn(named, prompt, opts, files, media)
            return turn.shown(ask if ask.kind in ("send", "continue") else Ask("send"))
        finally:
            named.close()
