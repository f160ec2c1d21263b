"""Tools a model may call, and the loop that runs them: Python functions from the user's own
file (`--functions FILE.py`), definitions the caller runs itself (`--tools FILE.json`), both
read by `tool_files.py`, and, in `mcp.py`, MCP servers. A call runs only once approved; its
result goes back to the model, which goes on until it answers in text or the chain's limit is
reached. Approvals are never saved."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence

from quipu.app.attachments import Attachment
from quipu.app.user_files import read_text_file
from quipu.app.tool_files import check_tool_schemas, tools_from_json, tools_in_messages
from quipu.app.turn_options import ToolOptions
from quipu.app.tooldefs import DEFAULT_TIMEOUT, Tool, ToolFailure, check_tool_name, never
from quipu.engine.base import defuse
from quipu.errors import Interrupted, QuipuError, UsageError
from quipu.sessions.base import SILENT, Generation, ReplySink
from quipu.sessions.conversation import Conversation
from quipu.sessions.toolspec import ToolCall as ToolCall  # (what the CLI's hooks are given)
from quipu.sessions.toolspec import ToolSpec

if TYPE_CHECKING:
    from quipu.app.environment import Environment

DEFAULT_CHAIN_LIMIT = 5
DEFAULT_OUTPUT_MAX = 8000  # characters of a tool's result the model is given
REPEATS = 3  # the same call with the same arguments this many times stops the loop


@dataclass(frozen=True)
class CallRecord:
    """One call of a loop, as `--json` reports it: the result as the model was given it, the
    whole result's size, what the call printed."""

    id: str | None
    name: str
    arguments: dict[str, Any]
    result: str | None = None
    error: str | None = None
    time_s: float = 0.0
    size: int | None = None  # characters of the whole result
    stdout: str = ""
    media: tuple[tuple[str, bytes], ...] = ()  # the result's images and recordings (`ToolOutput.media`)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "name": self.name, "arguments": self.arguments}
        out["error" if self.error is not None else "result"] = self.error if self.error is not None else self.result
        if self.size is not None:
            out["result_chars"] = self.size
        if self.stdout:
            out["stdout"] = self.stdout
        out["time_s"] = round(self.time_s, 4)
        return out


class Toolbox:
    """The tools of a turn, by name (`tools`: those it starts with); two added with one name is
    a usage error."""

    def __init__(self, tools: Mapping[str, Tool] | None = None) -> None:
        self.tools: dict[str, Tool] = dict(tools or {})

    def add(self, tools: Sequence[Tool]) -> None:
        for tool in tools:
            check_tool_name(tool.spec.name, tool.source)
            if tool.spec.name in self.tools:
                raise UsageError(f"two tools are named {tool.spec.name!r}: in {self.tools[tool.spec.name].source} "
                                 f"and in {tool.source}")
            self.tools[tool.spec.name] = tool

    @property
    def specs(self) -> list[ToolSpec]:
        return [t.spec for t in self.tools.values()]

    def __bool__(self) -> bool:
        return bool(self.tools)


# ---- the loop ------------------------------------------------------------------------------------

Approve = Callable[[ToolCall], bool]


@dataclass(frozen=True)
class LoopResult:
    generation: Generation  # the last reply
    calls: list[CallRecord] = field(default_factory=list)  # every call made
    notices: list[str] = field(default_factory=list)
    pending: list[ToolCall] = field(default_factory=list)  # calls left for the caller to run

    @classmethod
    def stopped_at(cls, gen: Generation, made: list[CallRecord], calls: Sequence[ToolCall],
                   notice: str | None = None) -> "LoopResult":
        """The loop ends before `calls`, which `gen` asked for, run: they wait (for the caller, or
        the next run)."""
        return cls(replace(gen, finish_reason="tool_calls"), made, [notice] if notice is not None else [], list(calls))


def run_call(tool: Tool, call: ToolCall, output_max: int = DEFAULT_OUTPUT_MAX,
             stopped: Callable[[], bool] = never) -> CallRecord:
    """Runs one call (within its tool's timeout, which the runner keeps); an error is the result
    the model is given. The result is kept as the model is given it (cut at `output_max`)."""
    assert tool.run is not None
    started = time.perf_counter()
    try:
        out = tool.run(call.arguments, tool.timeout, stopped)
    except ToolFailure as exc:
        return CallRecord(call.id, call.name, call.arguments, error=cut(str(exc), output_max),
                          time_s=time.perf_counter() - started, stdout=exc.stdout)
    return CallRecord(call.id, call.name, call.arguments, cut(out.text, output_max, out.size),
                      time_s=time.perf_counter() - started, size=out.size, stdout=out.stdout, media=out.media)


