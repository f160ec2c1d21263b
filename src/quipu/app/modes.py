"""Which options work where, in one table: what each mode of a command (a one-shot run, a run
that goes on from a messages file, a session's turn, a chat, a batch) refuses, and, for what a
host cannot do, its `Capabilities` (`sessions/base.py`). Both are refused before anything is
loaded or sent, in one wording: "X cannot be used with Y"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from quipu.app.turn_options import TurnOptions
from quipu.errors import UsageError
from quipu.sessions.base import FEATURES, Capabilities, refusal_words

# Each option a mode or a host may refuse: its spelling, and whether the options give it. A
# feature of `sessions.base.FEATURES` is asked by the options listed under it.
OPTIONS: dict[str, tuple[tuple[str, Callable[[TurnOptions], bool]], ...]] = {
    "continue": (("--continue", lambda o: o.continue_reply),),
    "raw": (("--raw", lambda o: o.raw),),
    "grammar": (("--schema", lambda o: o.schema is not None), ("--grammar", lambda o: o.grammar is not None),
                ("--regex", lambda o: o.regex is not None)),
    "logit_bias": (("--logit-bias", lambda o: bool(o.logit_bias)),),
    "chat_template": (("--chat-template", lambda o: o.chat_template is not None),),
    "think": (("--think/--no-think", lambda o: o.think is not None),
              ("--reasoning-effort", lambda o: o.reasoning_effort is not None)),
    "reasoning_budget": (("--reasoning-budget", lambda o: o.reasoning_budget is not None),),
    "tools": (("--functions", lambda o: bool(o.functions)), ("--tools", lambda o: o.tools_file is not None),
              ("--mcp", lambda o: bool(o.mcp))),
    "tool_choice": (("--tool-choice", lambda o: o.tool_choice is not None),),
    "tool_results": (("--tool-result", lambda o: bool(o.tool_results)),),
    "context_settings": (("--ctx", lambda o: o.ctx is not None), ("--threads", lambda o: o.threads is not None),
                         ("--kv-type", lambda o: o.kv_type is not None)),
    "session": (("--session", lambda o: o.session is not None),),
    "messages": (("--messages", lambda o: o.messages is not None),),
    "server": (("a server (--url, QUIPU_URL or the config's [remote] url)", lambda o: o.server is not None),),
}


@dataclass(frozen=True)
class Mode:
    """A way a command runs turns, and the options it refuses (`where`: how a refusal names it)."""

    where: str
    refuses: frozenset[str]


ONE_SHOT = Mode("a one-shot run (give -S NAME for a session)", frozenset({"continue", "tool_results"}))
FROM_MESSAGES = Mode("--messages (a conversation of its own)", frozenset({"session", "continue", "raw",
                                                                         "tool_results"}))
SESSION = Mode("--session (a session is a conversation)", frozenset({"raw"}))
CHAT = Mode("a chat (it is a session)", frozenset({"raw", "messages", "continue", "tool_results"}))
BATCH = Mode("--batch (each row is answered in one reply, on a local model)",
             frozenset({"session", "continue", "messages", "tools", "tool_choice", "tool_results",
                        "reasoning_budget", "show_prompt", "server"}))


def mode_of(opts: TurnOptions) -> Mode:
    """The mode of a `quipu run` turn."""
    if opts.messages is not None:
        return FROM_MESSAGES
    return SESSION if opts.session is not None else ONE_SHOT


def check_options(opts: TurnOptions, mode: Mode, host: Capabilities | None = None, *, show: bool = False) -> None:
    """Refuses, before anything is sent or loaded, what was asked that the mode or the host
    (when it is known) cannot do: the mode's refusal names every option it refuses that was given."""
    given = {feature: [name for name, asks in options if asks(opts)] for feature, options in OPTIONS.items()}
    if show:
        given["show_prompt"] = ["--show-prompt"]
    refused = [name for feature, names in given.items() if feature in mode.refuses for name in names]
    if refused:
        named = ", ".join(refused[:-1]) + " and " + refused[-1] if len(refused) > 1 else refused[0]
        raise UsageError(refusal_words(named, mode.where))
    if host is not None:
        for feature, names in given.items():
            if names and feature in FEATURES:
                host.require(feature)
