"""What the user asked for (`TurnOptions`), turned into settings: sampling parameters (with the
grammar of --schema, --grammar or --regex, and --logit-bias made token ids), context settings,
the reply's length, the system prompt, the chat template and its variables: command line >
session > config file > built-in defaults."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from quipu.engine.settings import (
    AUTO,
    CTX_AUTO,
    ContextSettings,
    Offload,
    check_context_bounds,
    parse_ctx,
    parse_layers,
    parse_size,
)
from quipu.engine.base import UNTIL_IT_ENDS
from quipu.errors import TemplateError, UsageError
from quipu.options import LOGGED, OPTIONS, SAMPLING
from quipu.sessions.base import LOCAL, Capabilities
from quipu.sessions.params import SamplingParams
from quipu.sessions.prompt import Vocabulary
from quipu.sessions.stops import read_escapes
from quipu.sessions.template import ChatTemplate

from quipu.app.environment import GPU_ENVIRON, Environment
from quipu.app.user_files import read_text_file

if TYPE_CHECKING:
    from quipu.engine.grammar import Grammar
    from quipu.engine.http import ServerSettings
    from quipu.engine.llama import LlamaBackend
    from quipu.engine.model import LlamaModel
    from quipu.sessions.conversation import Conversation



@dataclass(frozen=True)
class ToolOptions:
    """The options of a turn's tools: Python files whose functions the model may call,
    definitions the caller runs, the results of such calls (ID=TEXT), and how the loop goes."""

    functions: tuple[str, ...] = ()
    tools_file: str | None = None
    tool_results: tuple[str, ...] = ()
    tool_choice: str | None = None  # auto, required, none, or a tool's name
    chain_limit: int | None = None
    tool_output_max: int | None = None
    tool_timeout: float | None = None
    mcp: tuple[str, ...] = ()  # MCP servers by name ([mcp.NAME] in the config, or --mcp-config)
    mcp_config: str | None = None  # a JSON file of servers in the `mcpServers` shape
    yes: bool = False  # approve every call
    messages: str | None = None  # a JSON file: the conversation a one-shot run goes on from (its tools too)


@dataclass(frozen=True)
class TurnOptions(ToolOptions):
    """What the user asked for; None means not given (session, then config, then defaults apply).
    Its tools' options are `ToolOptions`' (`tool_options` has them alone); the sampling
    parameters given are `sampling`, by name (`quipu.options.SAMPLING`). `of` makes one from
    options by name, as the command line, a role or a request gives them."""

    model: str | None = None
    system: str | None = None
    raw: bool = False
    sampling: Mapping[str, float] = dataclasses.field(default_factory=dict)
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    ctx: int | None = None  # tokens, or CTX_AUTO (`--ctx auto`); given as text, read as one of them
    threads: int | None = None
    kv_type: str | None = None
    flash_attn: str | None = None  # auto, on or off
    swa_full: bool = False  # a sliding-window model's window cache of every position, not a ring
    no_log: bool = False  # this answer not written to the log of answers
    follow_up: bool = False  # go on with the last logged conversation
    cid: str | None = None  # go on with the logged conversation of this answer's id
    role: str | None = None  # a role's values where the command line gives none (`roles.py`)
    gpu_layers: str | None = None  # N, auto or all: layers on the GPU
    gpu_memory: str | None = None  # at most this much of a device's memory (512M, 6G)
    device: str | None = None  # the devices to use, by name (comma-separated); none: the CPU alone
    session: str | None = None
    branch: int | None = None
    continue_reply: bool = False
    verbose: bool = False
    chat_template: str | None = None  # a file whose template replaces the model's
    think: bool | None = None  # the template's `enable_thinking`, where it has one
    reasoning_budget: int | None = None  # the most tokens of reasoning (0: none; -1: no limit)
    reasoning_effort: str | None = None  # the template's `reasoning_effort`: low, medium, high
    # An effort a request names in passing (the Responses API's, Anthropic's): the template's
    # reasoning effort where it takes one, else nothing (a model's reasoning is switched by `think`).
    effort_if_taken: str | None = None
    schema: str | None = None  # a JSON Schema, inline or @file; "off" drops a session's constraint
    grammar: str | None = None  # a GBNF or Lark (.lark) file; "off" as for schema
    regex: str | None = None  # a regular expression; "off" as for schema
    logit_bias: tuple[str, ...] = ()  # TOKEN=BIAS, TOKEN an id or a text that is one token
    no_cache: bool = False  # neither use nor fill the prompt cache
    attach: tuple[str, ...] = ()  # files the message carries (`attachments.py`)
    mmproj: str | None = None  # the model's projector, for images and audio (default: the one beside it)
    # The server the command talks to (from --url, QUIPU_URL or the config: `choose.server_of`);
    # None: a model on this machine.
    server: "ServerSettings | None" = None

    def __post_init__(self) -> None:
        """What can be checked of the options alone is checked here, once, before anything is
        loaded or sent (what needs the config or the model, where those are read)."""
        check_reply_length(self.max_tokens)
        parse_logit_bias(self.logit_bias)
        unknown = sorted(set(self.sampling) - set(SAMPLING))
        if unknown:
            raise UsageError(f"unknown sampling parameter '{unknown[0]}' (known: {', '.join(SAMPLING)})")

    @classmethod
    def of(cls, values: Mapping[str, Any] | None = None, /, **more: Any) -> "TurnOptions":
        """Options by name (each option's field, `quipu.options`), as values (a request's, a
        test's): a sampling parameter goes to `sampling`, a list to a tuple."""
        given = {**(values or {}), **more}
        sampling = {k: v for k, v in given.items() if k in SAMPLING and v is not None}
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items()
                                  if k not in SAMPLING}
        return cls(**fields, sampling=sampling)

    @classmethod
    def of_command_line(cls, values: Mapping[str, Any], /, **more: Any) -> "TurnOptions":
        """`of` options as a command line (or a role) spells them: --ctx's text (N or auto) is
        read, and --stop's escapes (`\\n`)."""
        given = {**values, **more}
        if isinstance(given.get("ctx"), str):
            given["ctx"] = parse_ctx(given["ctx"])
        if given.get("stop"):
            given["stop"] = tuple(read_escapes(text) for text in given["stop"])
        return cls.of(given)

    @property
    def seed(self) -> int | None:
        seed = self.sampling.get("seed")
        return None if seed is None else int(seed)

    def value(self, name: str) -> Any:
        """The value given of the option `name` (None, or its field's default, where none was)."""
        return self.sampling.get(name) if name in SAMPLING else getattr(self, name)

    @property
    def constrained(self) -> bool:
        """Whether --schema, --grammar or --regex asks for a constraint (not "off")."""
        return any(v not in (None, OFF) for v in (self.schema, self.grammar, self.regex))

    @property
    def given(self) -> frozenset[str]:
        """The fields the user gave a value: not their default (a flag set, a list not empty;
        0 is a value, and --no-think is given), and not empty text."""
        fields = frozenset(f.name for f in dataclasses.fields(self)
                           if f.name != "sampling" and (value := getattr(self, f.name)) != f.default and value != "")
        return fields | frozenset(self.sampling)

    @property
    def logged(self) -> dict[str, Any] | None:
        """What the log of answers keeps of these options: those given that shape an answer
        (None: --no-log, the answer is not logged)."""
        given = self.given
        return None if self.no_log else {name: self.value(name) for name in LOGGED if name in given}

    @property
    def tool_options(self) -> ToolOptions:
        return ToolOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ToolOptions)})


