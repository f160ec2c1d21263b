"""The chat's slash commands, in one table: each command's name, what it takes, its help, and
what it does to the REPL it is typed in (`Repl`: what a command uses of `repl.Repl`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from quipu.cli.terminal import PrefillProgress, Terminal
from quipu.errors import UsageError

if TYPE_CHECKING:
    from quipu.app.chat import ChatSession


class Repl(Protocol):
    """What a slash command uses of the REPL it is typed in."""

    chat: ChatSession
    term: Terminal
    editing: tuple[Callable[[str], None], str] | None  # (a text waiting in the next prompt, and what takes it)

    def say(self, text: str) -> None: ...
    def need(self, arg: str, usage: str) -> str: ...
    def show_notices(self) -> None: ...
    def turn(self, action: Callable[..., Any], *args: str, room_made: bool = False) -> None: ...
    def leave(self) -> None: ...
    def show_reasoning(self, on: bool | None) -> bool: ...
    def summarized(self, instructions: str | None = None) -> str: ...


@dataclass(frozen=True)
class SlashCommand:
    name: str
    args: str
    help: str
    handler: Callable[["Repl", str], None]


def _help(repl: "Repl", _arg: str) -> None:
    import shutil

    repl.say("\n".join(help_lines(shutil.get_terminal_size((100, 24)).columns)))


HELP_NAMES = 22  # the column of the commands' names: a longer one (/think's choices) has a line of its own


def help_lines(columns: int) -> list[str]:
    """/help laid out for a terminal `columns` wide: each command's name, then what it does,
    wrapped under itself."""
    import textwrap

    width = min(HELP_NAMES, max(len(f"/{c.name} {c.args}".rstrip()) for c in COMMANDS))
    indent = " " * (width + 4)
    room = max(30, columns - len(indent) - 1)
    lines = []
    for c in COMMANDS:
        name = f"/{c.name} {c.args}".rstrip()
        said = textwrap.wrap(c.help, room) or [""]
        if len(name) > width:
            lines.append(f"  {name}")
        else:
            lines.append(f"  {name.ljust(width)}  {said.pop(0)}")
        lines += [indent + more for more in said]
    lines.append("")
    lines += textwrap.wrap("Enter sends; Alt-Enter or Esc Enter adds a line; Ctrl-C stops a reply; Ctrl-D leaves.",
                           max(30, columns - 3), initial_indent="  ", subsequent_indent="  ")
    return lines


def _exit(repl: "Repl", _arg: str) -> None:
    repl.leave()


def _save(repl: "Repl", arg: str) -> None:
    name = repl.need(arg, "/save NAME")
    repl.chat.save_as(name)
    repl.say(f"saved a copy as '{name}'; you are still in '{repl.chat.name}'")


def _load(repl: "Repl", arg: str) -> None:
    name = repl.need(arg, "/load NAME")
    progress = PrefillProgress(repl.term, "restoring the conversation")
    try:
        repl.chat.load(name, on_progress=progress)
    finally:
        progress.close()
    repl.show_notices()
    repl.say(f"now in session '{name}' ({len(repl.chat.messages)} messages)")


def _sessions(repl: "Repl", _arg: str) -> None:
    infos = repl.chat.sessions()
    if not infos:
        repl.say("no saved sessions")
        return
    from quipu.cli.terminal import fit, local_time
    from quipu.shown import shown

    for i in infos:  # (in 96 columns: a 100-column terminal holds every line)
        mark = "*" if i.name == repl.chat.name else " "
        turns = f"{i.turns:>3} turn{'' if i.turns == 1 else 's'}"
        repl.say(f" {mark} {fit(i.name, 24):<24}  {fit(shown(i.model), 22):<22}  {turns:<9} {i.tokens:>6} tokens  "
                 f"{local_time(i.updated)}")


def _reset(repl: "Repl", _arg: str) -> None:
    repl.chat.reset()
    repl.say("the conversation was forgotten; the system prompt stays")


def _undo(repl: "Repl", _arg: str) -> None:
    if repl.chat.undo():
        repl.say(f"back before the last exchange (kept as a branch: /tree); context {repl.chat.context_used} tokens")
    else:
        repl.say("nothing to undo")


def _retry(repl: "Repl", _arg: str) -> None:
    repl.turn(repl.chat.retry)


def _edit(repl: "Repl", arg: str) -> None:
    import functools

    first, _, rest = arg.strip().partition(" ")
    n, text = (int(first), rest.strip()) if first.isascii() and first.isdigit() else (None, arg.strip())
    if text:
        repl.turn(functools.partial(repl.chat.edit, n=n), text)
        return
    at = repl.chat.yours(n)
    if not repl.term.stdin_tty:
        raise UsageError("usage: /edit [N] TEXT (in a terminal, /edit [N] puts your message in the prompt to edit)")
    repl.editing = (lambda text: repl.turn(functools.partial(repl.chat.edit, n=n), text), repl.chat.messages[at].content)
    repl.say("edit it and press Enter: the reply goes on from there as a new branch (Ctrl-C leaves it as it was)")


def _compact(repl: "Repl", arg: str) -> None:
    from quipu.app.compact import compact

    before = repl.chat.context_used
    summary = repl.summarized(arg.strip() or None)

    def done(text: str) -> None:
        made = compact(repl.chat, text)
        repl.say(f"compacted into branch {made} ({before} -> {repl.chat.context_used} tokens of context); "
                 "the conversation as it was stays a branch (/tree, /switch)")

    if repl.term.stdin_tty:
        repl.editing = (done, summary)
        repl.say("the summary waits in the prompt: change it if you like, and press Enter (Ctrl-C: no compaction)")
    else:
        done(summary)


def _tree(repl: "Repl", _arg: str) -> None:
    import shutil

    from quipu.app.branches import rows
    from quipu.cli.terminal import tree_lines

    current, others = repl.chat.branches()
    repl.say("\n".join(tree_lines(rows(current, others), shutil.get_terminal_size((100, 24)).columns)))


def _switch(repl: "Repl", arg: str) -> None:
    word = repl.need(arg, "/switch ID|parent|next|prev")
    progress = PrefillProgress(repl.term, "restoring the branch")
    try:
        to = repl.chat.switch(word, on_progress=progress)
    finally:
        progress.close()
    repl.show_notices()
    repl.say(f"on branch {to} ({repl.chat.context_used} tokens of context)")


def _continue(repl: "Repl", _arg: str) -> None:
    repl.turn(repl.chat.continue_reply)


def _system(repl: "Repl", arg: str) -> None:
    repl.chat.set_system(arg.strip() or None)
    repl.say("system prompt set" if arg.strip() else "system prompt removed")


def _settings(repl: "Repl") -> None:
    from quipu.shown import shown

    rows = [(key, shown(str("random" if value is None else value)), origin)
            for key, value, origin in repl.chat.settings()]
    width = max(len(key) for key, _, _ in rows)
    values = max(len(value) for _, value, _ in rows)  # (every row's origin in one column, however long a value)
    for key, value, origin in rows:
        repl.say(f"  {key:<{width}} {value:<{values}} {origin}")


def _set(repl: "Repl", arg: str) -> None:
    parts = arg.split(None, 1)
    if not parts:
        _settings(repl)
        repl.say("the session keeps them all; /set KEY VALUE changes one")
        return
    if len(parts) != 2 or (parts[0] != "stop" and len(parts[1].split()) != 1):
        from quipu.options import SETTABLE

        repl.say(f"usage: /set KEY VALUE, with KEY one of {', '.join(SETTABLE)}")
        return
    value = repl.chat.set_option(parts[0], parts[1])
    repl.say(f"{parts[0]} = {value}")


THINK_WORDS = "show|hide|on|off|low|medium|high|budget N|budget off"


def _think(repl: "Repl", arg: str) -> None:
    word = arg.strip().lower()
    if word in ("on", "off"):
        if repl.chat.set_thinking(word == "on"):
            repl.say(f"thinking {word} for the next replies")
        else:
            repl.say("this model's chat template has no switch for thinking")
    elif word in ("", "show", "hide"):
        shown = repl.show_reasoning(None if not word else word == "show")
        repl.say("reasoning is shown" if shown else "reasoning is hidden")
    elif word in ("low", "medium", "high"):
        repl.chat.set_reasoning(effort=word)
        repl.say(f"reasoning effort {word} for the next replies")
    elif word.split()[:1] == ["budget"] and len(word.split()) == 2:
        count = word.split()[1]
        if count != "off" and not (count.isascii() and count.isdigit() and len(count) <= 9):
            raise UsageError(f"/think budget takes a number of tokens (below a billion) or off, not '{count[:20]}'")
        repl.chat.set_reasoning(budget=-1 if count == "off" else int(count))
        repl.say("no reasoning budget" if count == "off" else f"at most {int(count)} tokens of reasoning a reply")
    else:
        raise UsageError(f"usage: /think [{THINK_WORDS}]")


def _schema(repl: "Repl", arg: str) -> None:
    value = repl.need(arg, "/schema FILE|off")
    on = repl.chat.constrain(schema=value if value == "off" else "@" + value)
    repl.say("replies keep to the schema" if on else "replies are free again")


def _tools(repl: "Repl", arg: str) -> None:
    listed = repl.chat.tool_list()
    if not listed:
        repl.say("no tools: start the chat with --functions FILE.py or --tools FILE.json")
    for name, source, description in listed:
        first = description.strip().splitlines()[0] if description.strip() else ""
        repl.say(f"{name}  ({source}){'  ' + first if first else ''}")


def _grammar(repl: "Repl", arg: str) -> None:
    on = repl.chat.constrain(grammar=repl.need(arg, "/grammar FILE|off"))
    repl.say("replies keep to the grammar" if on else "replies are free again")


def _regex(repl: "Repl", arg: str) -> None:
    on = repl.chat.constrain(regex=repl.need(arg, "/regex PATTERN|off"))
    repl.say("replies match the regular expression" if on else "replies are free again")


def _attach(repl: "Repl", arg: str) -> None:
    if arg.strip().lower() == "off":
        dropped = repl.chat.drop_attached()
        repl.say(f"dropped {', '.join(dropped)}; your next message carries no file" if dropped
                 else "nothing was attached")
    elif arg.strip():
        found = repl.chat.attach(repl.need(arg, "/attach FILE"))
        repl.say(f"attached {found.name} {found.describe()}; it goes with your next message")
    elif repl.chat.attached:
        repl.say("your next message carries: " + ", ".join(f"{a.name} {a.describe()}" for a in repl.chat.attached))
    else:
        repl.say("nothing is attached; /attach FILE gives your next message a file")


def _stats(repl: "Repl", _arg: str) -> None:
    s = repl.chat.last_stats
    if s is None:
        repl.say("no reply yet in this run")
        return
    repl.say(
        f"{s.completion_tokens} tokens at {s.decode_tok_s:.1f} tok/s; first token after {s.ttft_s:.2f}s; "
        f"{s.prompt_tokens} prompt tokens, {s.cached_tokens} reused, prefill {s.prefill_tok_s:.0f} tok/s"
        + (f"; on {s.placement['summary']}" if s.placement else "")
    )


def _context(repl: "Repl", _arg: str) -> None:
    used, size = repl.chat.context_used, repl.chat.context_size
    if not size:
        repl.say(f"context: {used} tokens at the last reply; its size is the server's")
        return
    repl.say(f"context: {used} of {size} tokens ({100 * used / size:.0f}%)")


def _trim(repl: "Repl", _arg: str) -> None:
    before = repl.chat.context_used
    dropped = repl.chat.drop_oldest()
    if not dropped:
        size = repl.chat.context_size
        full = f" (the context is {100 * before / size:.0f}% full)" if size else ""
        repl.say(f"nothing to drop{full}: /trim drops the oldest exchanges until half the context is free, and "
                 "the last exchange stays")
        return
    repl.say(f"dropped {dropped} old messages ({before} -> {repl.chat.context_used} tokens of context); the system "
             "prompt stays (the whole conversation: /tree)")


def _show(repl: "Repl", _arg: str) -> None:
    from quipu.shown import shown

    chat = repl.chat
    used, size = chat.context_used, chat.context_size
    repl.say(f"session '{chat.name}' on {shown(chat.model_name)}; context {used}"
             + (f" of {size} tokens" if size else " tokens (its size is the server's)"))
    _settings(repl)


def _new(repl: "Repl", _arg: str) -> None:
    name = repl.chat.new_session_with_system()
    repl.say(f"new session '{name}', with the same system prompt")


COMMANDS: list[SlashCommand] = [
    SlashCommand("help", "", "show this help (/? too)", _help),
    SlashCommand("exit", "", "leave (the session is saved; /quit and /bye too)", _exit),
    SlashCommand("show", "", "the model, the session, its context and settings", _show),
    SlashCommand("save", "NAME", "save a copy of this session under another name", _save),
    SlashCommand("load", "NAME", "switch to another saved session", _load),
    SlashCommand("sessions", "", "list saved sessions", _sessions),
    SlashCommand("reset", "", "forget the conversation, keep the system prompt (/clear too)", _reset),
    SlashCommand("undo", "", "go back to before the last exchange (it stays a branch: /tree, /switch)", _undo),
    SlashCommand("retry", "", "generate the last reply again, with new draws (the old one stays a branch)", _retry),
    SlashCommand("edit", "[N] [TEXT]", "say your N-th message (the last by default) again, changed: the reply goes "
                                       "on from there as a new branch; without TEXT, edit it in the prompt", _edit),
    SlashCommand("tree", "", "the conversation's branches, the current one marked", _tree),
    SlashCommand("compact", "[INSTRUCTIONS]", "a new branch: the older exchanges summarised by the model (you may "
                                              "edit it), the last ones as they were; the original stays a branch",
                 _compact),
    SlashCommand("switch", "ID|parent|next|prev", "go to another branch, its context restored exactly", _switch),
    SlashCommand("continue", "", "keep generating the last reply (or run its calls left waiting)", _continue),
    SlashCommand("system", "TEXT", "set the system prompt (empty removes it)", _system),
    SlashCommand("set", "KEY VALUE", "change a sampling setting or max_tokens (/set alone lists them)", _set),
    SlashCommand("think", f"[{THINK_WORDS}]", "show or hide a thinking model's reasoning; turn it on or off; "
                 "how hard it reasons; at most N tokens of it", _think),
    SlashCommand("schema", "FILE|off", "the next replies are JSON valid against this JSON Schema file", _schema),
    SlashCommand("grammar", "FILE|off", "the next replies keep to this grammar file (GBNF, or Lark: .lark)", _grammar),
    SlashCommand("regex", "PATTERN|off", "the next replies match this regular expression", _regex),
    SlashCommand("attach", "[FILE|off]", "give your next message a file (text: the model reads it with its name); "
                                         "alone, list what waits; off drops it", _attach),
    SlashCommand("tools", "", "the tools the model may call, and where each comes from", _tools),
    SlashCommand("stats", "", "figures of the last reply", _stats),
    SlashCommand("context", "", "tokens used of the context", _context),
    SlashCommand("trim", "", "drop the oldest exchanges to free half the context", _trim),
    SlashCommand("new", "", "start a new session with the same system prompt", _new),
]
BY_NAME = {c.name: c for c in COMMANDS}
# Other chats' names (Ollama's, llm's): what they leave with, ask for help with, clear with.
ALIASES = {"quit": "exit", "bye": "exit", "?": "help", "clear": "reset"}


def parse_command(line: str) -> tuple[SlashCommand | None, str]:
    """('/set top_k 5') -> (the set command, 'top_k 5'); unknown commands give (None, name).
    Ollama's `/set parameter KEY VALUE` is `/set KEY VALUE`, and its `/set system TEXT`, `/system`."""
    body = line.strip()[1:]
    name, _, arg = body.partition(" ")
    if name.lower() == "set":
        word, _, rest = arg.strip().partition(" ")
        if word == "parameter":
            arg = rest.strip()
        elif word == "system":
            name, arg = "system", rest
    command = BY_NAME.get(ALIASES.get(name.lower(), name.lower()))
    if command is None:
        matches = [c for c in COMMANDS if c.name.startswith(name.lower())] if name else []
        command = matches[0] if len(matches) == 1 else None
    return command, (arg if command else name)