def cut(text: str, limit: int, size: int | None = None) -> str:
    """`text` as the model is given it: its first `limit` characters, and what was left out."""
    size = len(text) if size is None else size
    if size <= limit and len(text) <= limit:
        return text
    return text[:limit] + f"\n[cut: the result was {size:,} characters; the first {limit:,} are above]"


def tool_loop(conv: Conversation, box: Toolbox, gen: Generation, *, approve: Approve, max_tokens: int,
              stop: Sequence[str] = (), sink: ReplySink = SILENT, chain_limit: int = DEFAULT_CHAIN_LIMIT,
              output_max: int = DEFAULT_OUTPUT_MAX, on_call: Callable[[CallRecord], None] | None = None,
              on_start: Callable[[ToolCall], None] | None = None, take_media: TakeMedia | None = None) -> LoopResult:
    """From a reply that made calls: run each (once approved), give the results back, and let
    the model go on, until it answers in text, a call is the caller's to run, or the chain's
    limit. Returns the last reply and every call made. `take_media` makes a result's images
    ready for a model that can see them (their markers); without it, or where it refuses, the
    model reads the result's note of each."""
    made: list[CallRecord] = []
    seen: dict[str, int] = {}
    rounds = 0
    while gen.tool_calls and gen.finish_reason == "stop":
        calls = gen.tool_calls
        unknown = [c for c in calls if c.name not in box.tools]
        theirs = [c for c in calls if c.name in box.tools and box.tools[c.name].run is None]
        if theirs:
            return LoopResult.stopped_at(gen, made, calls)
        if rounds >= chain_limit:
            return LoopResult.stopped_at(gen, made, calls, f"the model asked for more tools after {chain_limit} "
                                                           "rounds (--chain-limit); stopped there")
        # A call asked for again, round after round, with the same arguments: the loop stops
        # before the round runs (calls repeated within one reply count once).
        keys = {json.dumps([c.name, c.arguments], sort_keys=True, default=str): c.name for c in calls}
        for key in keys:
            seen[key] = seen.get(key, 0) + 1
        looping = [name for key, name in keys.items() if seen[key] >= REPEATS]
        if looping:
            return LoopResult.stopped_at(gen, made, calls, f"the model called {looping[0]} with the same arguments "
                                                           f"{REPEATS} times; the loop stopped")
        # Every call of the round is approved (or not) before any runs: a loop stopped at an
        # approval (Interrupted) has run nothing of its round, and resumes from its calls.
        try:
            approved = [call not in unknown and approve(call) for call in calls]
        except Interrupted:
            return LoopResult.stopped_at(gen, made, calls, "stopped before the calls ran; the session goes on from "
                                                           "them when it is next run with its tools (-S NAME and "
                                                           "--functions, --mcp)")
        answers: list[tuple[ToolCall, str]] = []
        records: list[CallRecord] = []
        for call, ok in zip(calls, approved, strict=True):
            if on_start is not None:
                on_start(call)
            if call in unknown:
                record = CallRecord(call.id, call.name, call.arguments, error=f"there is no tool named {call.name}")
            elif not ok:
                record = CallRecord(call.id, call.name, call.arguments, error="the user did not approve this call")
            else:
                try:
                    record = run_call(box.tools[call.name], call, output_max, sink.stopped)
                except Interrupted:
                    # (as at an approval: the round's results are not kept, its calls wait to run)
                    return LoopResult.stopped_at(gen, made, calls, f"stopped during the call of {call.name}; the "
                                                                   "session goes on from the calls when it is next "
                                                                   "run with its tools")
            records.append(record)
            if on_call is not None:
                on_call(record)
            text = defuse((record.result or "") if record.error is None else f"error: {record.error}")  # (never a marker)
            if record.media and take_media is not None and text:
                text = with_media(text, record, take_media)
            answers.append((call, text or ""))
        made += records
        conv.add_tool_results(answers)
        # (a call asked for, required or a tool's by name, is the first reply's only: the replies
        # that follow the results may call as they choose)
        follow = conv.settings if conv.settings.tool_choice == "none" else conv.settings.but(tool_choice="auto")
        gen = conv.reply_to_tools(max_tokens=max_tokens, stop=stop, sink=sink, turn=follow)
        rounds += 1
    return LoopResult(gen, made)


# What makes a tool result's media ready in the context: their markers (a UsageError where the
# model cannot take them).
TakeMedia = Callable[[list[Attachment]], str]


def with_media(text: str, record: CallRecord, take_media: TakeMedia) -> str:
    """A result's text with its media in it, each where its note was, for a model that takes
    them; the notes stay where it does not (or the media are not what they claimed)."""
    from quipu.app.attachments import attachment_of

    try:
        media = [attachment_of(f"{record.name} result", data) for _, data in record.media]
        marks = [take_media([m]) for m in media]
    except QuipuError:  # (a model without a projector, or one that does not load: it reads the notes)
        return text
    for (note, _), mark in zip(record.media, marks, strict=True):
        text = text.replace(note, mark, 1)
    return text


