"""The chat REPL: prompt_toolkit input (keys, completion), streamed replies, approvals of calls;
its slash commands are `slash.py`'s table."""

from __future__ import annotations

import contextlib
import io
import os
import shlex
from typing import TYPE_CHECKING, Any, Callable, Iterator

from quipu.cli.render import MarkdownRenderer, PlainRenderer, Renderer
from quipu.cli.slash import BY_NAME, COMMANDS, parse_command
from quipu.cli.stream import ChatStream
from quipu.cli.terminal import Dim, HeldKeys, PrefillProgress, StopOnCtrlC, Terminal
from quipu.errors import Ended, ExitCode, Interrupted, QuipuError, UsageError
from quipu.shown import shown

if TYPE_CHECKING:
    from prompt_toolkit.completion import CompleteEvent, Completer, Completion
    from prompt_toolkit.document import Document
    from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent

    from quipu.app.answer import Answer
    from quipu.app.chat import ChatSession
    from quipu.app.environment import Environment
    from quipu.app.tools import CallRecord, ToolCall

PROMPT = "› "


# The longest line a piped chat takes as one message (far more than any context holds).
MAX_LINE_BYTES = 4 << 20


class Repl:
    """Reads messages and commands, streams replies. Errors are shown in one line; it goes on."""

    def __init__(self, chat: ChatSession, term: Terminal, env: Environment, *, markdown: bool = False, show_thinking: bool = True):
        self.chat = chat
        self.term = term
        self.env = env
        self.markdown = markdown
        # (/edit and /compact in a terminal: a text waiting in the next prompt to be changed, and
        # what is done with it once sent)
        self.editing: tuple[Callable[[str], None], str] | None = None
        self.show_thinking = show_thinking
        self.running = True
        self._always: set[str] = set()  # tools approved for the rest of this chat (never saved)
        from quipu.app.tools import ToolHooks

        # How this chat approves and shows the calls of a turn (what the functions write on stderr
        # is shown as ChatSession.open was told: `function_output`).
        self.hooks = ToolHooks(self._approve, self._call_starts, self._call_ended)

    def leave(self) -> None:
        """The chat ends after this line (/exit)."""
        self.running = False

    def show_reasoning(self, on: bool | None) -> bool:
        """Shows a thinking model's reasoning or hides it (None: the other way round); whether it is shown."""
        self.show_thinking = (not self.show_thinking) if on is None else on
        return self.show_thinking

    # ---- tools -------------------------------------------------------------------------------

    def _approve(self, call: ToolCall) -> bool:
        if call.name in self._always:
            return True
        answer = self.ask(f"run {call.spelled}? [y]es, [n]o, [a]lways for {call.name}, [s]top here: ",
                          default="n", choices="ynasc")
        if answer[:1] in ("s", "c"):  # (c: Ctrl-C at the question) the calls wait; the chat goes on
            from quipu.errors import Interrupted

            raise Interrupted("stopped at the approval of a call")
        if answer.startswith("a"):
            self._always.add(call.name)
        return answer[:1] in ("y", "a")

    def _call_starts(self, call: ToolCall) -> None:
        from quipu.shown import shown

        self.say(Dim(shown(call.spelled)))  # (the model's words: escaped)

    def _call_ended(self, record: CallRecord) -> None:
        from quipu.shown import shown

        said = record.error if record.error is not None else (record.result or "")
        said = " ".join(said.split())
        self.say(Dim("  " + shown(said if len(said) <= 160 else said[:160] + "…")))  # (the tool's: escaped)

    # ---- output ----------------------------------------------------------------------------

    def say(self, text: str) -> None:
        self.term.err(text, "\n")

    def show_notices(self) -> None:
        for notice in self.chat.notices:
            self.term.warn(notice)

    def need(self, arg: str, usage: str) -> str:
        """The one argument of a command, unquoted; a usage error when it is missing or malformed."""
        arg = arg.strip()
        try:
            words = shlex.split(arg) if arg[:1] in ("'", '"') else [arg]
        except ValueError as exc:  # an unbalanced quote
            raise UsageError(f"usage: {usage} ({str(exc)[:1].lower()}{str(exc)[1:]})") from None
        if len(words) != 1 or not words[0]:
            raise UsageError(f"usage: {usage}")
        return words[0]

    # ---- turns -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _streaming(self, renderer: Callable[[], Renderer], gap: bool = False
                   ) -> Iterator[tuple[ChatStream, StopOnCtrlC]]:
        """What the model writes, shown by `renderer` as it comes (its sink), the prompt's reading
        as a progress bar, Ctrl-C stopping it (the stopper) and keys typed meanwhile held for the
        next prompt; the screen closed after it (`gap`: a blank line after it, on a terminal)."""
        progress = PrefillProgress(self.term)
        shown = renderer()
        with StopOnCtrlC(hard_second=False, quit_too=True) as stopper, HeldKeys(self.term):
            try:
                yield ChatStream(shown, stopper, progress), stopper
            finally:
                progress.close()
                shown.close(stopped=stopper.requested)
                if gap and self.term.stdout_tty:  # (a gap between a reply and the next message, on a terminal)
                    self.term.out("\n")

    def turn(self, action: Callable[..., Answer], *args: str, room_made: bool = False) -> None:
        with self._streaming(self._renderer, gap=True) as (sink, stopper):
            outcome = action(*args, sink=sink, hooks=self.hooks)
        if outcome.finish_reason == "interrupted":
            self.say("[stopped]")
        elif outcome.finish_reason == "length":
            self.say("[cut at max_tokens: /continue goes on]")
        if stopper.ended:  # told to end (SIGTERM, SIGHUP): the reply so far is saved; leave
            self.running = False
            return
        self.show_notices()
        if outcome.context_full:
            unsent = args[0] if args and not outcome.tokens else None
            if room_made and unsent is None and not args:  # (a cut reply that went on, and filled it again)
                self.say("the context is full again; /trim or /new makes room")
            elif room_made:  # room was made for this message already; do not go round again
                self.say("the context is still full; the message was not sent")
            else:
                self.context_full(unsent)

    def _renderer(self) -> Renderer:
        # Reasoning is shown dimmed in a terminal; a pipe gets one answer per line.
        show = self.show_thinking and self.term.stdout_tty
        if self.markdown and self.term.stdout_tty:
            return MarkdownRenderer(self.term, show)
        return PlainRenderer(self.term, show, marked=True)

    def summarized(self, instructions: str | None = None) -> str:
        """The model's summary of the older exchanges (`app.compact.summarize`), shown as it is
        written (Ctrl-C stops it: nothing is compacted)."""
        from quipu.app.compact import summarize

        self.say("summarizing the older exchanges (the last ones stay as they are)...")
        with self._streaming(lambda: PlainRenderer(self.term)) as (sink, stopper):
            summary = summarize(self.chat, instructions, sink=sink)
        if stopper.requested:
            raise Interrupted("the summary was stopped; nothing was compacted")
        return summary

    def context_full(self, unsent: str | None) -> None:
        used, size = self.chat.context_used, self.chat.context_size
        needs = self.chat.size_of(unsent) if unsent is not None else 0
        if unsent is not None and needs >= size - used:  # (the message itself is larger than what is free)
            self.say(f"the message does not fit: it is {needs} tokens, and {size - used} of the context's {size} are "
                     "free.")
        else:
            self.say(f"the context is full ({used} of {size} tokens).")
        choice = self.ask("[d]rop the oldest exchanges, [s]ummarize them (/compact), [n]ew session with the same "
                          "system prompt, or [c]ancel? (a letter, then Enter; Enter alone drops; the conversation "
                          "as it was stays a branch) ", default="d", choices="dsnc")
        if choice.startswith("d"):
            dropped = self.chat.drop_oldest(unsent)
            self.say(f"dropped {dropped} old messages; the system prompt stays (the whole conversation: /tree)")
            if unsent is None and dropped and self.chat.capabilities.can("continue"):
                self.turn(self.chat.continue_reply, room_made=True)  # the reply the context cut goes on
                return
        elif choice.startswith("s"):
            from quipu.app.compact import compact

            made = compact(self.chat, self.summarized())
            self.say(f"compacted into branch {made} ({used} -> {self.chat.context_used} tokens of context; the whole "
                     "conversation: /tree)")
        elif choice.startswith("n"):
            BY_NAME["new"].handler(self, "")
        else:
            return
        if unsent:
            self.turn(self.chat.send, unsent, room_made=True)

    def ask(self, question: str, default: str, choices: str = "dnc") -> str:
        """One of `choices` (the last: cancel), typed and then Enter (the question says so): keys
        typed ahead during a reply wait in the terminal for the next prompt, this one too, so a
        single key would take a message's first letter for an answer."""
        if not self.term.stdin_tty:
            self.say(question + default)
            return default
        from prompt_toolkit import prompt

        while True:
            try:
                answer = (prompt(question) or default).strip().lower()
            except Ended:
                raise
            except (KeyboardInterrupt, EOFError):
                return "c"
            if answer[:1] and answer[:1] in choices:
                return answer
            # Not an answer (a message typed too soon?): nothing is taken for one, ask again.
            self.say(f"please answer {', '.join(choices[:-1])} or {choices[-1]} (what you typed was not sent)")

    def handle(self, line: str) -> None:
        editing, self.editing = self.editing, None
        if editing is not None and line.strip() and not line.strip().startswith("/"):
            editing[0](line)
        elif line.strip().startswith("/"):
            command, arg = parse_command(line)
            if command is None:
                from quipu.shown import shown

                said = arg if len(arg) <= 40 else arg[:40] + "…"
                self.say(f"unknown command /{shown(said)}; /help lists them")
                return
            command.handler(self, arg)
        elif line.strip():
            self.turn(self.chat.send, line)

    def safely(self, line: str) -> None:
        """The REPL's error boundary: an error is one line on stderr, and the chat goes on."""
        try:
            self.handle(line)
        except Interrupted:
            self.say("[stopped]")
        except QuipuError as exc:
            self.error(str(exc))
        except Exception as exc:  # a bug of ours must not end the chat and lose what follows
            if os.environ.get("QUIPU_DEBUG") == "1":
                raise
            self.error(f"unexpected {type(exc).__name__}: {exc} (QUIPU_DEBUG=1 shows where)")

    def error(self, message: str) -> None:
        self.term.err(f"quipu: error: {shown(message, lines=True)}\n")

    # ---- loops -----------------------------------------------------------------------------

    def run(self) -> int:
        import signal

        # Ctrl-\ (SIGQUIT) would end the chat with a core dump: it stops a reply as Ctrl-C does,
        # and does nothing at the prompt.
        try:
            previous = signal.signal(signal.SIGQUIT, signal.SIG_IGN)
        except (ValueError, AttributeError):  # not the main thread, or no SIGQUIT here
            previous = None
        try:
            return self.interactive() if self.term.stdin_tty else self.piped()
        finally:
            if previous is not None:
                signal.signal(signal.SIGQUIT, previous)

    def piped(self) -> int:
        """One message per line of stdin, each reply printed; no prompt, no escape codes."""
        self.say(f"session: {self.chat.name}" if self.chat.kept else
                 "this chat is not kept (a piped chat keeps a session when named: -S NAME)")
        self.show_notices()
        warned = False
        for raw in self._stdin_lines():
            if not self.running:
                break
            if raw is None:
                self.error(f"a line of standard input is longer than {MAX_LINE_BYTES >> 20} MB; it was skipped")
                continue
            if b"\x00" in raw:
                self.error("standard input is binary data, not text; the chat stops here")
                return ExitCode.USAGE
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                line = raw.decode("utf-8", "replace")
                if not warned:
                    self.term.warn("standard input is not valid UTF-8; undecodable bytes were replaced")
                    warned = True
            self.safely(line.rstrip("\r\n"))
        return 0

    def _stdin_lines(self) -> Iterator[bytes | None]:
        """Lines of standard input as bytes, so that no encoding error can end the loop; None for
        a line longer than MAX_LINE_BYTES, which is read past, never held."""
        stream = getattr(self.term.stdin, "buffer", None)
        if stream is None:
            stream = io.BytesIO(self.term.stdin.read(MAX_LINE_BYTES * 4).encode("utf-8", "surrogateescape"))
        while True:
            line = stream.readline(MAX_LINE_BYTES + 1)
            if not line:
                return
            if len(line) > MAX_LINE_BYTES:
                while line and not line.endswith(b"\n") and b"\x00" not in line:
                    line = stream.readline(MAX_LINE_BYTES)
                yield None if b"\x00" not in line else b"\x00"
                continue
            yield line

    def interactive(self) -> int:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory

        from quipu.app.chat import history_file

        session: PromptSession[str] = PromptSession(
            history=FileHistory(history_file(self.env)),
            completer=SlashCompleter(),
            complete_while_typing=True,
            key_bindings=key_bindings(),
            multiline=True,
            bottom_toolbar=self.toolbar,
            prompt_continuation=lambda width, line_number, wrap_count: "… ".rjust(width),
        )
        # (what you type follows a coloured mark, the reply comes plain below it, a gap after it)
        prompt: Any = [("class:you", PROMPT)] if self.term.color else PROMPT
        if self.term.color:
            from prompt_toolkit.styles import Style

            session.style = Style.from_dict({"you": "ansicyan bold"})
        verb = "resumed" if self.chat.resumed else "new"
        self.say(f"{verb} session '{self.chat.name}' with {self.chat.model_name}. /help for commands, Ctrl-D to leave.")
        self.show_notices()
        self.recap()
        while self.running:
            try:
                line = session.prompt(prompt, default=self.editing[1] if self.editing else "")
            except Ended:  # told to end (SIGTERM, SIGHUP): every turn is saved already; leave
                break
            except KeyboardInterrupt:
                if self.editing is not None:
                    self.editing = None
                    continue
                self.say("(to leave, press Ctrl-D or type /exit)")
                continue
            except EOFError:
                break
            self.safely(line)
        if self.chat.leave():
            self.say(f"saved session '{self.chat.name}'; `quipu chat --resume` continues it")
        else:
            self.say("nothing was said: no session is kept")
        return 0

    def recap(self, last: int = 4, lines: int = 3) -> None:
        """Shows the end of a resumed conversation, so the user knows where they are: each line
        broken between words at the terminal's width, as a live reply is."""
        import shutil
        import textwrap

        from quipu.shown import shown

        columns = shutil.get_terminal_size().columns
        recent = [m for m in self.chat.messages if m.role != "system"][-last:]
        for m in recent:
            text = m.content.strip().splitlines() or [""]
            said = [between_words(shown(t), 200) for t in text[:lines]]  # (a control character escaped)
            if len(text) > lines:
                said[-1] += " …"
            head = f"  {'you' if m.role == 'user' else 'model'}: "
            body = [textwrap.fill(line, max(columns - 1, 20), initial_indent=head if i == 0 else " " * 4,
                                  subsequent_indent=" " * 4, break_long_words=False, break_on_hyphens=False)
                    for i, line in enumerate(said)]
            self.say("\n".join(body))

    def toolbar(self) -> str:
        used, size = self.chat.context_used, self.chat.context_size
        shown = f"{used}/{size} ({100 * used / size:.0f}%)" if size else f"{used} (the server's)"
        text = f" {self.chat.model_name} · {self.chat.name} · context {shown}"
        if self.chat.context_nearly_full:
            text += " · nearly full: /trim or /new"
        return text


