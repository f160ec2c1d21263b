"""`quipu cache info|clear`: the prompt cache over the store."""

from __future__ import annotations

from typing import Any

from quipu.app.environment import Environment
from quipu.store.cache import CacheEntries


def cache_of(env: Environment) -> CacheEntries:
    return CacheEntries(env.dirs.prompt_cache, env.cache_max_bytes)


def cache_info(env: Environment) -> dict[str, Any]:
    return cache_of(env).info()


def clear_cache(env: Environment) -> int:
    return cache_of(env).clear()
