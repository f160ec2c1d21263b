"""Which options work where: every option of `run` and `chat` asks for a feature (the registry,
`quipu.options.OPTIONS`, says which); what each mode of a command (a one-shot run, a run that
goes on from a messages file, a session's turn, a chat, a batch) refuses, by feature; and, for what a host
cannot do, its `Capabilities` (`sessions/base.py`, by the same features). Both are refused
before anything is loaded or sent, in one wording: "X cannot be used with Y". What a command's
options ask for is `asked_of`, read from the registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Mapping, Sequence

from quipu.errors import UsageError
from quipu.options import FEATURES, OPTIONS
from quipu.sessions.base import Capabilities, refusal_words


def mode_of(given: Collection[str]) -> Mode:
    """The mode of a `quipu run` turn, by the fields its options give (`TurnOptions.given`)."""
    if "messages" in given:
        return FROM_MESSAGES
    return SESSION if "session" in given else ONE_SHOT


def asked_of(given: Collection[str], own: Iterable[str] = ()) -> dict[str, list[str]]:
    """The options of the fields given (`TurnOptions.given`) and the command's `own` given (by
    name), by the feature a mode or a host may refuse, spelled."""
    own = set(own)
    out: dict[str, list[str]] = {}
    for name, option in OPTIONS.items():
        if option.feature is not None and (name in own or option.held_as in given):
            out.setdefault(option.feature, []).append(option.spelled)
    return out

@dataclass(frozen=True)
class Mode:
    """A way a command runs turns, and the options it refuses (`where`: how a refusal names it)."""

    where: str
    refuses: frozenset[str]


ONE_SHOT = Mode("a one-shot run (-S NAME goes on with a session; -F, with the last answer)",
                frozenset({"continue", "tool_results", "branch"}))
FROM_MESSAGES = Mode("--messages (a conversation of its own)", frozenset({"session", "branch", "continue", "raw",
                                                                         "tool_results", "follow_up"}))
SESSION = Mode("--session (a session is a conversation)", frozenset({"raw", "follow_up"}))
CHAT = Mode("a chat (it is a session)", frozenset({"raw", "messages", "continue", "tool_results"}))
# --raw is no mode of its own but refuses as one: what only a chat template gives a prompt.
RAW = Mode("--raw (the prompt goes to the model as it is, without a chat template)",
           frozenset({"system", "chat_template", "think", "reasoning_budget", "tools", "tool_choice", "tool_results",
                      "follow_up"}))
BATCH = Mode("--batch (each row is answered in one reply, on a local model)",
             frozenset({"session", "branch", "continue", "messages", "attach", "tools", "tool_choice", "tool_results",
                        "reasoning_budget", "show_prompt", "server", "follow_up", "shown"}))


def check_options(asked: Mapping[str, Sequence[str]], mode: Mode, host: Capabilities | None = None) -> None:
    """Refuses, before anything is sent or loaded, what was asked (`asked_of`: the options
    given, by feature) that the mode or the host (when it is known) cannot do: the mode's
    refusal names every option it refuses that was given."""
    given = dict(asked)
    for refusing in (mode, RAW) if given.get("raw") else (mode,):
        refused = [name for feature, names in given.items() if feature in refusing.refuses for name in names]
        if refused:
            named = ", ".join(refused[:-1]) + " and " + refused[-1] if len(refused) > 1 else refused[0]
            raise UsageError(refusal_words(named, refusing.where))
    if host is not None:
        for feature, names in given.items():
            if names and feature in FEATURES:
                host.require(feature)
