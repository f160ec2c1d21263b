"""One turn of `quipu run`, from the user's options to a finished generation."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from quipu import paths
from quipu.config import Config, load_config
from quipu.engine.base import ContextSettings, ProgressFn
from quipu.errors import BadInput, ModelNotFound, UsageError
from quipu.models import resolve_model
from quipu.sessions.conversation import Conversation
from quipu.sessions.inference import InferenceSession, Stats
from quipu.sessions.params import SamplingParams

DEFAULT_MAX_TOKENS = 512
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "seed")

TextFn = Callable[[str], None]
StopFn = Callable[[], bool]


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

    def sampling(self) -> dict:
        return {k: getattr(self, k) for k in SAMPLING_KEYS if getattr(self, k) is not None}


@dataclass
class TurnResult:
    text: str
    finish_reason: str
    model: str
    seed: int
    session: str | None
    stats: Stats = field(default_factory=Stats)
    notices: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "text": self.text,
            "finish_reason": self.finish_reason,
            "model": self.model,
            "seed": self.seed,
            "session": self.session,
            "usage": self.stats.usage(),
            "timings": self.stats.timings(),
        }


@dataclass
class Environment:
    """Where quipu is running: its directories, environment variables and config file."""

    dirs: paths.Dirs
    environ: Mapping[str, str]
    config: Config

    def resolve_model(self, requested: str | None, *, fall_back: bool = True) -> tuple[str, Path]:
        """(name, file) for `requested`; with `fall_back`, QUIPU_MODEL, the config and the bundled
        default stand in for a model not given."""
        if not fall_back:
            if not requested:
                raise ModelNotFound("no model named")
            environ = {k: v for k, v in self.environ.items() if k != "QUIPU_MODEL"}
            return resolve_model(requested, environ=environ, configured=None, models_dir=self.dirs.models,
                                 locations_config=self.config.models)
        return resolve_model(requested, environ=self.environ, configured=self.config.model,
                             models_dir=self.dirs.models, locations_config=self.config.models)

    def effective_settings(self) -> list[tuple[str, Any, str]]:
        """(setting, value, where it came from) for everything a command line does not give."""
        from quipu.models import DEFAULT_MODEL_NAME
        from quipu.sessions.store import DEFAULT_MAX_STATE_BYTES

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
        for key in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "seed", "max_tokens", "ctx", "threads"):
            if key in self.config.generation:
                rows.append((f"generation.{key}", self.config.generation[key], where))
            else:
                rows.append((f"generation.{key}", defaults[key], "default"))
        budget = self.config.sessions.get("max_state_bytes")
        rows.append(("sessions.max_state_bytes", budget if budget is not None else DEFAULT_MAX_STATE_BYTES,
                     where if budget is not None else "default"))
        for key in ("huggingface", "lmstudio", "ollama"):
            if key in self.config.models:
                rows.append((f"models.{key}", self.config.models[key], where))
        home = "environment (QUIPU_HOME)" if self.environ.get("QUIPU_HOME") else "default"
        for key in ("data", "config", "state", "cache"):
            rows.append((f"dirs.{key}", str(getattr(self.dirs, key)), home))
        return rows

    @classmethod
    def load(cls, environ: Mapping[str, str] | None = None) -> "Environment":
        environ = dict(os.environ if environ is None else environ)
        dirs = paths.dirs(environ)
        return cls(dirs, environ, load_config(dirs.config_file))


def check_positive(name: str, value: int | None) -> None:
    if value is not None and value <= 0:
        raise UsageError(f"{name} must be more than 0, got {value}")


def sampling_params(opts: TurnOptions, env: Environment, base: SamplingParams | None = None) -> SamplingParams:
    """Command line > config > `base` (a session's own settings) > built-in defaults."""
    params = base or SamplingParams().replace(
        **{k: v for k, v in env.config.generation.items() if k in SAMPLING_KEYS}
    )
    return params.replace(**opts.sampling())


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


def open_session(opts: TurnOptions, env: Environment) -> tuple[str, Path, InferenceSession]:
    """(model name, model file, a fresh session on it), with the load time in its stats. Options
    are checked before the model is loaded."""
    params = sampling_params(opts, env)
    settings = context_settings(opts, env)
    model_name, model_path = env.resolve_model(opts.model)
    started = time.perf_counter()
    backend = load_backend(model_path, settings, opts.verbose)
    try:
        session = InferenceSession(backend, params)
    except BaseException:
        backend.close()
        raise
    session.stats.load_s = time.perf_counter() - started
    return model_name, model_path, session


def run_turn(
    prompt: str | None,
    opts: TurnOptions,
    env: Environment,
    *,
    on_text: TextFn | None = None,
    on_progress: ProgressFn | None = None,
    should_stop: StopFn | None = None,
) -> TurnResult:
    """Runs one prompt to a reply; `on_text` receives text as it is generated."""
    on_token = token_callback(on_text, should_stop)
    progress = progress_callback(on_progress, should_stop)
    if opts.session is not None or opts.continue_reply:
        from quipu.sessions.named import run_session_turn

        return run_session_turn(prompt, opts, env, on_token, progress)
    if not prompt:
        raise BadInput("no prompt: give one as an argument or on standard input")
    limit = max_tokens(opts, env)
    model_name, _, session = open_session(opts, env)
    backend = session.backend
    try:
        if opts.raw:
            session.check_text_fits(prompt)
            tokens = backend.tokenize(prompt, add_special=True, parse_special=False)
            gen = session.generate(tokens, limit, opts.stop, on_token, progress)
        else:
            conv = Conversation.start(session, system_prompt(opts, env))
            gen = conv.send(prompt, max_tokens=limit, stop=opts.stop, on_token=on_token, on_progress=progress)
        return TurnResult(gen.text, gen.finish_reason, model_name, session.params.seed, None, session.stats)
    finally:
        backend.close()


def token_callback(on_text: TextFn | None, should_stop: StopFn | None):
    """An on_token for InferenceSession.infer: passes text on, stops when asked."""

    def on_token(_token: int, text: str) -> bool:
        if text and on_text is not None:
            on_text(text)
        return not (should_stop is not None and should_stop())

    return on_token


def progress_callback(on_progress: ProgressFn | None, should_stop: StopFn | None) -> ProgressFn:
    """An on_progress for prefills: reports, and stops when asked."""

    def progress(done: int, total: int) -> bool:
        if on_progress is not None:
            on_progress(done, total)
        return not (should_stop is not None and should_stop())

    return progress