def check_positive(name: str, value: int | None) -> None:
    if value is not None and value <= 0:
        raise UsageError(f"{name} must be more than 0, got {value}")


def check_reply_length(value: int | None) -> None:
    """--max-tokens (the config's, a session's) within its bounds: more than 0, and what a C int
    holds (a server's count of tokens to predict is one)."""
    bounds = OPTIONS["max_tokens"].bounds
    refused = bounds.refusal("--max-tokens", value) if value is not None and bounds is not None else None
    if refused is not None:
        raise UsageError(refused)


def sampling_params(opts: TurnOptions, env: Environment, base: SamplingParams | None = None,
                    host: Capabilities = LOCAL) -> SamplingParams:
    """The command line's settings over `base`, a session's own (which it saved whole, the config
    then left out), or, without one, over the config's over the built-in defaults. The grammar
    of --schema, --grammar or --regex is included, checked as `host` reads it; --logit-bias
    needs the model (`logit_biases`)."""
    params = base or SamplingParams().replace(
        **{k: v for k, v in env.config.generation.items() if k in SAMPLING}
    )
    params = params.replace(**opts.sampling)
    if OFF in (opts.schema, opts.grammar, opts.regex):
        params = params.unconstrained()
    grammar = grammar_of(opts, host.own_grammar)
    return params.replace(grammar=grammar) if grammar else params