def parse_tool_results(given: Sequence[str]) -> list[tuple[str, str]]:
    """--tool-result ID=TEXT or ID=@FILE, each as (id, text)."""
    out = []
    for item in given:
        ident, sep, value = item.partition("=")
        if not sep or not ident:
            raise UsageError(f"--tool-result takes ID=TEXT or ID=@FILE, not {item!r}")
        if value.startswith("@"):
            value = read_text_file(value[1:], "tool result", allow_empty=True)
        out.append((ident, value))
    return out


def pending_calls(conv: Conversation) -> list[ToolCall]:
    """The calls of the conversation's last reply that have no result yet."""
    answered = set()
    for message in reversed(conv.messages):
        if message.role == "tool":
            answered.add(message.tool_call_id)
            continue
        if message.role == "assistant" and message.tool_calls:
            return [ToolCall(c["function"]["name"], c["function"]["arguments"], c.get("id"))
                    for c in message.tool_calls if c.get("id") not in answered]
        break
    return []


# ---- a turn with tools -------------------------------------------------------------------------

@dataclass
class ToolHooks:
    """What the front end does in a loop: asks to approve a call (None: refused unless --yes),
    hears of each call as it starts and ends, and shows what the user's functions write on
    stderr, a line at a time."""

    approve: Approve | None = None
    on_start: Callable[[ToolCall], None] | None = None
    on_call: Callable[[CallRecord], None] | None = None
    on_output: Callable[[str], None] | None = None


class ToolProcess(Protocol):
    """A process that runs tools: what went wrong with it, to be said; and its end."""

    def said(self) -> list[str]:
        """What went wrong with it since last asked."""

    def close(self) -> None: ...


@dataclass
class OpenTools:
    """A command's tools (`box`, by name), and the processes that run them, open until `close`."""

    box: Toolbox
    notices: list[str] = field(default_factory=list)
    # what runs the tools until `close`: the functions files' process, MCP servers
    processes: list[ToolProcess] = field(default_factory=list)

    def close(self) -> None:
        for process in self.processes:
            process.close()
        self.processes = []

    def said(self) -> list[str]:
        """What went wrong with the processes since last asked (a functions process that died)."""
        return [notice for process in self.processes for notice in process.said()]


def open_tools(opts: ToolOptions, env: Environment | None = None, *, constrained: bool = False, stopped: Callable[[], bool] = never,
               on_output: Callable[[str], None] | None = None) -> OpenTools | None:
    """The tools the options give (None when they give none), each checked; the functions files'
    process and MCP servers are started (close the result to stop them). `constrained`: the
    turn's replies keep to a schema or grammar (which tools cannot go with); `stopped` is asked
    while a process is waited for (Ctrl-C, SIGTERM); `on_output` gets each line the user's
    functions write on stderr."""
    offered = tools_in_messages(opts.messages) if opts.messages else []
    if not opts.functions and not opts.tools_file and not opts.mcp and not offered:
        if opts.mcp_config:
            raise UsageError("--mcp-config names where servers are defined; pick them with --mcp NAME")
        return None
    if constrained:
        raise UsageError("give tools or --schema/--grammar/--regex, not both: a call is held to the tools' own schemas")
    for name, value in (("--chain-limit", opts.chain_limit), ("--tool-output-max", opts.tool_output_max),
                        ("--tool-timeout", opts.tool_timeout)):
        if value is not None and not value > 0:
            raise UsageError(f"{name} must be more than 0, got {value}")
    timeout = opts.tool_timeout or DEFAULT_TIMEOUT
    box, notices = Toolbox(), []
    processes: list[ToolProcess] = []
    try:
        if opts.tools_file:
            box.add(tools_from_json(opts.tools_file))
        box.add(offered)
        if opts.functions:
            from quipu.app.functions import functions_from_files

            made, said, worker = functions_from_files(list(opts.functions), timeout, stopped, on_output)
            processes.append(worker)
            box.add(made)
            notices += said
        check_tool_schemas(box.tools.values())  # (before any server is started)
        if opts.mcp:
            from quipu.app.mcp import start_servers

            servers = start_servers(opts.mcp, env.config.mcp if env is not None else {}, opts.mcp_config, stopped)
            processes += servers
            for server in servers:
                box.add(server.tools)
                check_tool_schemas(server.tools)
    except BaseException:
        OpenTools(box, notices, processes).close()
        raise
    if opts.tool_timeout is not None:  # (every tool's, a server's own included)
        box = Toolbox({name: dataclasses.replace(tool, timeout=opts.tool_timeout) for name, tool in box.tools.items()})
    return OpenTools(box, notices, processes)


