"""Options as plain data, and a parser for `quipu run` that needs no Typer.

A whole `quipu run` is a short process, and Typer (with the pydantic it coerces every value
through) costs about a fifth of it. So the options of `run` and `chat` are declared here once,
as data: `options.py` turns them into Typer parameters (help, completion, errors), and
`parse` reads a plain, well-formed `quipu run` command line from the same declarations.
`parse` answers None for anything it is not sure of (help, a value that needs converting
beyond plain digits, an unknown option, `--`), and the command line then goes to Typer,
which gives the answer or the error message it always gave.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from quipu.app.environment import Environment
    from quipu.app.modes import Mode
    from quipu.app.roles import Role
    from quipu.app.turn_options import TurnOptions


def complete_model(incomplete: str) -> list[str]:
    from quipu.cli.completion import complete_models

    return complete_models(incomplete)


def complete_session(incomplete: str) -> list[str]:
    from quipu.cli.completion import complete_sessions

    return complete_sessions(incomplete)


@dataclass(frozen=True)
class Opt:
    """One option: its spellings (a `--x/--no-x` pair for an on/off switch), the type of its
    value (`bool` for a flag), and whether it may be given more than once."""

    decls: tuple[str, ...]
    type: type
    help: str
    multiple: bool = False
    complete: Optional[Callable[[str], list[str]]] = None
    metavar: str | None = None  # what help shows for the value (default: by its type)

    @property
    def shown(self) -> str:
        """The value's name in help: N for a whole number, NUMBER, TEXT, or the declared one."""
        return self.metavar or {int: "N", float: "NUMBER"}.get(self.type, "TEXT")

    @property
    def default(self) -> list[str] | bool | None:
        if self.multiple:
            return []
        return False if self.type is bool and not self.switch else None

    @property
    def switch(self) -> bool:
        return any("/" in d for d in self.decls)


@dataclass(frozen=True)
class Arg:
    """The one positional argument of a command, optional."""

    help: str


def opt(*decls: str, type: type = str, help: str, multiple: bool = False, complete: Callable[[str], list[str]] | None = None,
        metavar: str | None = None) -> Opt:
    return Opt(decls, type, help, multiple, complete, metavar)


def flag(*decls: str, help: str) -> Opt:
    return Opt(decls, bool, help)


# ---- shared by `run` and `chat` (and some by `embed`) ---------------------------------------

MODEL = opt("--model", "-m", help="A .gguf file or a known model name.", complete=complete_model, metavar="MODEL")
SESSION = opt("--session", "-S", help="Continue or create this named session.", complete=complete_session,
              metavar="NAME")
SYSTEM = opt("--system", "-s", help="System prompt.")
MAX_TOKENS = opt("--max-tokens", "-n", type=int, help="Most tokens to generate per reply (default: 512).")
TEMPERATURE = opt("--temperature", "-t", type=float, help="0 is greedy (default: 0.8).")
TOP_K = opt("--top-k", type=int, help="Keep the k likeliest tokens; 0 is off (default: 40).")
TOP_P = opt("--top-p", type=float, help="Nucleus sampling, in (0, 1] (default: 0.95).")
MIN_P = opt("--min-p", type=float, help="Drop tokens below this share of the top one (default: 0.05).")
REPEAT_PENALTY = opt("--repeat-penalty", type=float, help="1 is off (default: 1.1).")
SEED = opt("--seed", type=int, help="Random seed: the same seed, the same reply (default: a random one).")
STOP = opt("--stop", multiple=True, help="Stop at this text (repeatable); it is not printed.")
CTX = opt("--ctx", help="Context size in tokens, or auto: the model's whole training length as far as memory "
                        "allows (default: the model's, at most 4096).", metavar="N|auto")
THREADS = opt("--threads", type=int, help="CPU threads (default: the CPUs this process may use).")
KV_TYPE = opt("--kv-type", help="KV cache type: f16, or q8_0 for half-size snapshots.", metavar="f16|q8_0")
FLASH_ATTN = opt("--flash-attn", help="Flash attention: auto (llama.cpp's choice, the default), on or off (a "
                                      "session remembers it).", metavar="auto|on|off")
SWA_FULL = flag("--swa-full", help="Keep every position in a sliding-window model's window layers (Gemma 3, GPT-OSS), "
                                   "not a ring of the window: far more memory (a session remembers it).")
GPU_LAYERS = opt("--gpu-layers", "-ngl", help="Layers on the GPU: a number, auto (as many as fit in its free memory, "
                                              "the default) or all (refused if they do not fit).", metavar="N|auto|all")
GPU_MEMORY = opt("--gpu-memory", help="Take at most this much of a GPU's memory (a shared GPU).", metavar="SIZE")
DEVICE = opt("--device", help="The GPUs to use, by name as `quipu doctor` lists them, comma-separated; none keeps "
                              "the model on the CPU.", metavar="LIST")
