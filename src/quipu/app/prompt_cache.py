"""The prompt cache, as a local session uses it: a new prompt restores the longest beginning it
shares with earlier ones (`cache_lookup`), and its own state is kept after the answer is out
(`cache_save`). The entries themselves are `store/cache.py`'s."""

from __future__ import annotations

from dataclasses import dataclass

from quipu.app.environment import Environment
from quipu.errors import EngineError
from quipu.models import fingerprint
from quipu.sessions.inference import InferenceSession
from quipu.store.cache import MIN_TOKENS, PromptCache


@dataclass
class CacheUse:
    cache: PromptCache
    key: dict
    tokens: list[int]
    reused: int
    held: int = 0  # how much of the prompt the cache held (reused: to where a prefill step starts)


def cache_key(session: InferenceSession, model_path) -> dict:
    """What a cache entry's state bytes are valid under: the model, the native build, the context."""
    backend = session.backend
    return {"fingerprint": fingerprint(model_path), "build": backend.build, "context": backend.context.state_key()}


def open_cache(env: Environment, no_cache: bool) -> PromptCache | None:
    """The prompt cache a run uses (None with --no-cache)."""
    return None if no_cache else PromptCache(env.dirs.prompt_cache, env.cache_max_bytes)


def cache_lookup(session: InferenceSession, tokens: list[int], model_path, cache: PromptCache) -> CacheUse:
    """Restores the longest cached beginning of `tokens` into the session, if any."""
    key = cache_key(session, model_path)
    hit = cache.lookup(key, tokens)
    reused = 0
    # The last token is read again, for its logits; the rest from where a batch of the prefill
    # starts, so that the tokens read compute as they would in a run without the cache.
    keep = session.backend.step_start(min(hit.reuse, len(tokens) - 1)) if hit is not None else 0
    if hit is not None and keep > 0:
        try:
            session.restore_prefix(hit.state, hit.tokens, keep)
            reused = keep
        except EngineError as exc:
            cache.drop(hit.path, str(exc))
    return CacheUse(cache, key, tokens, reused, hit.reuse if hit is not None else 0)


def cached_count(session: InferenceSession, tokens: list[int], model_path, cache: PromptCache) -> int:
    """How many of `tokens` a run would restore from the prompt cache (`--show-prompt`)."""
    found = cache.peek(cache_key(session, model_path), tokens)
    return session.backend.step_start(min(found, len(tokens) - 1)) if found else 0


def cache_save(session: InferenceSession, use: CacheUse) -> None:
    """Keeps the state of the prompt (not the reply), unless the cache had nearly all of it
    already: questions after one long beginning share one entry."""
    tokens = use.tokens
    if (len(tokens) - max(use.reused, use.held) < MIN_TOKENS or session.n_decoded < len(tokens)
            or session.backend.step_start(len(tokens) - 1) == 0):  # (a prompt no restore could use)
        return
    try:
        session.rewind(len(tokens))
        use.cache.save(use.key, tokens, session.backend.snapshot_bytes())
    except (EngineError, OSError):
        pass  # a cache never fails a run
