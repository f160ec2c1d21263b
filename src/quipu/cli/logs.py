"""`quipu logs ...`: the log of answers: the last ones, a search, one in full, off and on, rm, path."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, List, Optional

import typer

from quipu.cli.terminal import Dim, Terminal
from quipu.shown import shown

if TYPE_CHECKING:
    from quipu.app.answer_log import Record

app = typer.Typer(rich_markup_mode=None, invoke_without_command=True,
                  help="The log of answers: every run's and chat turn's answer, searchable. With no command: "
                       "the last answers.")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="logs")


@app.callback()
def logs(context: typer.Context,
         count: int = typer.Option(10, "-n", "--count", help="How many answers."),
         query: Optional[str] = typer.Option(None, "-q", "--query", help="Only answers with these words (SQLite's "
                                             "full-text search: \"a phrase\", OR, NOT, prefix*), best match first."),
         model: Optional[str] = typer.Option(None, "-m", "--model", help="Only answers of models whose name holds "
                                             "this."),
         session: Optional[str] = typer.Option(None, "--session", "-S", help="Only answers of this session."),
         since: Optional[str] = typer.Option(None, "--since", help="Only answers since then: 2026-12-01, "
                                             "2026-12-01T14:00, or 90m, 12h, 3d, 2w back.", metavar="WHEN"),
         as_json: bool = typer.Option(False, "--json", help="One JSON object a line, each answer in full.")) -> None:
    if context.invoked_subcommand is not None:
        return
    from quipu.app.answer_log import find_answers, logging_on

    term = Terminal.detect()
    found = find_answers(context.obj, query=query, model=model, session=session, since=since, limit=count)
    if as_json:
        term.out("".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in found))
    elif not found:
        term.err("no answers logged" + (" match" if query or model or session or since else " yet") + "\n")
    else:
        for r in found if query else reversed(found):  # (newest last, as a terminal reads; a search: best first)
            term.out(*_brief(r, _follows(r, found)), "\n")
    if not logging_on(context.obj):
        term.warn("logging is off (`quipu logs on` turns it on)")


def _when(at: float) -> str:
    from quipu.cli.terminal import local_time

    return local_time(at)


def _one_line(text: str | None, width: int) -> str:
    flat = " ".join((text or "").split())
    return shown(flat if len(flat) <= width else flat[:width - 1] + "…")


def _follows(r: Record, found: list[Record]) -> str:
    """Which answer `r` follows up, where it follows one: the one before it in its conversation
    among those listed, else its conversation's first."""
    if r.parent is not None:  # (0: its conversation begins with it)
        return f"  (follows #{r.parent})" if r.parent else ""
    if r.id is None or r.conversation in ("", str(r.id)):
        return ""
    before = [other.id for other in found if other.conversation == r.conversation and other.id is not None
              and other.id < r.id]
    if before:
        return f"  (follows #{max(before)})"
    kind, _, name = r.conversation.partition(":")
    return f"  (in session {shown(name)})" if kind == "session" and name else \
        f"  (in the conversation of #{shown(r.conversation)})"


def _brief(r: Record, follows: str = "") -> list[str]:
    head = f"#{r.id}  {_when(r.at)}  {shown(r.model)}" + (f"  [{shown(r.session)}]" if r.session else "") + follows
    return [Dim(head), "\n", f"  > {_one_line(r.prompt, 100)}\n", f"  {_one_line(r.answer, 200)}"]


@app.command()
def show(context: typer.Context, record: int = typer.Argument(..., help="The answer's id (`quipu logs` lists them)."),
         as_json: bool = typer.Option(False, "--json", help="One JSON object."),
         to_session: Optional[str] = typer.Option(None, "--to-session", help="Make its conversation, up to it, the "
                                                  "new session NAME (read on its first turn).", metavar="NAME"),
         model: Optional[str] = typer.Option(None, "--model", "-m", help="With --to-session: the session's model "
                                             "(default: the answer's).")) -> None:
    """Show one answer in full: its prompt, reasoning, answer, calls and settings."""
    from quipu.app.answer_log import answer

    term = Terminal.detect()
    if to_session is not None:
        from quipu.app.answer_log import session_from_log
        from quipu.cli import spec

        held = session_from_log(context.obj, record, to_session,
                                spec.turn_options({"model": model}, context.obj))
        term.err(f"session '{to_session}' holds the conversation to answer {record} ({held} "
                 f"exchange{'' if held == 1 else 's'}): quipu chat -S {to_session}\n")
        return
    r = answer(context.obj, record)
    from quipu.app.answer_log import answers_before

    before = answers_before(context.obj, r)
    if as_json:
        term.out(json.dumps(r.to_json(), ensure_ascii=False) + "\n")
        return
    out: list[str] = [Dim(f"#{r.id}  {_when(r.at)}  {shown(r.model)}  ({r.command}"
                          + (f", session {shown(r.session)}" if r.session else "") + f", conversation {shown(r.conversation)})")]
    if before:  # (the answers it follows up, one from another: its branch of the conversation)
        out.append(Dim("follows: " + " → ".join(f"#{i}" for i in before) + f" → #{r.id}"))
    if r.system:
        out += [Dim("system:"), shown(r.system, lines=True)]  # (its line breaks are text: kept)
    out += [Dim("prompt:"), shown(r.prompt, lines=True)]
    if r.attachments:
        out.append(Dim("attached: " + ", ".join(shown(a.get("name", "?")) for a in r.attachments)))
    if r.reasoning:
        out += [Dim("reasoning:"), Dim(shown(r.reasoning, lines=True))]
    for call in r.tool_calls:
        out.append(Dim(f"call: {shown(json.dumps(call, ensure_ascii=False))}"))
    out += [Dim("answer:"), shown(r.answer, lines=True)]
    usage = f"{r.prompt_tokens} prompt tokens ({r.cached_tokens} cached), {r.completion_tokens} generated" \
        if r.prompt_tokens is not None else ""
    settings = shown(", ".join(f"{k}={v}" for k, v in r.options.items()))
    out.append(Dim(f"finish {r.finish_reason}" + (f"; {usage}" if usage else "") + (f"; {settings}" if settings else "")))
    term.out(*(part for line in out for part in (line, "\n")))


@app.command()
def off(context: typer.Context) -> None:
    """Stop logging answers (until `quipu logs on`); what is logged stays."""
    from quipu.app.answer_log import set_logging

    set_logging(context.obj, False)
    Terminal.detect().err("answers are no longer logged\n")


@app.command()
def on(context: typer.Context) -> None:
    """Log answers again."""
    from quipu.app.answer_log import set_logging

    set_logging(context.obj, True)
    Terminal.detect().err("answers are logged\n")


@app.command()
def rm(context: typer.Context,
       records: Optional[List[int]] = typer.Argument(None, help="The answers' ids."),
       before: Optional[str] = typer.Option(None, "--before", help="Every answer older than this (a date, or a span "
                                            "back from now: 30d).", metavar="WHEN"),
       everything: bool = typer.Option(False, "--all", help="Every answer.")) -> None:
    """Remove answers from the log: by id, older than a date, or all of them."""
    from quipu.app.answer_log import remove_answers

    gone = remove_answers(context.obj, records or (), before, everything)
    Terminal.detect().err(f"{gone} answer{'' if gone == 1 else 's'} removed\n")


@app.command()
def path(context: typer.Context) -> None:
    """Print where the log is (a SQLite database)."""
    Terminal.detect().out(f"{context.obj.log_path}\n")
