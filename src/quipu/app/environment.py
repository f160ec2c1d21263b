"""The environment a command runs in (directories, environment variables, the config file),
built once, and what the user asked for (`TurnOptions`) turned into settings: command line >
session > config file > built-in defaults."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from quipu import paths
from quipu.config import Config, load_config
from quipu.engine.base import Backend, ContextSettings
from quipu.errors import InvalidParameter, ModelNotFound, TemplateError, UsageError
from quipu.models import resolve_model
from quipu.sessions.base import LOCAL, Capabilities
from quipu.sessions.params import SamplingParams
from quipu.sessions.template import ChatTemplate

if TYPE_CHECKING:
    from quipu.engine.http import ServerSettings

DEFAULT_MAX_TOKENS = 512
DEFAULT_MAX_STATE_BYTES = 4 << 30
DEFAULT_CACHE_BYTES = 2 << 30
SAMPLING_TYPES = SamplingParams.field_types()
# Everything [generation] in the config file may set: the sampling parameters and these.
GENERATION_TYPES = {**SAMPLING_TYPES, "max_tokens": int, "ctx": int, "threads": int}


@dataclass
class TurnOptions:
    """What the user asked for; None means not given (session, then config, then defaults apply)."""

    model: str | None = None
    system: str | None = None
    raw: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    ctx: int | None = None
    threads: int | None = None
    kv_type: str | None = None
    session: str | None = None
    continue_reply: bool = False
    verbose: bool = False
    chat_template: str | None = None  # a file whose template replaces the model's
    think: bool | None = None  # the template's `enable_thinking`, where it has one
    reasoning_budget: int | None = None  # the most tokens of reasoning (0: none; -1: no limit)
    reasoning_effort: str | None = None  # the template's `reasoning_effort`: low, medium, high
    schema: str | None = None  # a JSON Schema, inline or @file; "off" drops a session's constraint
    grammar: str | None = None  # a GBNF or Lark (.lark) file; "off" as for schema
    regex: str | None = None  # a regular expression; "off" as for schema
    logit_bias: tuple[str, ...] = ()  # TOKEN=BIAS, TOKEN an id or a text that is one token
    no_cache: bool = False  # neither use nor fill the prompt cache
    # The server the command talks to (from --url, QUIPU_URL or the config: `choose.server_of`);
    # None: a model on this machine.
    server: "ServerSettings | None" = None
    # Tools: Python files whose functions the model may call, definitions the caller runs, the
    # results of such calls (ID=TEXT), and how the loop goes.
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
    messages: str | None = None  # a JSON file: the conversation a one-shot run goes on from

    def sampling(self) -> dict:
        """The sampling parameters given on the command line."""
        return {k: getattr(self, k) for k in SAMPLING_TYPES if getattr(self, k, None) is not None}


class Environment:
    """Where quipu is running: its directories, environment variables and config file. The
    config file is read (and checked) when first needed, so `quipu config path` still answers
    when it is broken."""

    def __init__(self, dirs: paths.Dirs, environ: Mapping[str, str], config: Config | None = None):
        self.dirs = dirs
        self.environ = environ
        self._config = config

    @property
    def config(self) -> Config:
        if self._config is None:
            self._config = check_config(load_config(self.dirs.config_file, GENERATION_TYPES))
        return self._config

    @property
    def max_state_bytes(self) -> int:
        return self.config.sessions.get("max_state_bytes", DEFAULT_MAX_STATE_BYTES)

    @property
    def cache_max_bytes(self) -> int:
        return self.config.cache.get("max_bytes", DEFAULT_CACHE_BYTES)

    def requested_model(self, requested: str | None) -> str | None:
        """The model name a command would use: `--model`, else QUIPU_MODEL, else the config's
        (None: the bundled default)."""
        return requested or self.environ.get("QUIPU_MODEL") or self.config.model or None

    def resolve_model(self, requested: str | None, *, fall_back: bool = True,
                      requested_from: str = "--model") -> tuple[str, Path]:
        """(name, file) for `requested`; with `fall_back`, QUIPU_MODEL, the config and the bundled
        default stand in for a model not given. `hf:OWNER/REPO[:QUANT]` is a model pulled from
        the Hub (`quipu models pull`)."""
        name = self.requested_model(requested) if fall_back else requested
        if name and name.startswith("hf:"):
            from quipu.app.hub import HubRef, pulled

            model = pulled(HubRef.parse(name), self)
            if model is None:
                raise ModelNotFound(f"{name} is not pulled yet: `quipu models pull {name[3:]}` fetches it")
            return name, Path(model.path)
        if not fall_back:
            if not requested:
                raise ModelNotFound("no model named")
            environ = {k: v for k, v in self.environ.items() if k != "QUIPU_MODEL"}
            return resolve_model(requested, environ=environ, configured=None, models_dir=self.dirs.models,
                                 locations_config=self.config.models)
        return resolve_model(requested, environ=self.environ, configured=self.config.model,
                             models_dir=self.dirs.models, locations_config=self.config.models,
                             requested_from=requested_from)

    def effective_settings(self) -> list[tuple[str, Any, str]]:
        """(setting, value, where it came from) for everything a command line does not give."""
        from quipu.models import DEFAULT_MODEL_NAME

        where = f"config ({self.config.path})" if self.config.path else "config"
        rows: list[tuple[str, Any, str]] = []
        if self.environ.get("QUIPU_MODEL"):
            rows.append(("model", self.environ["QUIPU_MODEL"], "environment (QUIPU_MODEL)"))
        elif self.config.model:
            rows.append(("model", self.config.model, where))
        else:
            rows.append(("model", DEFAULT_MODEL_NAME, "default"))
        rows.append(("system", self.config.system, where if self.config.system else "default"))
        defaults = {**SamplingParams().to_dict(), "max_tokens": DEFAULT_MAX_TOKENS, "ctx": "the model's, at most 8192",
                    "threads": "the CPUs this process may use", "seed": "random"}
        for key in GENERATION_TYPES:
            if key in self.config.generation:
                rows.append((f"generation.{key}", self.config.generation[key], where))
            else:
                rows.append((f"generation.{key}", defaults[key], "default"))
        given = "max_state_bytes" in self.config.sessions
        rows.append(("sessions.max_state_bytes", self.max_state_bytes, where if given else "default"))
        rows.append(("cache.max_bytes", self.cache_max_bytes, where if "max_bytes" in self.config.cache else "default"))
        for key in ("huggingface", "lmstudio", "ollama"):
            if key in self.config.models:
                rows.append((f"models.{key}", self.config.models[key], where))
        if self.environ.get("QUIPU_URL"):
            rows.append(("remote.url", self.environ["QUIPU_URL"], "environment (QUIPU_URL)"))
        for key in ("url", "api_key_env", "model", "timeout"):
            if key in self.config.remote and not (key == "url" and self.environ.get("QUIPU_URL")):
                rows.append((f"remote.{key}", self.config.remote[key], where))
        home = "environment (QUIPU_HOME)" if self.environ.get("QUIPU_HOME") else "default"
        for key in ("data", "config", "state", "cache"):
            rows.append((f"dirs.{key}", str(getattr(self.dirs, key)), home))
        return rows

    @classmethod
    def load(cls, environ: Mapping[str, str] | None = None) -> "Environment":
        environ = dict(os.environ if environ is None else environ)
        dirs = paths.dirs(environ)
        return cls(dirs, environ)


def check_url(url: str) -> None:
    """A server's address, checked before anything is sent: a usage error when it is not one."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError as exc:
        raise UsageError(f"the server address '{url}' is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"the server address must be http://HOST[:PORT] or https://..., not '{url}'")


def check_config(config: Config) -> Config:
    """The values of the config file's settings, checked as the command line's are."""
    gen = config.generation
    try:
        SamplingParams().replace(**{k: v for k, v in gen.items() if k in SAMPLING_TYPES})
    except InvalidParameter as exc:
        key = str(exc).split(" ", 1)[0].replace("-", "_")
        raise config.error(key, str(exc), "generation") from None
    for key in ("max_tokens", "ctx", "threads"):
        if key in gen and gen[key] <= 0:
            raise config.error(key, f"{key} must be more than 0, got {gen[key]}", "generation")
    timeout = config.remote.get("timeout")
    if timeout is not None and not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise config.error("timeout", f"timeout is the longest wait in seconds, more than 0, not {timeout}", "remote")
    if config.sessions.get("max_state_bytes", 0) < 0:
        raise config.error("max_state_bytes", "max_state_bytes must be 0 or more", "sessions")
    if config.cache.get("max_bytes", 0) < 0:
        raise config.error("max_bytes", "max_bytes must be 0 or more", "cache")
    return config


def check_positive(name: str, value: int | None) -> None:
    if value is not None and value <= 0:
        raise UsageError(f"{name} must be more than 0, got {value}")


def sampling_params(opts: TurnOptions, env: Environment, base: SamplingParams | None = None,
                    host: Capabilities = LOCAL) -> SamplingParams:
    """Command line > config > `base` (a session's own settings) > built-in defaults. The
    grammar of --schema, --grammar or --regex is included, checked as `host` reads it;
    --logit-bias needs the model (`logit_biases`)."""
    params = base or SamplingParams().replace(
        **{k: v for k, v in env.config.generation.items() if k in SAMPLING_TYPES}
    )
    params = params.replace(**opts.sampling())
    if OFF in (opts.schema, opts.grammar, opts.regex):
        params = params.unconstrained()
    grammar = grammar_of(opts, host.reads_gbnf)
    return params.replace(grammar=grammar) if grammar else params


OFF = "off"


def grammar_of(opts: TurnOptions, reads_gbnf: bool = False):
    """The grammar (`engine.grammar.Grammar`) that --schema, --grammar or --regex asks for,
    checked (None when none does); by its depth alone for a host that `reads_gbnf` itself."""
    given = {name: value for name, value in (("--schema", opts.schema), ("--grammar", opts.grammar),
                                              ("--regex", opts.regex)) if value not in (None, OFF)}
    if len(given) > 1:
        raise UsageError(f"give one of --schema, --grammar and --regex, not {' and '.join(given)}")
    if not given:
        return None
    from quipu.engine.grammar import Grammar, grammar_kind, schema_grammar

    if opts.schema not in (None, OFF):
        text = read_text_file(opts.schema[1:], "schema") if opts.schema.startswith("@") else opts.schema
        grammar = schema_grammar(text)
    elif opts.grammar not in (None, OFF):
        grammar = Grammar(grammar_kind(opts.grammar), read_text_file(opts.grammar, "grammar"))
    else:
        assert opts.regex is not None  # (one of the three was given: the caller says so)
        grammar = Grammar("regex", opts.regex)
    from quipu.engine.constraint import compile_grammar  # llguidance: only when a grammar is asked for

    if grammar.kind != "gbnf" or not reads_gbnf:
        compile_grammar(grammar)  # an invalid grammar is refused before a model is loaded
    else:
        from quipu.engine.grammar import check_grammar_depth

        check_grammar_depth(grammar.text)
    return grammar


MAX_FILE_BYTES = 64 << 20  # the largest file the user names that is read (as standard input)
# A JSON string, or one bracket: what a depth scan needs to see of a JSON text.
_JSON_MARKS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


def json_depth(text: str, stop_past: int) -> int:
    """How deep brackets nest in a JSON text, found without parsing it (strings skipped), the
    scan ended once past `stop_past`."""
    depth = deepest = 0
    for mark in _JSON_MARKS.finditer(text):
        c = mark.group()
        if c in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > stop_past:
                    break
        elif c in "]}":
            depth -= 1
    return deepest


def read_json_file(name: str, what: str):
    """A JSON file the user named, parsed; a clear usage error when it cannot be read or parsed,
    or is larger or deeper than quipu takes (checked before it becomes Python objects)."""
    import json

    from quipu.engine.grammar import MAX_DEPTH

    path = Path(name).expanduser()
    text = read_text_file(name, what, allow_empty=True)
    if json_depth(text, MAX_DEPTH) > MAX_DEPTH:
        raise UsageError(f"the {what} {path} nests deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise UsageError(f"the {what} {path} is not valid JSON: {exc}") from None


def read_text_file(name: str, what: str, allow_empty: bool = False) -> str:
    """A file the user named, as text (at most `MAX_FILE_BYTES`); a clear usage error when it
    cannot be."""
    path = Path(name).expanduser()
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise UsageError(f"the {what} {path} is larger than {MAX_FILE_BYTES >> 20} MB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"the {what} {path} is not UTF-8 text") from None
    if not text.strip() and not allow_empty:
        raise UsageError(f"the {what} {path} is empty")
    return text


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


def logit_biases(backend: Backend, specs: Sequence[str]) -> tuple[tuple[int, float], ...]:
    """--logit-bias with each TOKEN made a token id: an id, or a text the model spells as one token."""
    out = []
    for token, bias in parse_logit_bias(specs):
        if token.isascii() and token.isdigit():
            token_id = int(token)
            if token_id >= backend.n_vocab:
                raise UsageError(f"--logit-bias: token {token_id} is not in the model's vocabulary "
                                 f"of {backend.n_vocab}")
        else:
            ids = backend.tokenize(token, add_special=False, parse_special=True)
            if len(ids) != 1:
                raise UsageError(f"--logit-bias: '{token}' is {len(ids)} tokens for this model, not one; give its id")
            token_id = ids[0]
        out.append((token_id, bias))
    return tuple(out)


def with_logit_biases(params: SamplingParams, backend: Backend, opts: TurnOptions) -> SamplingParams:
    """`params` with --logit-bias made token ids for `backend`'s model (checked before it loaded)."""
    if not opts.logit_bias:
        return params
    return params.replace(logit_bias=logit_biases(backend, opts.logit_bias))


def context_settings(opts: TurnOptions, env: Environment) -> ContextSettings:
    gen = env.config.generation
    ctx = opts.ctx if opts.ctx is not None else gen.get("ctx")
    threads = opts.threads if opts.threads is not None else gen.get("threads")
    check_positive("--ctx", ctx)
    check_positive("--threads", threads)
    return ContextSettings(n_ctx=ctx or 0, n_threads=threads or 0, kv_type=opts.kv_type or "f16")


def max_tokens(opts: TurnOptions, env: Environment) -> int:
    value = opts.max_tokens if opts.max_tokens is not None else env.config.generation.get("max_tokens")
    check_positive("--max-tokens", value)
    return value or DEFAULT_MAX_TOKENS


def load_backend(model_path, settings: ContextSettings, verbose: bool):
    from quipu.engine.llama import LlamaBackend  # imported here: llama.cpp loads in a blink only when needed

    return LlamaBackend(model_path, settings, verbose=verbose)


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