def between_words(text: str, width: int) -> str:
    """`text`, cut to at most `width` characters between two words (and `…` said), or within a
    word only when one is longer than half the width."""
    if len(text) <= width:
        return text
    cut = text.rfind(" ", 0, width)
    return (text[:cut] if cut > width // 2 else text[:width - 1]).rstrip() + " …"


def key_bindings() -> KeyBindings:
    from prompt_toolkit.enums import DEFAULT_BUFFER
    from prompt_toolkit.filters import has_focus
    from prompt_toolkit.key_binding import KeyBindings

    kb = KeyBindings()
    editing = has_focus(DEFAULT_BUFFER)  # not while Ctrl-R search has the focus

    @kb.add("enter", filter=editing)
    def _send(event: KeyPressEvent) -> None:
        buf = event.current_buffer
        state = buf.complete_state
        if state is not None and state.current_completion is not None:
            buf.apply_completion(state.current_completion)
            command = BY_NAME.get(buf.text.strip()[1:])
            if command is not None and command.args:
                buf.insert_text(" ")  # it takes an argument: let the user type it
                return
        buf.validate_and_handle()

    @kb.add("escape", "enter", filter=editing)
    def _newline(event: KeyPressEvent) -> None:
        event.current_buffer.insert_text("\n")

    return kb


# The commands whose argument is a file: Tab completes its path.
FILE_ARGUMENTS = ("attach", "schema", "grammar")


def SlashCompleter() -> Completer:
    from prompt_toolkit.completion import Completer, Completion, PathCompleter
    from prompt_toolkit.document import Document

    paths = PathCompleter(expanduser=True)

    class _Completer(Completer):
        def get_completions(self, document: Document, complete_event: CompleteEvent) -> Iterator[Completion]:
            text = document.text_before_cursor
            if not text.startswith("/"):
                return
            name, space, arg = text[1:].partition(" ")
            if space:
                if name.lower() in FILE_ARGUMENTS:
                    yield from paths.get_completions(Document(arg, len(arg)), complete_event)
                return
            for c in COMMANDS:
                if c.name.startswith(name.lower()):
                    yield Completion("/" + c.name, start_position=-len(text), display_meta=c.help)

    return _Completer()