VERBOSE = flag("--verbose", help="Show llama.cpp's own log on stderr.")
CHAT_TEMPLATE = opt("--chat-template", help="A Jinja chat template file to use in place of the model's (a session "
                                            "remembers it).", metavar="FILE")
SCHEMA = opt("--schema", help="Answer as JSON that validates against this JSON Schema (inline, or @file.json; off "
                              "drops a session's).", metavar="SCHEMA")
GRAMMAR = opt("--grammar", help="Answer as this grammar file allows: GBNF (llama.cpp's format), or Lark for a "
                                "FILE.lark (off drops a session's).", metavar="FILE")
REGEX = opt("--regex", help="Answer with text that this regular expression matches in full (off drops a "
                            "session's).", metavar="PATTERN")
LOGIT_BIAS = opt("--logit-bias", multiple=True, help="TOKEN=BIAS added to a token's logit, TOKEN an id or a "
                                                     "one-token text; -inf bans it (repeatable).",
                 metavar="TOKEN=BIAS")
URL = opt("--url", help="Use the model on this OpenAI-compatible server (llama-server, vLLM, Ollama, LM Studio); "
                        "-m names one of its models (default: QUIPU_URL, or [remote] url in the config).",
          metavar="URL")
ATTACH = opt("--attach", "-a", multiple=True, help="A file the message carries: text is given to the model with its "
                                                 "name, before the message; an image or a recording to a model "
                                                 "with a projector (repeatable).", metavar="FILE")
MMPROJ = opt("--mmproj", help="The model's projector (an mmproj GGUF), for images and audio (default: the one beside "
                              "the model).", metavar="FILE")
THINK = Opt(("--think/--no-think",), bool, "Turn a thinking model's reasoning on or off, where its template has "
                                           "the switch.")

# The log of answers: whether this one is written, and a follow-up to a logged conversation.
LOGGING = {"no_log": flag("--no-log", help="Write nothing of this answer to the log of answers (quipu logs)."),
           "follow_up": flag("--follow-up", "-F", help="Go on with the last logged conversation (the last answer "
                                                     "and those it followed up), as if it had been a session."),
           "cid": opt("--cid", help="Go on with the logged conversation of this answer (an id `quipu logs` "
                                    "lists).", metavar="ID")}

ROLE = opt("--role", "-R", help="Take this role's system prompt, model, prompt and options where the command line "
                               "gives none (`quipu roles list`).", metavar="NAME")

# The options of a turn that `run` and `chat` share, in the order their help lists them.
GENERATION = {"model": MODEL, "system": SYSTEM, "max_tokens": MAX_TOKENS, "temperature": TEMPERATURE,
              "top_k": TOP_K, "top_p": TOP_P, "min_p": MIN_P, "repeat_penalty": REPEAT_PENALTY, "seed": SEED,
              "stop": STOP, "ctx": CTX, "threads": THREADS, "kv_type": KV_TYPE,
              "flash_attn": FLASH_ATTN, "swa_full": SWA_FULL, "gpu_layers": GPU_LAYERS, "gpu_memory": GPU_MEMORY, "device": DEVICE}
REASONING_BUDGET = opt("--reasoning-budget", type=int, help="At most N tokens of reasoning: then the model is made "
                                                         "to close it and answer; 0 answers without reasoning, -1 "
                                                         "drops a session's limit.", metavar="N")
REASONING_EFFORT = opt("--reasoning-effort", help="How hard a model whose template takes it (GPT-OSS) reasons.",
                       metavar="low|medium|high")
SHAPING = {"chat_template": CHAT_TEMPLATE, "think": THINK, "reasoning_budget": REASONING_BUDGET,
           "reasoning_effort": REASONING_EFFORT, "schema": SCHEMA, "grammar": GRAMMAR,
           "regex": REGEX, "logit_bias": LOGIT_BIAS}

FUNCTIONS = opt("--functions", multiple=True, help="A Python file whose public functions the model may call "
                                                  "(name, docstring and type hints define each; repeatable).",
                metavar="FILE.py")
TOOLS_FILE = opt("--tools", help="Tool definitions (OpenAI's tools JSON) that the caller runs: the reply stops at a "
                                 "call (finish_reason tool_calls).", metavar="FILE.json")
TOOL_RESULT = opt("--tool-result", multiple=True, help="With -S: what a call returned, ID=TEXT or ID=@FILE "
                                                       "(repeatable); the model goes on from it.", metavar="ID=TEXT")