OFF = "off"


def grammar_of(opts: TurnOptions, own_grammar: bool = False) -> Grammar | None:
    """The grammar (`engine.grammar.Grammar`) that --schema, --grammar or --regex asks for,
    checked (None when none does); a GBNF grammar by its depth alone for a host that keeps
    replies to it with its `own_grammar` engine."""
    given = {name: value for name, value in (("--schema", opts.schema), ("--grammar", opts.grammar),
                                              ("--regex", opts.regex)) if value not in (None, OFF)}
    if len(given) > 1:
        raise UsageError(f"give one of --schema, --grammar and --regex, not {' and '.join(given)}")
    if not given:
        return None
    from quipu.engine.grammar import Grammar, grammar_kind, schema_grammar

    if opts.schema not in (None, OFF):
        text = read_text_file(opts.schema[1:], "schema") if opts.schema.startswith("@") else opts.schema
        try:
            grammar = schema_grammar(text)
        except UsageError:
            if not opts.schema.startswith("@") and Path(opts.schema).expanduser().is_file():
                raise UsageError(f"--schema takes the schema's JSON, or @FILE for a file's: '{opts.schema}' is a "
                                 f"file, so give --schema @{opts.schema}") from None
            raise
    elif opts.grammar not in (None, OFF):
        grammar = Grammar(grammar_kind(opts.grammar), read_text_file(opts.grammar, "grammar"))
    else:
        assert opts.regex is not None  # (one of the three was given: the caller says so)
        grammar = Grammar("regex", opts.regex)
    from quipu.engine.constraint import compile_grammar  # llguidance: only when a grammar is asked for

    if grammar.kind != "gbnf" or not own_grammar:
        compile_grammar(grammar)  # an invalid grammar is refused before a model is loaded
    else:
        from quipu.engine.grammar import check_grammar_depth

        check_grammar_depth(grammar.text)
    return grammar


def parse_logit_bias(specs: Sequence[str]) -> list[tuple[str, float]]:
    """TOKEN=BIAS pairs, checked before any model is loaded."""
    pairs = []
    for spec in specs:
        token, sep, bias = spec.rpartition("=")
        try:
            value = float(bias)
        except ValueError:
            value = None
        if not sep or not token or value is None or value != value:
            raise UsageError(f"--logit-bias takes TOKEN=BIAS (a token id or text, a number or -inf), not '{spec}'")
        pairs.append((token, value))
    return pairs


def logit_biases(backend: Vocabulary, specs: Sequence[str]) -> tuple[tuple[int, float], ...]:
    """--logit-bias with each TOKEN made token ids: an id, or a text, whose every token the bias
    goes to (as llama-server takes one: " the" banned is each token of it banned)."""
    out: list[tuple[int, float]] = []
    for token, bias in parse_logit_bias(specs):
        quoted = len(token) > 2 and token[0] == token[-1] == '"'  # (a text in quotes, digits too: '"42"=-5')
        if token.isascii() and token.isdigit():
            token_id = int(token)
            if token_id >= backend.n_vocab:
                raise UsageError(f"--logit-bias: token {token_id} is not in the model's vocabulary "
                                 f"of {backend.n_vocab}")
            out.append((token_id, bias))
            continue
        text = token[1:-1] if quoted else token
        ids = backend.tokenize(text, add_special=False, parse_special=True)
        if not ids:
            raise UsageError(f"--logit-bias: '{text}' is no token for this model; give a token's id or text")
        out += [(t, bias) for t in dict.fromkeys(ids)]
    return tuple(out)