def offer(conv: Conversation, tools: OpenTools | None, opts: ToolOptions) -> None:
    """Tells the conversation of the tools (those given now replace a session's own)."""
    if tools is not None:
        conv.update(tools=tools.box.specs)
        if conv.template is not None and conv.tool_format.generic:
            tools.notices.append("this model's chat template has no tool-call format quipu knows; the model is "
                                 'asked to call tools as {"tool_call": {"name", "arguments"}} JSON (the generic '
                                 "format), which it may not follow")
    if opts.tool_choice is not None:
        choice = opts.tool_choice
        if choice not in ("auto", "required", "none") and choice not in {t.name for t in conv.settings.tools}:
            raise UsageError(f"--tool-choice is auto, required, none or a tool's name, not {choice!r}")
        conv.update(tool_choice=choice)


def answer_pending(conv: Conversation, opts: ToolOptions, limit: int, stop: Sequence[str], sink: ReplySink) -> Generation:
    """--tool-result: the results of the last reply's calls, then the model's next reply."""
    pending = {c.id: c for c in pending_calls(conv)}
    if not pending:
        raise UsageError("the session's last reply made no call that waits for a result")
    given = parse_tool_results(opts.tool_results)
    answers = []
    seen: set[str] = set()
    for ident, text in given:
        if ident in seen:
            raise UsageError(f"--tool-result gives {ident!r} twice; give one result for each call")
        seen.add(ident)
        if ident not in pending:
            raise UsageError(f"--tool-result names {ident!r}, which the last reply did not call "
                             f"(it called: {', '.join(sorted(str(k) for k in pending))})")
        answers.append((pending.pop(ident), defuse(text)))
    if pending:
        raise UsageError(f"give a --tool-result for each call: {', '.join(sorted(str(k) for k in pending))} has none")
    conv.add_tool_results(answers)
    return conv.reply_to_tools(max_tokens=limit, stop=stop, sink=sink)


def follow_calls(conv: Conversation, tools: OpenTools | None, gen: Generation, opts: ToolOptions, limit: int,
                 stop: Sequence[str], sink: ReplySink, hooks: ToolHooks | None,
                 take_media: TakeMedia | None = None) -> tuple[Generation, list[CallRecord], list[str]]:
    """Runs the loop from a reply that made calls; (the last reply, the calls, notices)."""
    notices = list(tools.notices) if tools is not None else []
    if not gen.tool_calls:
        return gen, [], notices
    given = dict(tools.box.tools) if tools is not None else {}
    for spec in conv.settings.tools:  # a session's tools that nothing runs now: the caller's to run
        given.setdefault(spec.name, Tool(spec, None, "the session"))
    box = Toolbox(given)  # (the turn's own: the tools given stay as they were for the next turn)
    hooks = hooks or ToolHooks()
    refused: list[str] = []

    def approve(call: ToolCall) -> bool:
        if opts.yes:
            return True
        if hooks.approve is not None:
            return hooks.approve(call)
        refused.append(call.name)
        return False

    loop = tool_loop(conv, box, gen, approve=approve, max_tokens=limit, stop=stop, sink=sink,
                     chain_limit=opts.chain_limit or DEFAULT_CHAIN_LIMIT,
                     output_max=opts.tool_output_max or DEFAULT_OUTPUT_MAX, on_call=hooks.on_call,
                     on_start=hooks.on_start, take_media=take_media)
    if refused:
        notices.append(f"refused {', '.join(sorted(set(refused)))}: no terminal to ask and no --yes; the model "
                       "was told")
    records = loop.calls + [CallRecord(c.id, c.name, c.arguments) for c in loop.pending]
    return loop.generation, records, notices + loop.notices + (tools.said() if tools is not None else [])


SKIPPED = "The call was not run: the user went on without it."


def skip_pending(conv: Conversation) -> int:
    """A new message while calls wait (a loop stopped at its approval): each gets a result that
    says it was not run, so that the conversation goes on as the templates expect (every call
    answered). Returns how many."""
    pending = pending_calls(conv)
    conv.add_tool_results([(call, SKIPPED) for call in pending])
    return len(pending)


def waiting_notice(conv: Conversation, how: str) -> str | None:
    """What a front end says of calls left waiting in a session (None: none wait)."""
    pending = pending_calls(conv)
    if not pending:
        return None
    names = ", ".join(dict.fromkeys(call.name for call in pending))
    return f"{len(pending)} call{'s' if len(pending) > 1 else ''} of the last reply wait to run ({names}): {how}"


def resume_pending(conv: Conversation) -> Generation | None:
    """The session's last reply as a reply that made calls, when they wait for results (a loop
    that stopped at an approval, or a crash): the loop goes on from them. None when none wait."""
    pending = pending_calls(conv)
    if not pending or any(m.role == "tool" for m in conv.messages[-1:]):
        return None
    return Generation(conv.messages[-1].content, [], "stop", tool_calls=pending)
