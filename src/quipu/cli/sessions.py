"""`quipu sessions ...`: list, show, rm, rename, fork, export."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from quipu.cli.spec import complete_session
from quipu.cli.terminal import Terminal, human_size

NAME = typer.Argument(..., help="Session name.", autocompletion=complete_session)

app = typer.Typer(rich_markup_mode=None, help="Manage saved sessions.", no_args_is_help=True)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="sessions")





@app.command("list")
def list_(context: typer.Context, as_json: bool = typer.Option(False, "--json", help="One JSON array.")) -> None:
    """List sessions, most recently used first."""

    from quipu.app.manage import exposed_folders, list_sessions
    from quipu.cli.terminal import local_time

    term = Terminal.detect()
    infos, damaged = list_sessions(context.obj)
    for folder in exposed_folders(context.obj):
        term.warn(f"{folder} can be read by other accounts; quipu narrows it to you when it next writes there "
                  f"(or `chmod 700 {folder}`)")
    if as_json:
        term.out(json.dumps([i.to_dict() for i in infos], indent=1) + "\n")
    elif not infos:
        term.err("no sessions yet: `quipu chat` or `quipu run -S NAME` makes one\n")
    else:
        term.table(("name", "model", "turns", "tokens", "size", "last used"),
                   ((i.name, i.model, str(i.turns), str(i.tokens), human_size(i.size_bytes), local_time(i.updated))
                    for i in infos))
    for name in damaged:
        term.warn(f"session '{name}' is damaged and was not listed")


@app.command()
def show(context: typer.Context, name: str = NAME) -> None:
    """Show a session's transcript."""
    from quipu.app.manage import spelled_calls, transcript
    from quipu.shown import shown

    term = Terminal.detect()
    data = transcript(context.obj, name)
    # (escaped, even in a pipe; wrapped at words on a terminal, in a pipe each line as it is)
    branches = data.get("branches") or []
    on = next((b["id"] for b in branches if b["current"]), None)
    where = f" · branch {on} of {len(branches)} (`quipu sessions tree {data['name']}`)" if branches else ""
    term.styled(shown(f"{data['name']} · {data['model']} · {data['context_tokens']} tokens · {data['updated']}{where}"),
                "dim")
    for m in data["messages"]:
        style = {"system": "magenta", "user": "bold cyan", "assistant": "bold green", "tool": "yellow"}.get(m["role"], "")
        term.styled("\n" + m["role"] + (f" ({shown(str(m['name']))})" if m["role"] == "tool" and m.get("name") else ""),
                    style)
        if m.get("reasoning"):
            term.styled(shown(m["reasoning"], lines=True), "dim")
        if m["content"]:
            term.styled(shown(m["content"], lines=True))
        for call in spelled_calls(m):
            term.styled(f"→ {shown(call)}", "dim")


@app.command()
def rm(
    context: typer.Context,
    names: List[str] = typer.Argument(..., help="Sessions to remove.", autocompletion=complete_session),
) -> None:
    """Remove sessions."""
    from quipu.app.manage import remove

    remove(context.obj, names)


@app.command()
def rename(context: typer.Context, old: str = NAME, new: str = typer.Argument(..., help="New name.")) -> None:
    """Rename a session."""
    from quipu.app.manage import rename as do_rename

    do_rename(context.obj, old, new)


@app.command()
def fork(context: typer.Context, src: str = NAME, dst: str = typer.Argument(..., help="Name of the copy."),
         branch: Optional[int] = typer.Option(None, "--branch", help="Only this branch of it (`quipu sessions tree "
                                              "NAME` shows them).", metavar="ID")) -> None:
    """Copy a session under a new name; the two go on independently."""
    from quipu.app.manage import fork as do_fork

    do_fork(context.obj, src, dst, branch)


@app.command()
def tree(context: typer.Context, name: str = NAME,
         as_json: bool = typer.Option(False, "--json", help="One JSON object a branch.")) -> None:
    """Show a session's branches (the current one marked *)."""
    import shutil

    from quipu.app.manage import tree as branch_rows
    from quipu.cli.terminal import tree_lines

    term = Terminal.detect()
    found = branch_rows(context.obj, name)
    if as_json:
        term.out("".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in found))
    else:
        term.out("\n".join(tree_lines(found, shutil.get_terminal_size((100, 24)).columns if term.stdout_tty
                                       else 400)) + "\n")


@app.command()
def export(
    context: typer.Context,
    name: str = NAME,
    fmt: str = typer.Option("markdown", "--format", "-f", help="markdown or json."),
) -> None:
    """Print a session's transcript as Markdown or JSON."""
    from quipu.app.manage import export as do_export

    Terminal.detect().out(do_export(context.obj, name, fmt))