TOOL_CHOICE = opt("--tool-choice", help="auto (default), required, none, or a tool's name.", metavar="CHOICE")
CHAIN_LIMIT = opt("--chain-limit", type=int, help="The most rounds of calls in one turn (default 5).")
TOOL_OUTPUT_MAX = opt("--tool-output-max", type=int, help="Characters of a tool's result the model is given "
                                                          "(default 8000; the rest is cut, with a note).")
TOOL_TIMEOUT = opt("--tool-timeout", type=float, help="Seconds a call may run before it is given up (default 60).")
MCP = opt("--mcp", multiple=True, help="An MCP server whose tools the model may call, by name: [mcp.NAME] in the "
                                      "config, or a server of --mcp-config (repeatable).", metavar="NAME")
MCP_CONFIG = opt("--mcp-config", help="A JSON file of MCP servers in the mcpServers shape other tools use.",
                 metavar="FILE.json")
YES = flag("--yes", help="Run every call the model makes without asking.")
MESSAGES = opt("--messages", help="Go on from this conversation (OpenAI-style messages JSON, tool calls and results "
                                  "included): reply to its last message, or --show-prompt it.", metavar="FILE.json")
TOOLS = {"functions": FUNCTIONS, "tools_file": TOOLS_FILE, "tool_results": TOOL_RESULT, "tool_choice": TOOL_CHOICE,
         "chain_limit": CHAIN_LIMIT, "tool_output_max": TOOL_OUTPUT_MAX, "tool_timeout": TOOL_TIMEOUT, "mcp": MCP, "mcp_config": MCP_CONFIG,
         "yes": YES}

# ---- the fast parser -----------------------------------------------------------------------

_INT = re.compile(r"[+-]?\d{1,18}")
_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _convert(spec: Opt, text: str) -> Any:
    if spec.type is int:
        return int(text) if _INT.fullmatch(text) else None
    if spec.type is float:
        return float(text) if _FLOAT.fullmatch(text) else None
    return text


def parse(params: dict[str, Opt | Arg], args: list[str]) -> dict[str, Any] | None:
    """The parameters a plain command line gives, by name (defaults for the rest); None when
    Typer should read it instead."""
    given: dict[str, Any] = {name: (None if isinstance(spec, Arg) else spec.default) for name, spec in params.items()}
    spellings: dict[str, tuple[str, Opt, bool]] = {}
    positional: str | None = None
    for name, spec in params.items():
        if isinstance(spec, Arg):
            positional = name
            continue
        for decl in spec.decls:
            on, _, off = decl.partition("/")
            spellings[on] = (name, spec, True)
            if off:
                spellings[off] = (name, spec, False)
    rest = list(args)
    seen_positional = False
    while rest:
        word = rest.pop(0)
        if word.startswith("-") and word != "-":
            spelling, eq, inline = word.partition("=")
            if eq and not spelling.startswith("--"):
                return None
            found = spellings.get(spelling)
            if found is None:
                return None  # help, `--`, a short option run together with its value, a mistake
            name, spec, switched_on = found
            if spec.type is bool:
                if eq:
                    return None
                given[name] = switched_on
                continue
            if not eq:
                if not rest or rest[0].startswith("-"):
                    return None
                inline = rest.pop(0)
            value = _convert(spec, inline)
            if value is None:
                return None
            if spec.multiple:
                given[name] = [*given[name], value]
            else:
                given[name] = value
        else:
            if positional is None or seen_positional:
                return None
            given[positional] = word
            seen_positional = True
    return given


def habits(given: dict[str, Any]) -> list[str]:
    """Warnings for values that look like another tool's habit: `-t 8`, llama.cpp's threads, is a
    temperature here."""
    t = given.get("temperature")
    if isinstance(t, (int, float)) and t >= 3 and float(t).is_integer():
        return [f"-t {t:g} is the temperature here, which makes near-random text; the threads are --threads"]
    return []


def turn_options(given: dict[str, Any], env: Environment) -> TurnOptions:
    """A TurnOptions from a command's parameters, by name: each option of a turn is a field of
    TurnOptions under its parameter's name (a repeatable one as a tuple), but --url, which is
    settled into the server the command talks to (with QUIPU_URL, or the config's [remote] url);
    the rest are the command's own."""
    import dataclasses

    from quipu.app.choose import server_of
    from quipu.app.turn_options import TurnOptions

    names = {f.name for f in dataclasses.fields(TurnOptions)}
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items() if k in names}
    return TurnOptions(**fields, server=server_of(given.get("url"), given.get("model"), env))


def turn_options_of_role(given: dict[str, Any], env: Environment,
                         mode: Mode | None) -> tuple[TurnOptions, Role | None]:
    """`turn_options`, with the values of the role that --role names where the parameters give
    none (roles are read only then); `mode` is the command's, else the options' own."""
    opts = turn_options(given, env)
    if opts.role is None:
        return opts, None
    from quipu.app.roles import with_role

    return with_role(opts, opts.role, env, mode)
