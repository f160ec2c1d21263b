"""`quipu run`: one prompt, one reply, streamed; clean enough for pipelines."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any, Callable

from quipu.cli import spec
from quipu.cli.terminal import Dim, StopOnCtrlC, Terminal, gather_prompt
from quipu.errors import BadInput, ExitCode, Interrupted, UsageError
from quipu.shown import shown

if TYPE_CHECKING:
    import typer

    from quipu.app.environment import Environment
    from quipu.app.tools import CallRecord, ToolCall, ToolHooks
    from quipu.app.turn_options import TurnOptions
    from quipu.app.answer import Answer

HELP = "Answer one prompt, given as an argument and/or on standard input."

# The parameters of `quipu run`, in order: Typer builds the command from this table, and
# `spec.parse` reads a plain command line from it without Typer.
PARAMS = spec.params("prompt", "role", "attach", "mmproj", *spec.GENERATION, "raw", "session", "branch", *spec.LOGGING,
                     "continue_reply", *spec.SHAPING, *spec.TOOLS, "messages", "tools_debug", "quiet", "no_cache",
                     "show", "as_json", "stats", "verbose", "url", "batch", "parallel")


def register(app: typer.Typer) -> None:
    from quipu.cli.options import command

    app.command("run", help=HELP, no_args_is_help=False)(command(PARAMS, run))


def plain(args: list[str]) -> Callable[[], int] | None:
    """`quipu run` without Typer, for a plain command line (`spec.parse` reads it), or None
    when Typer must read it."""
    given = spec.parse(PARAMS, args)
    if given is None:
        return None

    def run_plain() -> int:
        from quipu.app.environment import Environment

        return run(Environment.load(), **given)

    return run_plain


# The parameters of `run` that are the command's own, not options of the turn.
OWN = ("prompt", "show", "as_json", "stats", "batch", "parallel", "tools_debug", "quiet")


def run(env: Environment, **given: Any) -> int:
    from quipu.app.turns import run_turn

    prompt, show, as_json, stats, batch, parallel, tools_debug, quiet = (given[k] for k in OWN)
    term = Terminal.detect()
    if batch is None and parallel is not None:
        raise UsageError("--parallel goes with --batch")
    from quipu.app.modes import BATCH

    opts, role = spec.turn_options_of_role(given, env, BATCH if batch is not None else None)
    for warning in env.config.warnings + spec.habits(given):  # (a config others can read holds a token; -t 8)
        Terminal.detect().warn(warning)
    if opts.verbose:
        from quipu.cli.boundary import library_logs

        library_logs(sys.stderr)
    prompted = role is not None and role.prompt is not None
    if prompt is None and batch is None and term.stdin_tty and term.stdout_tty and not prompted \
            and not empty_allowed(opts):
        return as_chat(env, given, term)  # (`ollama run MODEL`'s habit: no prompt on a terminal is a chat)
    text = gather_prompt(prompt, term, allow_empty=empty_allowed(opts) or prompted) if batch is None else None
    if role is not None and batch is None:
        text = role.fill(text)
    if batch is not None:
        from quipu.cli.batch import run_batch_file

        from quipu.app.modes import asked_of, check_options

        if prompt is not None:
            raise UsageError("--batch reads its prompts from the file; give no prompt")
        own = [name for name, given in (("show", show), ("stats", stats), ("quiet", quiet), ("tools_debug", tools_debug))
               if given]
        check_options(asked_of(opts.given, own), BATCH)
        def filled(text: str) -> str:  # (each row's prompt as the role's prompt holds it)
            return (role.fill(text) if role is not None else None) or text

        return run_batch_file(batch, opts, env, term, parallel, filled)
    if opts.server is None:
        from quipu.cli.pull import pull_if_needed

        pull_if_needed(env, opts.model, term)
    if show:
        return show_prompt(text, opts, env, term, as_json)
    from quipu.cli.stream import TerminalStream

    with StopOnCtrlC() as stopper:
        sink = TerminalStream(term, as_json, quiet, stopper, threads=opts.threads)
        try:
            result = run_turn(text, opts, env, sink, on_result=sink.finish,
                              hooks=tool_hooks(term, as_json or quiet, tools_debug, stopper))
        except BaseException:
            sink.end_line()  # what was streamed ends its line before the error is said
            raise
        finally:
            sink.progress_bar.close()
    for notice in result.notices:
        term.warn(notice)
    if result.incomplete:
        term.warn("the reply was cut by --max-tokens, so it is incomplete and will not parse; raise -n"
                  if result.finish_reason == "length" else
                  "the reply was cut by a full context, so it is incomplete and will not parse")
    if stats:
        term.err(stats_line(result) + "\n")
    interrupted = result.finish_reason == "interrupted" or stopper.requested
    return ExitCode.INTERRUPTED if interrupted else ExitCode.OK


def as_chat(env: Environment, given: dict[str, Any], term: Terminal) -> int:
    """`quipu run` with no prompt, on a terminal: the chat, with the options a chat takes; one it
    does not take is refused as the prompt's absence was before."""
    from quipu.cli import chat

    theirs = {name: given.get(name, spec.OPTS[name].default) for name in chat.PARAMS}
    alone = [spec.OPTS[name].decls[0].split("/")[0] for name, value in given.items()
             if name not in chat.PARAMS and name != "prompt" and value not in (None, False, [], ())]
    if alone:
        raise BadInput(f"no prompt: give one as an argument or pipe it on standard input (without one, on a "
                       f"terminal, run opens a chat, which takes no {', '.join(alone)})")
    term.err("no prompt: a chat opens (Ctrl-D leaves it; `quipu run \"...\"` answers once)\n")
    return chat.chat(env, **theirs)


