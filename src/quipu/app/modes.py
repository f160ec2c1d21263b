"""Which options work where, in one table: every option of `run` and `chat` (`OPTIONS`), by the
feature it asks for; what each mode of a command (a one-shot run, a run that goes on from a
messages file, a session's turn, a chat, a batch) refuses, by feature; and, for what a host
cannot do, its `Capabilities` (`sessions/base.py`, by the same features). Both are refused
before anything is loaded or sent, in one wording: "X cannot be used with Y". What a command's
options ask for is `asked_of`, read from this table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Mapping, Sequence

from quipu.errors import UsageError
from quipu.sessions.base import FEATURES, Capabilities, refusal_words


@dataclass(frozen=True)
class Option:
    """An option of `run` or `chat`: how a refusal spells it, the feature it asks for (a mode's
    or a host's to refuse; None: every mode and host takes it), and the field of `TurnOptions`
    that holds it where that is not its name. One that is no field of theirs is a command's own,
    which the command says it was given (`asked_of(own=...)`)."""

    spelled: str
    feature: str | None = None
    field: str | None = None


# Every option of `run` and `chat`, by its parameter's name (tests/test_cli_fast.py holds the
# table to the commands' parameters). Options of the same feature are refused together.
OPTIONS: dict[str, Option] = {
    # What the reply is to: each command's own.
    "prompt": Option("a prompt"),
    "model": Option("--model"),
    "role": Option("--role"),
    "url": Option("a server (--url, QUIPU_URL or the config's [remote] url)", "server", "server"),
    "session": Option("--session", "session"),
    "resume": Option("--resume"),
    "continue_reply": Option("--continue", "continue"),
    "messages": Option("--messages", "messages"),
    "follow_up": Option("--follow-up", "follow_up"),
    "cid": Option("--cid", "follow_up"),
    "raw": Option("--raw", "raw"),
    "system": Option("--system", "system"),
    "chat_template": Option("--chat-template", "chat_template"),
    "attach": Option("--attach", "attach"),
    "mmproj": Option("--mmproj", "attach"),
    "batch": Option("--batch"),
    "parallel": Option("--parallel"),
    # Sampling: every mode and host takes them.
    "temperature": Option("--temperature"),
    "top_k": Option("--top-k"),
    "top_p": Option("--top-p"),
    "min_p": Option("--min-p"),
    "repeat_penalty": Option("--repeat-penalty"),
    "seed": Option("--seed"),
    "max_tokens": Option("--max-tokens"),
    "stop": Option("--stop"),
    "logit_bias": Option("--logit-bias", "logit_bias"),
    "schema": Option("--schema", "grammar"),
    "grammar": Option("--grammar", "grammar"),
    "regex": Option("--regex", "grammar"),
    # Reasoning.
    "think": Option("--think/--no-think", "think"),
    "reasoning_effort": Option("--reasoning-effort", "think"),
    "reasoning_budget": Option("--reasoning-budget", "reasoning_budget"),
    # Tools.
    "functions": Option("--functions", "tools"),
    "tools_file": Option("--tools", "tools"),
    "mcp": Option("--mcp", "tools"),
    "mcp_config": Option("--mcp-config", "tools"),
    "yes": Option("--yes", "tools"),
    "chain_limit": Option("--chain-limit", "tools"),
    "tool_timeout": Option("--tool-timeout", "tools"),
    "tool_output_max": Option("--tool-output-max", "tools"),
    "tool_choice": Option("--tool-choice", "tool_choice"),
    "tool_results": Option("--tool-result", "tool_results"),
    # The context and where the model runs: a local model's.
    "ctx": Option("--ctx", "context_settings"),
    "threads": Option("--threads", "context_settings"),
    "kv_type": Option("--kv-type", "context_settings"),
    "flash_attn": Option("--flash-attn", "context_settings"),
    "swa_full": Option("--swa-full", "context_settings"),
    "gpu_layers": Option("--gpu-layers", "context_settings"),
    "gpu_memory": Option("--gpu-memory", "context_settings"),
    "device": Option("--device", "context_settings"),
    # What is kept: a run without the prompt cache (nothing to leave out where there is none),
    # an answer left out of the log.
    "no_cache": Option("--no-cache"),
    "no_log": Option("--no-log"),
    # What is shown: each command's own.
    "show": Option("--show-prompt", "show_prompt"),
    "as_json": Option("--json"),
    "stats": Option("--stats", "shown"),
    "quiet": Option("--quiet", "shown"),
    "tools_debug": Option("--tools-debug", "shown"),
    "verbose": Option("--verbose"),
    "markdown": Option("--markdown"),
    "hide_thinking": Option("--hide-thinking"),
}


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
        if option.feature is not None and (name in own or (option.field or name) in given):
            out.setdefault(option.feature, []).append(option.spelled)
    return out

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
