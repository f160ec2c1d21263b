"""Which options work where, in one table: what each mode of a command (a one-shot run, a run
that goes on from a messages file, a session's turn, a chat, a batch) refuses, and, for what a
host cannot do, its `Capabilities` (`sessions/base.py`). Both are refused before anything is
loaded or sent, in one wording: "X cannot be used with Y". What the options ask for, by the
same features, is `TurnOptions.asked` (`turn_options.py`): the table here sees names only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from quipu.errors import UsageError
from quipu.sessions.base import FEATURES, Capabilities, refusal_words

@dataclass(frozen=True)
class Mode:
    """A way a command runs turns, and the options it refuses (`where`: how a refusal names it)."""

    where: str
    refuses: frozenset[str]


ONE_SHOT = Mode("a one-shot run (give -S NAME for a session)", frozenset({"continue", "tool_results"}))
FROM_MESSAGES = Mode("--messages (a conversation of its own)", frozenset({"session", "continue", "raw",
                                                                         "tool_results", "follow_up"}))
SESSION = Mode("--session (a session is a conversation)", frozenset({"raw", "follow_up"}))
CHAT = Mode("a chat (it is a session)", frozenset({"raw", "messages", "continue", "tool_results"}))
# --raw is no mode of its own but refuses as one: what only a chat template gives a prompt.
RAW = Mode("--raw (the prompt goes to the model as it is, without a chat template)",
           frozenset({"system", "chat_template", "think", "reasoning_budget", "tools", "tool_choice", "tool_results",
                      "follow_up"}))
BATCH = Mode("--batch (each row is answered in one reply, on a local model)",
             frozenset({"session", "continue", "messages", "attach", "tools", "tool_choice", "tool_results",
                        "reasoning_budget", "show_prompt", "server", "follow_up", "shown"}))


def check_options(asked: Mapping[str, Sequence[str]], mode: Mode, host: Capabilities | None = None, *,
                  show: bool = False, shown: Sequence[str] = ()) -> None:
    """Refuses, before anything is sent or loaded, what was asked (`TurnOptions.asked`: the
    options given, by feature) that the mode or the host (when it is known) cannot do: the
    mode's refusal names every option it refuses that was given. `shown`: the command's own
    options of what a reply shows on stderr (--stats, --quiet, --tools-debug), which a batch,
    one JSON line a row, has none of."""
    given = dict(asked)
    if show:
        given["show_prompt"] = ["--show-prompt"]
    if shown:
        given["shown"] = list(shown)
    for refusing in (mode, RAW) if given.get("raw") else (mode,):
        refused = [name for feature, names in given.items() if feature in refusing.refuses for name in names]
        if refused:
            named = ", ".join(refused[:-1]) + " and " + refused[-1] if len(refused) > 1 else refused[0]
            raise UsageError(refusal_words(named, refusing.where))
    if host is not None:
        for feature, names in given.items():
            if names and feature in FEATURES:
                host.require(feature)