def empty_allowed(opts: TurnOptions) -> bool:
    """Whether a run may have no prompt: it goes on from a reply, a tool's result, a messages file,
    or a session's calls that wait to run."""
    return bool(opts.continue_reply or opts.tool_results or opts.messages or opts.attach
                or (opts.session and (opts.functions or opts.mcp or opts.tools_file)))


def tool_hooks(term: Terminal, unshown: bool, debug: bool, stopper: StopOnCtrlC) -> ToolHooks:
    """How `run` shows calls (stderr: `name(arguments)` and the result shortened, dimmed on a
    terminal; raw with --tools-debug; none when `unshown`: --json or --quiet) and asks to
    approve them (on a terminal: yes, no, or always for that tool)."""
    from quipu.app.tools import ToolHooks

    always: set[str] = set()

    def approve(call: ToolCall) -> bool:
        if call.name in always:
            return True
        term.err(f"run {call.spelled}? [y]es, [n]o, [a]lways for {call.name}, [s]top here: ")
        try:
            answer = input().strip().lower()
        except EOFError:
            answer = ""
        except KeyboardInterrupt:
            answer = "s"
        if answer in ("s", "stop") or stopper.requested:
            raise Interrupted("stopped at the approval of a call")
        if answer in ("a", "always"):
            always.add(call.name)
        return answer in ("y", "yes", "a", "always")

    def on_start(call: ToolCall) -> None:
        if debug:
            term.err(json.dumps({"call": call.name, "id": call.id, "arguments": call.arguments},
                                ensure_ascii=False) + "\n")
        elif not unshown:
            term.err(Dim(f"→ {shown(call.spelled)}"), "\n")  # (the model's words: escaped)

    def on_call(record: CallRecord) -> None:
        if debug:
            term.err(json.dumps(record.to_json(), ensure_ascii=False) + "\n")
        elif not unshown:
            said = record.error if record.error is not None else (record.result or "")
            short = said if len(said) <= 200 else said[:200] + "…"
            term.err(Dim(f"  {shown(short, lines=True)}"), "\n")  # (the tool's: escaped)

    def on_output(line: str) -> None:  # what the user's functions write on stderr: theirs, dimmed, escaped
        term.err(Dim(shown(line)), "\n")

    return ToolHooks(approve if term.stdin_tty else None, on_start, on_call, on_output)


def show_prompt(text: str | None, opts: TurnOptions, env: Environment, term: Terminal, as_json: bool) -> int:
    """`--show-prompt`: the context as text (or JSON with its tokens), nothing generated."""
    from quipu.app.turns import show_prompt as view_prompt

    view = view_prompt(text, opts, env)
    if as_json:
        term.out(json.dumps(view.to_json(), ensure_ascii=False) + "\n")
    else:  # (on a terminal, escaped: the prompt holds outside text; the count after it, on one screen)
        term.out(view.text if view.text.endswith("\n") else view.text + "\n")
        count = f"{len(view.tokens)} token{'' if len(view.tokens) == 1 else 's'}"
        where = f"already in session '{view.session}'" if view.session is not None else "in the prompt cache"
        term.err(f"{count}, {view.reused} of them {where}\n")
    return ExitCode.OK


def stats_line(result: Answer) -> str:
    s = result.stats
    return (
        f"{s.prompt_tokens} prompt tokens ({s.cached_tokens} cached), {s.completion_tokens} generated, "
        f"finish {result.finish_reason}; load {s.load_s:.2f}s, restore {s.restore_s:.2f}s, "
        f"prefill {s.prefill_s:.2f}s ({s.prefill_tok_s:.0f} tok/s), decode {s.decode_s:.2f}s "
        f"({s.decode_tok_s:.1f} tok/s), first token {s.ttft_s:.2f}s; seed {result.seed}"
        + (f"; on {s.placement['summary']}" if s.placement else "")
    )
