"""Every option of a turn, described once: its field and type, its command-line spellings and
help, its key in the config, whether a role, a batch row, the log of answers and the chat's
`/set` take it, the feature a mode or a host may refuse, its name in an OpenAI-style request, in
an Ollama-style one's options and in llama-server's, and its bounds.

What lists options is derived from this table: the command line's declarations (`cli/spec.py`),
the config's `[generation]` keys, roles, batch rows, the modes' refusals (`app/modes.py`), the
log's record, `/set`, the sampling parameters' checks (`sessions/params.py`) and the servers'
request fields. A sampling parameter is added here, to `engine.base.SamplerSettings` and to the
sampler that gives it to llama.cpp (`engine/sampler.py`).

Plain data: it imports nothing of quipu, so every layer may read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

MAX_SEED = 2**63 - 1
C_INT = 2**31 - 1  # what a C int holds: llama.cpp's counts are ints, past this a value wraps into another
MAX_WINDOW = 1 << 20  # the longest repeat-penalty window (llama.cpp keeps a ring of it: past this, memory)
MAX_STOPS = 16  # stop strings a turn may have (each is looked for after every token)
MAX_STOP_CHARS = 1000  # the longest stop string


@dataclass(frozen=True)
class Bounds:
    """The values an option takes, from `low` to `high` (an end `open` leaves it out), and what
    the rule adds in words ("0 is greedy")."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    note: str = ""

    def holds(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    @property
    def rule(self) -> str:
        """`must be ...`, as an error says it."""
        if self.high is None:
            said = f"more than {_number(self.low)}" if self.low_open else f"{_number(self.low)} or more"
        else:
            said = (f"in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}"
                    f"{')' if self.high_open else ']'}")
        return f"must be {said}" + (f" ({self.note})" if self.note else "")

    def refusal(self, name: str, value: float) -> str | None:
        """What a refusal of `value` as `name` says (None: it holds)."""
        return None if self.holds(value) else f"{name} {self.rule}, got {str(value)[:40]}"


def _number(value: float | None) -> str:
    return str(int(value)) if value is not None and float(value).is_integer() else f"{value:g}"


@dataclass(frozen=True)
class Option:
    """One option. `flags` are its command-line spellings (none: the config and `/set` alone
    set it, or it is the command's argument; `--x/--no-x` for a switch); `kind` its value's type
    (`bool` a flag's), `multiple` when it may be given more than once. `field` is where a turn's
    options hold it ("": the command's own, not the turn's); `refused` how a refusal names it
    (default: its first spelling); `feature` what a mode or a host may refuse (None: every one
    takes it). `group` places it in the command's help, with the options of its kind."""

    name: str
    flags: tuple[str, ...]
    help: str = ""
    kind: type = str
    multiple: bool = False
    metavar: str | None = None
    complete: str | None = None  # what the shell completes its value with: "model", "session" or "role"
    group: str = ""
    field: str | None = None  # default: `name`
    refused: str | None = None
    feature: str | None = None
    sampling: bool = False  # a sampling parameter (`sessions.params.SamplingParams`)
    config: type | None = None  # the type `[generation]` in the config reads it as (None: not there)
    role: bool = False
    row: bool = False  # a field of a batch's JSON row
    logged: bool = False  # kept by the log of answers (when given): it shapes the answer
    settable: type | None = None  # the type `/set` reads it as (None: not settable)
    request: str | None = None  # its name in an OpenAI-style request
    ollama: str | None = None  # its name in an Ollama-style request's options
    server: str | None = None  # its name in llama-server's /completion request
    anthropic: str | None = None  # its name in a request to Anthropic's Messages API
    responses: str | None = None  # its name in a request to OpenAI's Responses API
    bounds: Bounds | None = None
    most: int | None = None  # the most values an option given more than once takes (a request's list)
    section: str = "generation"  # the config's table that holds it (where `config` says it is there)

    @property
    def spelled(self) -> str:
        return self.refused or (self.flags[0] if self.flags else self.name)

    @property
    def held_as(self) -> str:
        """The field of a turn's options that holds it ("" for a command's own)."""
        return self.name if self.field is None else self.field

    @property
    def role_type(self) -> type:
        return tuple if self.multiple else self.kind


def _option(name: str, *flags: str, **described: Any) -> Option:
    return Option(name, flags, **described)


# Each feature a host may lack (`sessions.base.Capabilities`): what the command line calls it, and
# what the chat calls it.
FEATURES: dict[str, tuple[str, str]] = {
    "continue": ("--continue", "/continue"),
    "raw": ("--raw", "--raw"),
    "grammar": ("--schema and --grammar", "/schema and /grammar"),
    "logit_bias": ("--logit-bias", "--logit-bias"),
    "chat_template": ("--chat-template (the server renders its own)", "--chat-template"),
    "think": ("--think/--no-think and --reasoning-effort", "/think on|off and /think low|medium|high"),
    "reasoning_budget": ("--reasoning-budget", "/think budget"),
    "show_prompt": ("--show-prompt", "--show-prompt"),
    "tools": ("--functions, --tools and --mcp", "--functions, --tools and --mcp"),
    "context_settings": ("--ctx, --threads, --kv-type and --flash-attn (the server's own settings)", "--ctx"),
    "prompt_cache": ("the prompt cache", "the prompt cache"),
    "state_files": ("context state files", "context state files"),
    "slot_files": ("slot files", "slot files"),
    "media": ("an image or a recording (--attach)", "an image or a recording (/attach)"),
}


# In the order of each command's help, by group.
_ALL = (
    _option("prompt", help="The prompt. Piped stdin comes before it, then a blank line.", refused="a prompt",
            field=""),
    _option("role", "--role", "-R", help="Take this role's system prompt, model, prompt and options where the "
            "command line gives none (`quipu roles list`).", metavar="NAME", logged=True, complete="role"),
    _option("attach", "--attach", "-a", multiple=True, help="A file the message carries: text is given to the "
            "model with its name, before the message; an image or a recording to a model with a projector "
            "(repeatable).", metavar="FILE", feature="attach"),
    _option("mmproj", "--mmproj", help="The model's projector (an mmproj GGUF), for images and audio (default: the "
            "one beside the model).", metavar="FILE", feature="attach"),
    # ---- generation: what `run` and `chat` share, and the config's [generation] ----
    _option("model", "--model", "-m", help="A .gguf file or a known model name.", complete="model", metavar="MODEL",
            group="generation", role=True),
    _option("system", "--system", "-s", help="System prompt.", group="generation", feature="system", role=True,
            row=True),
    _option("max_tokens", "--max-tokens", "-n", kind=int, help="Most tokens to generate per reply (default: none, the reply ends by "
            "itself or where the context does).",
            group="generation", config=int, role=True, row=True, logged=True, settable=int,
            request="max_tokens", ollama="num_predict", anthropic="max_tokens", responses="max_output_tokens",
            bounds=Bounds(0, C_INT, low_open=True)),
    _option("temperature", "--temperature", "-t", kind=float, help="0 is greedy (default: 0.8).", group="generation",
            sampling=True, config=float, role=True, row=True, logged=True, settable=float, request="temperature",
            ollama="temperature", server="temperature", anthropic="temperature", responses="temperature",
            bounds=Bounds(0, note="0 is greedy")),
    _option("top_k", "--top-k", kind=int, help="Keep the k likeliest tokens; 0 is off (default: 40).",
            group="generation", sampling=True, config=int, role=True, row=True, logged=True, settable=int,
            request="top_k", ollama="top_k", server="top_k", anthropic="top_k", bounds=Bounds(0, C_INT, note="0 turns it off")),
    _option("top_p", "--top-p", kind=float, help="Nucleus sampling, in (0, 1] (default: 0.95).", group="generation",
            sampling=True, config=float, role=True, row=True, logged=True, settable=float, request="top_p",
            ollama="top_p", server="top_p", anthropic="top_p", responses="top_p", bounds=Bounds(0, 1, low_open=True)),
    _option("min_p", "--min-p", kind=float, help="Drop tokens below this share of the top one (default: 0.05).",
            group="generation", sampling=True, config=float, role=True, row=True, logged=True, settable=float,
            request="min_p", ollama="min_p", server="min_p", bounds=Bounds(0, 1, high_open=True)),
    _option("repeat_penalty", "--repeat-penalty", kind=float, help="1 is off (default: 1.1).", group="generation",
            sampling=True, config=float, role=True, row=True, logged=True, settable=float, request="repeat_penalty",
            ollama="repeat_penalty", server="repeat_penalty", bounds=Bounds(0, low_open=True, note="1 turns it off")),
    _option("presence_penalty", "--presence-penalty", kind=float, help="Lower a token that came already by this much, "
            "once (OpenAI's; 0 is off, the default).", group="generation", sampling=True, config=float, role=True,
            row=True, logged=True, settable=float, request="presence_penalty", ollama="presence_penalty",
            server="presence_penalty", bounds=Bounds(-2, 2, note="0 turns it off")),
    _option("frequency_penalty", "--frequency-penalty", kind=float, help="Lower a token by this much each time it "
            "came (OpenAI's; 0 is off, the default).", group="generation", sampling=True, config=float, role=True,
            row=True, logged=True, settable=float, request="frequency_penalty", ollama="frequency_penalty",
            server="frequency_penalty", bounds=Bounds(-2, 2, note="0 turns it off")),
    _option("repeat_last_n", kind=int, sampling=True, config=int, settable=int, server="repeat_last_n",
            ollama="repeat_last_n", bounds=Bounds(0, MAX_WINDOW, note="the tokens a repeat penalty looks back on")),
    _option("seed", "--seed", kind=int, help="Random seed: the same seed, the same reply (default: a random one).",
            group="generation", sampling=True, config=int, role=True, row=True, settable=int, request="seed",
            ollama="seed", bounds=Bounds(0, MAX_SEED)),
    _option("stop", "--stop", multiple=True, help="Stop at this text (repeatable); it is not printed.",
            group="generation", config=tuple, role=True, row=True, logged=True, settable=str, request="stop",
            ollama="stop", anthropic="stop_sequences", most=MAX_STOPS),
    _option("ctx", "--ctx", help="Context size in tokens, or auto: the model's whole training length as far as "
            "memory allows (default: the model's, at most 4096).", metavar="N|auto", group="generation",
            feature="context_settings", config=object, role=True, logged=True),
    _option("threads", "--threads", kind=int, help="CPU threads, fixed (default: quipu follows the machine's load, up "
            "to one a physical performance core this process may use).",
            group="generation", feature="context_settings", config=int, role=True, bounds=Bounds(0, low_open=True)),
    _option("kv_type", "--kv-type", help="KV cache type: f16, or q8_0 for half-size snapshots.", metavar="f16|q8_0",
            group="generation", feature="context_settings", role=True, logged=True),
    _option("flash_attn", "--flash-attn", help="Flash attention: auto (the default: off on the CPU alone, so that "
            "the thread count changes no bit; llama.cpp's choice on a GPU), on or off (a session remembers it).",
            metavar="auto|on|off", group="generation", feature="context_settings",
            role=True),
    _option("swa_full", "--swa-full", kind=bool, help="Keep every position in a sliding-window model's window "
            "layers (Gemma 3, GPT-OSS), not a ring of the window: far more memory (a session remembers it).",
            group="generation", feature="context_settings", config=bool),
    _option("gpu_layers", "--gpu-layers", "-ngl", help="Layers on the GPU: a number, auto (as many as fit in its "
            "free memory, the default) or all (refused if they do not fit).", metavar="N|auto|all",
            group="generation", feature="context_settings", config=object),
    _option("gpu_memory", "--gpu-memory", help="Take at most this much of a GPU's memory (a shared GPU).",
            metavar="SIZE", group="generation", feature="context_settings", config=object),
    _option("device", "--device", help="The GPUs to use, by name as `quipu doctor` lists them, comma-separated; "
            "none keeps the model on the CPU.", metavar="LIST", group="generation", feature="context_settings",
            config=str),
    # ----
    _option("raw", "--raw", kind=bool, help="Plain completion, without the chat template.", feature="raw", role=True,
            logged=True),
    _option("session", "--session", "-S", help="Continue or create this named session.", complete="session",
            metavar="NAME", feature="session"),
    _option("branch", "--branch", kind=int, help="With --session: go on from this branch of it (`quipu sessions "
            "tree NAME` shows them), which becomes its current one.", metavar="ID", feature="branch"),
    _option("resume", "--resume", "-r", kind=bool, help="Resume the most recently used session.", field=""),
    _option("markdown", "--markdown/--no-markdown", kind=bool, help="Render replies as Markdown as they stream "
            "(the config's [chat] markdown says which by default).", field=""),
    # ---- logging: the log of answers ----
    _option("no_log", "--no-log", kind=bool, help="Write nothing of this answer to the log of answers (quipu logs).",
            group="logging"),
    _option("follow_up", "--follow-up", "-F", kind=bool, help="Go on with the last logged conversation (the last "
            "answer and those it followed up), as if it had been a session.", group="logging", feature="follow_up"),
    _option("cid", "--cid", help="Go on with the logged conversation of this answer (an id `quipu logs` lists).",
            metavar="ID", group="logging", feature="follow_up"),
    # ----
    _option("continue_reply", "--continue", kind=bool, help="With --session and no prompt: keep generating the last "
            "reply.", feature="continue"),
    # ---- shaping: the template, reasoning and constraints ----
    _option("chat_template", "--chat-template", help="A Jinja chat template file to use in place of the model's (a "
            "session remembers it).", metavar="FILE", group="shaping", feature="chat_template", role=True,
            logged=True),
    _option("think", "--think/--no-think", kind=bool, help="Turn a thinking model's reasoning on or off, where its "
            "template has the switch.", group="shaping", feature="think", role=True, logged=True),
    _option("reasoning_budget", "--reasoning-budget", kind=int, help="At most N tokens of reasoning: then the model "
            "is made to close it and answer; 0 answers without reasoning, -1 drops a session's limit.", metavar="N",
            group="shaping", feature="reasoning_budget", role=True, logged=True),
    _option("reasoning_effort", "--reasoning-effort", help="How hard a model whose template takes it (GPT-OSS) "
            "reasons.", metavar="low|medium|high", group="shaping", feature="think", role=True, logged=True,
            request="reasoning_effort"),
    _option("schema", "--schema", help="Answer as JSON that validates against this JSON Schema (inline, or "
            "@file.json; off drops a session's).", metavar="SCHEMA", group="shaping", feature="grammar", role=True,
            row=True, logged=True),
    _option("grammar", "--grammar", help="Answer as this grammar file allows: GBNF (llama.cpp's format), or Lark for "
            "a FILE.lark (off drops a session's).", metavar="FILE", group="shaping", feature="grammar", role=True,
            logged=True),
    _option("regex", "--regex", help="Answer with text that this regular expression matches in full (off drops a "
            "session's).", metavar="PATTERN", group="shaping", feature="grammar", role=True, logged=True),
    _option("logit_bias", "--logit-bias", multiple=True, help="TOKEN=BIAS added to a token's logit, TOKEN an id or a "
            "text (each of its tokens); -inf bans it (repeatable).", metavar="TOKEN=BIAS", group="shaping",
            feature="logit_bias", role=True, logged=True),
    # ---- tools ----
    _option("functions", "--functions", multiple=True, help="A Python file whose public functions the model may "
            "call (name, docstring and type hints define each; repeatable).", metavar="FILE.py", group="tools",
            feature="tools", role=True, logged=True),
    _option("tools_file", "--tools", help="Tool definitions (OpenAI's tools JSON) that the caller runs: the reply "
            "stops at a call (finish_reason tool_calls).", metavar="FILE.json", group="tools", feature="tools",
            role=True, logged=True),
    _option("tool_results", "--tool-result", multiple=True, help="With -S: what a call returned, ID=TEXT or ID=@FILE "
            "(repeatable); the model goes on from it.", metavar="ID=TEXT", group="tools", feature="tool_results"),
    _option("tool_choice", "--tool-choice", help="auto (default), required, none, or a tool's name.",
            metavar="CHOICE", group="tools", feature="tool_choice", role=True, logged=True),
    _option("chain_limit", "--chain-limit", kind=int, help="The most rounds of calls in one turn (default 5).",
            group="tools", feature="tools", role=True),
    _option("tool_output_max", "--tool-output-max", kind=int, help="Characters of a tool's result the model is given "
            "(default 8000; the rest is cut, with a note).", group="tools", feature="tools", role=True),
    _option("tool_timeout", "--tool-timeout", kind=float, help="Seconds a call may run before it is given up "
            "(default 60).", group="tools", feature="tools", role=True),
    _option("mcp", "--mcp", multiple=True, help="An MCP server whose tools the model may call, by name: [mcp.NAME] in "
            "the config, or a server of --mcp-config (repeatable).", metavar="NAME", group="tools", feature="tools",
            role=True, logged=True),
    _option("mcp_config", "--mcp-config", help="A JSON file of MCP servers in the mcpServers shape other tools use.",
            metavar="FILE.json", group="tools", feature="tools"),
    _option("yes", "--yes", kind=bool, help="Run every call the model makes without asking.", group="tools",
            feature="tools"),
    # ----
    _option("messages", "--messages", help="Go on from this conversation (OpenAI-style messages JSON, tool calls and "
            "results included): reply to its last message, or --show-prompt it.", metavar="FILE.json",
            feature="messages"),
    _option("tools_debug", "--tools-debug", kind=bool, help="Show each call and its result, raw, on stderr.",
            field="", feature="shown"),
    _option("quiet", "--quiet", "-q", kind=bool, help="Show no tool calls and no reasoning on stderr (errors still "
            "show).", field="", feature="shown"),
    _option("no_cache", "--no-cache", kind=bool, help="Neither use nor fill the prompt cache for this run."),
    _option("show", "--show-prompt", kind=bool, help="Print the exact context that would be fed (with --json: its "
            "token ids, and how many a session reuses), and generate nothing.", field="", feature="show_prompt"),
    _option("as_json", "--json", kind=bool, help="Print one JSON object instead of streaming.", field=""),
    _option("stats", "--stats", kind=bool, help="Print timings and token counts on stderr.", field="",
            feature="shown"),
    _option("hide_thinking", "--hide-thinking", kind=bool, help="Do not show a thinking model's reasoning (/think "
            "shows it again).", field=""),
    _option("verbose", "--verbose", kind=bool, help="Show llama.cpp's own log on stderr."),
    _option("url", "--url", help="Use the model on this OpenAI-compatible server (llama-server, vLLM, Ollama, LM "
            "Studio); -m names one of its models (default: QUIPU_URL, or [remote] url in the config).", metavar="URL",
            field="server", refused="a server (--url, QUIPU_URL or the config's [remote] url)", feature="server"),
    _option("batch", "--batch", help="Answer every row of this file side by side (JSON lines, or one prompt per "
            "line; - for stdin); prints one JSON line per row, in input order.", metavar="FILE", field=""),
    _option("parallel", "--parallel", kind=int, help="Sequences decoded side by side on one context: with --batch, "
            "its rows (default: 4 per CPU, from 4 to 16); for `quipu serve`, the requests answered at once, each "
            "conversation its own --ctx (default 1: every answer a lone run's to the last bit).", metavar="N",
            field="", group="serve", config=int, section="serve"),
    # ---- serve: `quipu serve`'s own, which the config's [serve] may give too ----
    _option("models", "--model", "-m", multiple=True, help="A model to serve (a .gguf file or a known model name; "
            "again for more): the first is the default of a request that names none. Any model `quipu models list` "
            "names is served by its name too.", metavar="MODEL", complete="model", field="", group="serve",
            config=tuple, section="serve"),
    _option("host", "--host", help="The address to listen on (default 127.0.0.1; anything but loopback needs "
            "--api-key).", field="", group="serve", config=str, section="serve"),
    _option("port", "--port", kind=int, help="The port to listen on (default 8080).", field="", group="serve",
            config=int, section="serve", bounds=Bounds(1, 65535)),
    _option("api_key", "--api-key", help="Answer only requests that bring this key (Authorization: Bearer KEY).",
            metavar="KEY", field="", group="serve"),
    _option("api_key_env", help="The environment variable the server's key is read from (the config's alone).",
            field="", group="serve", config=str, section="serve"),
    _option("keep_alive", "--keep-alive", help="How long a model stays loaded after its last request: 5m (the "
            "default), 90s, 1h, 0 (unloaded at once), -1 (for good).", metavar="DURATION", field="", group="serve",
            config=object, section="serve"),
    # ---- launch: `quipu launch`'s own ----
    _option("show_only", "--print", kind=bool, help="Print how to point the agent at a quipu server (its environment "
            "and command), and start nothing.", field="", group="launch"),
    _option("cors", "--cors", multiple=True, help="Let web pages of this origin call the server (https://host:port; "
            "again for more).", metavar="ORIGIN", field="", group="serve", config=tuple, section="serve"),
)

OPTIONS: Mapping[str, Option] = {o.name: o for o in _ALL}


def group(name: str) -> dict[str, Option]:
    """The options of a group, in order."""
    return {o.name: o for o in _ALL if o.group == name}


# The sampling parameters, each with its type: what the config, the command line's overrides,
# batch rows and `/set` read as numbers.
SAMPLING: Mapping[str, type] = {o.name: o.kind for o in _ALL if o.sampling}
# What [generation] in the config may set, each as the config's reader checks it.
CONFIG: Mapping[str, type] = {o.name: o.config for o in _ALL if o.config is not None and o.section == "generation"}
# What [serve] may set: `quipu serve`'s own options.
SERVE: Mapping[str, type] = {o.name: o.config for o in _ALL if o.config is not None and o.section == "serve"}
# What `/set` changes for the next replies: the sampling parameters, then the rest.
SETTABLE: Mapping[str, type] = {**{o.name: o.settable for o in _ALL if o.settable is not None and o.sampling},
                                **{o.name: o.settable for o in _ALL if o.settable is not None and not o.sampling}}
# What a role may set (besides its prompt), each by the type a role's file holds it as.
ROLE: Mapping[str, type] = {o.name: o.role_type for o in _ALL if o.role}
# What a batch's JSON row may hold besides its prompt or messages and its id.
ROW: frozenset[str] = frozenset(o.name for o in _ALL if o.row)
# What the log of answers keeps of a turn's options (those given).
LOGGED: tuple[str, ...] = tuple(o.name for o in _ALL if o.logged)
# The sampling parameters a chat API request takes, under its names.
REQUEST: Mapping[str, str] = {o.name: o.request for o in _ALL if o.sampling and o.request is not None}
# The sampler chain's settings in llama-server's /completion request, under its names.
SERVER: Mapping[str, str] = {o.name: o.server for o in _ALL if o.server is not None}
