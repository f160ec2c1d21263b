"""One turn, from its plan to its answer, written once (`Turn`): the context it reads (what
`--show-prompt` shows and the prompt cache is asked for), its reply and the calls the reply
makes, and its answer (`answer.Answer`), with the notices gathered where they arise. A one-shot
run, a session's turn and a chat's go through `Turn.answer`; `--show-prompt` through
`Turn.shown`, a turn that stops before the model runs; a batch's row through `Turn.tokens` (its
prompt: the rows then decode side by side) and `Turn.finished` (its answer). What a turn asks is
an `Ask`; the message it sends, with what is attached to it, is `compose`'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Sequence

from quipu.app.answer import Answer
from quipu.app.tools import OpenTools, ToolHooks, answer_pending, follow_calls, resume_pending, skip_pending
from quipu.engine.base import MEDIA_MARK, defuse
from quipu.errors import BadInput
from quipu.sessions.base import SILENT, Generation, ModelSession, ReplySink, Stats, TokenSession, token_session
from quipu.sessions.conversation import Conversation

if TYPE_CHECKING:
    from quipu.app.attachments import Attachment
    from quipu.app.hosts import Keeper
    from quipu.app.named import NamedSession
    from quipu.app.prompt_cache import CacheUse
    from quipu.app.turn_options import ToolOptions
    from quipu.sessions.params import SamplingParams
    from quipu.store.store import SessionStore


@dataclass(frozen=True)
class Ask:
    """What a turn asks: a new user message (`send`, its `text`), the last reply continued
    (`continue`), the reply to the conversation as it stands (`answer`: its last message a
    user's or a tool's), the last reply again (`retry`), the replies to the last reply's calls
    whose results are given (`results`), calls left waiting run (`resume`), or a plain
    completion of `text`, without the template (`raw`)."""

    kind: Literal["send", "continue", "answer", "retry", "results", "resume", "raw"]
    text: str = ""
    tokens: Sequence[int] = ()  # a plain completion given as tokens (`raw`, with no text)


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


class Turn:
    """One turn on an open conversation (`conv`; None for a plain completion) of `session`,
    whose host's keeper is `keeper`: in a named session (`named`) or a one-shot's. `tools` are
    the command's (offered to the conversation already: `tools.offer`), `hooks` the front end's
    (the calls' approval and display); `notices` start the turn's own (what opening the
    session said)."""

    def __init__(self, session: ModelSession, keeper: Keeper[Any], conv: Conversation | None, tool_options: ToolOptions,
                 *, named: NamedSession | None = None, tools: OpenTools | None = None, hooks: ToolHooks | None = None,
                 notices: Sequence[str] = ()):
        self.session, self.keeper, self.conv, self.named = session, keeper, conv, named
        self.tool_options, self.tools, self.hooks = tool_options, tools, hooks
        self.notices = list(notices)
        self._cached: CacheUse | None = None

    @property
    def store(self) -> SessionStore | None:
        return self.named.store if self.named is not None else None

    def _conv(self) -> Conversation:
        assert self.conv is not None, "a plain completion has no conversation"
        return self.conv

    def tokens(self, ask: Ask) -> list[int]:
        """The context the turn reads for `ask` (its prompt), without reading it."""
        if ask.kind == "raw":
            return list(ask.tokens) if ask.tokens else token_session(self.session, "raw").raw_tokens(ask.text)
        conv = self._conv()
        if ask.kind == "send":
            return conv.tokens_with(ask.text)
        if ask.kind == "continue":
            return conv.continued_tokens()
        return conv.context_tokens()

    def shown(self, ask: Ask) -> PromptView:
        """`--show-prompt`: the context the turn would read, and how much of it need not be read
        (a session's context, or, for a one-shot, the prompt cache)."""
        held = token_session(self.session, "show_prompt")
        tokens = self.tokens(ask)
        if self.named is not None:
            return PromptView.of(held, tokens, held.reused(tokens), self.named.model_name, self.named.name)
        return PromptView.of(held, tokens, self.keeper.cached(self.session, tokens), self.keeper.model_name, None)

    def answer(self, ask: Ask, limit: int, stop: Sequence[str], sink: ReplySink = SILENT) -> Answer:
        """Runs the turn: the reply into `sink`, then the calls it makes; the answer (saving,
        logging and the prompt cache are the caller's: `remember`)."""
        if self.named is None and ask.kind != "resume":  # a new context: the prompt cache is asked first
            self._cached = self.keeper.warm(self.session, lambda: self.tokens(ask))
        gen = self._reply(ask, limit, stop, sink)
        if self.conv is None:
            return self.finished(gen)
        named = self.named
        gen, calls, notes = follow_calls(self.conv, self.tools, gen, self.tool_options, limit, stop, sink, self.hooks,
                                         lambda found: self.keeper.take_media(self.session, self.store, found))
        if named is not None:
            named.tell(notes)
            named.note_template()  # (said once a session)
        else:
            self.notices += self._template_notices() + notes
        return self.finished(gen, calls)

    def _reply(self, ask: Ask, limit: int, stop: Sequence[str], sink: ReplySink) -> Generation:
        if ask.kind == "raw":
            return token_session(self.session, "raw").complete(self.tokens(ask), limit, stop, sink)
        conv = self._conv()
        if ask.kind == "results":
            return answer_pending(conv, self.tool_options, limit, stop, sink)
        if ask.kind == "resume":
            resumed = resume_pending(conv)  # a loop that stopped before its calls ran goes on
            if resumed is None:
                which = f"session '{self.named.name}'" if self.named is not None else "the conversation"
                raise BadInput(f"no prompt: give one as an argument or on standard input ({which} has no calls "
                               "waiting to run)")
            return resumed
        if ask.kind == "continue":
            return resume_pending(conv) or conv.continue_reply(max_tokens=limit, stop=stop, sink=sink)
        if ask.kind == "retry":
            return conv.retry(max_tokens=limit, stop=stop, sink=sink)
        if ask.kind == "answer":
            return conv.answer(max_tokens=limit, stop=stop, sink=sink)
        skip_pending(conv)  # (calls left waiting are answered "not run")
        if self.named is not None:
            self.named.warm(ask.text)
        return conv.send(ask.text, max_tokens=limit, stop=stop, sink=sink)

    def _template_notices(self) -> list[str]:
        from quipu.app.named import FOLD_NOTICE, NO_TEMPLATE_NOTICE

        conv = self._conv()
        return ([NO_TEMPLATE_NOTICE] if conv.without_template else []) + ([FOLD_NOTICE] if conv.folds_system else [])

    def finished(self, gen: Generation, calls: Sequence[Any] = (), *, params: SamplingParams | None = None,
                 stats: Stats | None = None) -> Answer:
        """The answer `gen` is, with the turn's notices (a named session's are its own); `params`
        and `stats`, a batch row's own (its reply decoded beside others', not on `session`)."""
        session, named = self.session, self.named
        system = self.conv.system if self.conv is not None else None
        return Answer.of(gen, self.keeper.model_name, params or session.params, stats or session.stats,
                         session.capabilities,
                         session=named.name if named is not None else None,
                         notices=named.notices if named is not None else self.notices,
                         fingerprint=self.keeper.model_fingerprint, system=system, tool_calls=calls)

    def remember(self, answer: Answer) -> Answer:
        """A one-shot's answer once it is out: the prompt's state joins the prompt cache."""
        if self.named is not None:
            return answer
        answer.notices += self.keeper.remember(self.session, self._cached)
        answer.cache_written = self._cached.written if self._cached is not None else 0
        return answer