def with_logit_biases(params: SamplingParams, backend: Vocabulary, opts: TurnOptions) -> SamplingParams:
    """`params` with --logit-bias made token ids for `backend`'s model (checked before it loaded)."""
    if not opts.logit_bias:
        return params
    return params.replace(logit_bias=logit_biases(backend, opts.logit_bias))


def context_settings(opts: TurnOptions, env: Environment) -> ContextSettings:
    gen = env.config.generation
    ctx = opts.ctx if opts.ctx is not None else (parse_ctx(gen["ctx"], "ctx") if "ctx" in gen else None)
    threads = opts.threads if opts.threads is not None else gen.get("threads")
    if ctx != CTX_AUTO:
        check_positive("--ctx", ctx)
    check_positive("--threads", threads)
    check_context_bounds(ctx, threads)
    return ContextSettings(n_ctx=ctx or 0, n_threads=threads or 0, kv_type=opts.kv_type or "f16",
                           flash_attn=opts.flash_attn or "auto", swa_full=opts.swa_full or gen.get("swa_full", False))


def max_tokens(opts: TurnOptions, env: Environment) -> int:
    """The most tokens a reply may have: --max-tokens, the config's, else until it ends (`UNTIL_IT_ENDS`)."""
    value = opts.max_tokens if opts.max_tokens is not None else env.config.generation.get("max_tokens")
    check_reply_length(value)
    return value or UNTIL_IT_ENDS


def effort_of(opts: TurnOptions, conv: Conversation) -> str | None:
    """The reasoning effort a conversation is given: the one asked for, else one named in
    passing where its template takes one (`TurnOptions.effort_if_taken`)."""
    if opts.reasoning_effort is not None or opts.effort_if_taken is None:
        return opts.reasoning_effort
    return opts.effort_if_taken if conv.template is not None and "reasoning_effort" in conv.template.source else None


def stop_strings(opts: TurnOptions, env: Environment) -> tuple[str, ...]:
    """The stop strings: the plan's, else the config's, each with its escapes read (`\\n`)."""
    return opts.stop or tuple(read_escapes(text) for text in env.config.generation.get("stop", ()))


def offload(opts: TurnOptions, env: Environment) -> Offload:
    """Where the model is to run: --gpu-layers, --gpu-memory and --device, else QUIPU_GPU_LAYERS,
    QUIPU_GPU_MEMORY and QUIPU_DEVICE, else the config's; checked before anything loads."""
    def given(key: str) -> str | int | None:
        value = getattr(opts, key)
        if value is None:
            value = env.environ.get(GPU_ENVIRON[key]) or None
        return value if value is not None else env.config.generation.get(key)

    layers, memory, device = given("gpu_layers"), given("gpu_memory"), given("device")
    names = None
    if device is not None:
        names = tuple(n.strip() for n in str(device).split(",") if n.strip())
        if not names:
            raise UsageError("--device takes device names (as `quipu doctor` lists them), comma-separated, or none")
    return Offload(layers=parse_layers(layers) if layers is not None else AUTO,
                   memory=parse_size(memory) if memory is not None else None, devices=names)


def load_backend(model_path: "Path | LlamaModel", settings: ContextSettings, verbose: bool,
                 where: Offload = Offload()) -> "LlamaBackend":
    from quipu.engine.llama import LlamaBackend  # imported here: llama.cpp loads in a blink only when needed

    return LlamaBackend(model_path, settings, verbose=verbose, offload=where)


def system_prompt(opts: TurnOptions, env: Environment) -> str | None:
    """--system, else the config's; an explicit empty --system means none."""
    return opts.system if opts.system is not None else env.config.system


def chat_template_source(opts: TurnOptions) -> str | None:
    """The text of --chat-template FILE, checked to be a template; None when not given."""
    if opts.chat_template is None:
        return None
    text = read_text_file(opts.chat_template, "chat template")
    try:
        ChatTemplate(text)
    except TemplateError as exc:
        raise UsageError(f"{Path(opts.chat_template).expanduser()}: {exc}") from None
    return text


def template_variables(opts: TurnOptions, saved: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What the template is given besides the messages: a session's own, then --think/--no-think."""
    variables = dict(saved or {})
    if opts.think is not None:
        variables["enable_thinking"] = opts.think
    return variables
