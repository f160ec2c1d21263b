"""Responses a server keeps (the Responses API's `store`): each kept beside the session its
conversation goes on in, with how many of that session's messages end at it and their digest, so
that a request that goes on from it (`previous_response_id`) finds its conversation, on whichever
branch of the session it is, and goes on from the kept context."""

from __future__ import annotations

from typing import Any, Sequence

from quipu.app.environment import Environment
from quipu.app.turns import Following, digest
from quipu.sessions.base import Message
from quipu.store.responses import KeptResponse, ResponseStore

__all__ = ["KeptResponse", "keep", "kept_response", "forget", "following"]


def _store(env: Environment) -> ResponseStore:
    return ResponseStore(env.dirs.data / "responses")


def keep(env: Environment, ident: str, session: str, messages: Sequence[Message], response: dict[str, Any],
         input_items: list[Any]) -> None:
    """Keeps a response whose turn session `session` has kept, its conversation `messages`."""
    _store(env).put(KeptResponse(ident, session, len(messages), digest(messages), response, input_items))


def kept_response(env: Environment, ident: str) -> KeptResponse | None:
    return _store(env).get(ident)


def forget(env: Environment, ident: str) -> bool:
    """Removes a kept response (its conversation stays in its session); whether there was one."""
    return _store(env).remove(ident)


def following(kept: KeptResponse, system: str | None) -> Following:
    """Where a request that goes on from `kept` goes on from (`system`: its own instructions)."""
    return Following(kept.at, kept.digest, system)
