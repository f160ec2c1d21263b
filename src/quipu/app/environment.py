"""The environment a command runs in (directories, environment variables, the config file),
built once (`Environment`), and the config file's settings, checked as the command line's are.
What the user asked for, turned into settings, is `turn_options.py`'s."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from quipu import paths
from quipu.config import Config, load_config
from quipu.engine.settings import DEFAULT_CTX_CAP, parse_ctx, parse_layers, parse_size
from quipu.errors import InvalidParameter, ModelNotFound, UsageError
from quipu.models import resolve_model
from quipu.options import CONFIG, OPTIONS, SAMPLING
from quipu.sessions.params import SamplingParams

if TYPE_CHECKING:
    from quipu.app.hub import HubRef

DEFAULT_MAX_STATE_BYTES = 4 << 30
DEFAULT_CACHE_BYTES = 2 << 30
MAX_CACHE_BYTES = 64 << 30  # the most the prompt cache takes of a disk unless the config says otherwise
DEFAULT_MAX_RECORDS = 100_000  # answers the log keeps, the oldest dropped first
# Where the model runs: the variables that set it, between the command line's options and the config's.
GPU_ENVIRON = {"gpu_layers": "QUIPU_GPU_LAYERS", "gpu_memory": "QUIPU_GPU_MEMORY", "device": "QUIPU_DEVICE"}


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
            self._config = check_config(load_config(self.dirs.config_file, dict(CONFIG)))
        return self._config

    @property
    def max_state_bytes(self) -> int:
        return int(self.config.sessions.get("max_state_bytes", DEFAULT_MAX_STATE_BYTES))

    @property
    def log_path(self) -> Path:
        return self.dirs.data / "logs.db"

    @property
    def cache_max_bytes(self) -> int:
        """The prompt cache's budget: the config's `[cache] max_bytes`, else a quarter of the free
        disk it is on (so that a real model's agent-sized prompt, some gigabytes, is kept), at
        least `DEFAULT_CACHE_BYTES` and at most `MAX_CACHE_BYTES`."""
        if "max_bytes" in self.config.cache:
            return int(self.config.cache["max_bytes"])
        import shutil

        place = self.dirs.prompt_cache
        while not place.exists() and place.parent != place:
            place = place.parent
        try:
            free = shutil.disk_usage(place).free
        except OSError:
            return DEFAULT_CACHE_BYTES
        return max(DEFAULT_CACHE_BYTES, min(free // 4, MAX_CACHE_BYTES))

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
        ref = self.hub_ref(name)
        if name and ref is not None:
            from quipu.app.hub import pulled

            model = pulled(ref, self.dirs)
            if model is None:
                raise ModelNotFound(f"{name} is not pulled yet: `quipu models pull {name.removeprefix('hf:')}` "
                                    "fetches it")
            return name, Path(model.path)
        if not fall_back:
            if not requested:
                raise ModelNotFound("no model named")
            return self._named_here(requested)
        try:
            return resolve_model(requested, environ=self.environ, configured=self.config.model,
                                 models_dir=self.dirs.models, locations_config=self.config.models,
                                 requested_from=requested_from)
        except ModelNotFound:
            from quipu.app.known_models import no_size, sizes_of

            sizes = sizes_of(name or "")  # (Ollama's bare name: the sizes quipu knows of it)
            if sizes:
                raise ModelNotFound(no_size(name or "", sizes, "-m {} pulls it on first use")) from None
            raise

    def hub_ref(self, name: str | None) -> "HubRef | None":
        """The Hub model (`hub.HubRef`) a model name asks for: `hf:OWNER/REPO[:QUANT]`, or a short
        name (`gemma3:1b`) that no model here is called (an Ollama model of that name is used
        as it is); None for any other name."""
        if not name:
            return None
        from quipu.app.known_models import is_short_name

        if not name.startswith("hf:") and not is_short_name(name):
            return None
        from quipu.app.hub import HubRef

        if not name.startswith("hf:"):
            try:
                self._named_here(name)
                return None  # a model here has that name
            except ModelNotFound:
                pass
        return HubRef.parse(name)

    def _named_here(self, name: str) -> tuple[str, Path]:
        """(name, file) of the model `name` is here (a file, or a model found on this machine),
        without the defaults (QUIPU_MODEL, the config's) standing in."""
        environ = {k: v for k, v in self.environ.items() if k != "QUIPU_MODEL"}
        return resolve_model(name, environ=environ, configured=None, models_dir=self.dirs.models,
                             locations_config=self.config.models)

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
        defaults = {**SamplingParams().to_dict(), "max_tokens": "none (a reply ends by itself, or where the context does)", "ctx": f"the model's, at most {DEFAULT_CTX_CAP}",
                    "threads": "following the machine's load, up to one a physical core", "seed": "random", "stop": "none",
                    "gpu_layers": "auto (as many as fit in free GPU memory)", "gpu_memory": "the GPU's free memory",
                    "device": "every GPU", "swa_full": "off (a sliding-window model's window cache is a ring)"}
        for key in CONFIG:
            if key in GPU_ENVIRON and self.environ.get(GPU_ENVIRON[key]):
                rows.append((f"generation.{key}", self.environ[GPU_ENVIRON[key]],
                             f"environment ({GPU_ENVIRON[key]})"))
            elif key in self.config.generation:
                rows.append((f"generation.{key}", self.config.generation[key], where))
            else:
                rows.append((f"generation.{key}", defaults[key], "default"))
        given = "max_state_bytes" in self.config.sessions
        rows.append(("sessions.max_state_bytes", self.max_state_bytes, where if given else "default"))
        rows.append(("cache.max_bytes", self.cache_max_bytes, where if "max_bytes" in self.config.cache else "default"))
        for key, default in (("enabled", True), ("max_records", DEFAULT_MAX_RECORDS), ("max_days", "none")):
            rows.append((f"logs.{key}", self.config.logs.get(key, default), where if key in self.config.logs else "default"))
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


MAX_URL = 8192  # characters of a server's address (httpx takes 65,536; no server needs a tenth)


def check_url(url: str) -> None:
    """A server's address, checked before anything is sent: a usage error when it is not one (a
    control character or a space in it, as a line of a Windows env file ends; too long; a host
    name DNS cannot hold)."""
    from urllib.parse import urlsplit

    from quipu.shown import shown

    if len(url) > MAX_URL:
        raise UsageError(f"the server address is longer than {MAX_URL} characters")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise UsageError(f"the server address '{shown(url)}' holds a control character or a space")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError as exc:
        raise UsageError(f"the server address '{shown(url)}' is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"the server address must be http://HOST[:PORT] or https://..., not '{shown(url)}'")
    try:
        host = parts.hostname.encode("idna")
    except UnicodeError:
        host = b""
    if not host or len(host) > 253 or any(len(label) > 63 for label in host.split(b".")):
        raise UsageError(f"the server address's host '{shown(parts.hostname[:80])}' is not a name DNS can hold")


def check_config(config: Config) -> Config:
    """The values of the config file's settings, checked as the command line's are."""
    gen = config.generation
    try:
        SamplingParams().replace(**{k: v for k, v in gen.items() if k in SAMPLING})
    except InvalidParameter as exc:
        key = str(exc).split(" ", 1)[0].replace("-", "_")
        raise config.error(key, str(exc), "generation") from None
    for key, option in OPTIONS.items():
        refused = option.bounds.refusal(key, gen[key]) if key in gen and key not in SAMPLING and option.bounds else None
        if refused is not None:
            raise config.error(key, refused, "generation")
    for key, parse in (("ctx", parse_ctx), ("gpu_layers", parse_layers), ("gpu_memory", parse_size)):
        if key in gen:
            try:
                parse(gen[key], key)
            except UsageError as exc:
                raise config.error(key, str(exc), "generation") from None
    timeout = config.remote.get("timeout")
    if timeout is not None and not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise config.error("timeout", f"timeout is the longest wait in seconds, more than 0, not {timeout}", "remote")
    if config.sessions.get("max_state_bytes", 0) < 0:
        raise config.error("max_state_bytes", "max_state_bytes must be 0 or more", "sessions")
    if config.cache.get("max_bytes", 0) < 0:
        raise config.error("max_bytes", "max_bytes must be 0 or more", "cache")
    for key in ("max_records", "max_days"):
        if config.logs.get(key, 1) <= 0:
            raise config.error(key, f"{key} must be more than 0", "logs")
    return config
