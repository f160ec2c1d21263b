"""What `quipu sessions ...` does, as plain functions over the store."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from quipu.app.environment import Environment
from quipu.engine.base import MEDIA_MARK
from quipu.errors import UsageError
from quipu.store.store import SessionInfo, SessionStore

if TYPE_CHECKING:
    from quipu.app.branches import BranchRow
    from quipu.store.transcript import Transcript


def _store(env: Environment) -> SessionStore:
    return SessionStore(env.dirs.sessions)


def list_sessions(env: Environment) -> tuple[list[SessionInfo], list[str]]:
    return _store(env).list()


def exposed_folders(env: Environment) -> list[str]:
    """quipu's folders of conversations, cache and history that other accounts can read or enter."""
    from quipu.paths import shared_with_others

    folders = (env.dirs.data, env.dirs.sessions, env.dirs.models, env.dirs.cache, env.dirs.prompt_cache,
               env.dirs.state)
    return [str(f) for f in folders if shared_with_others(f)]


def session_names(env: Environment) -> list[str]:
    return _store(env).names()


def transcript(env: Environment, name: str) -> dict[str, Any]:
    """The readable part of a session: name, model, settings, messages (without token ids)."""
    store = _store(env)
    record = store.load_transcript(name)
    info = store.info(name)
    return {
        "name": name,
        "model": record.model.get("name"),
        "created": record.created,
        "updated": record.updated,
        "params": record.params,
        "context": record.context,
        "context_tokens": info.tokens,
        "size_bytes": info.size_bytes,
        "messages": [_readable(m, record.media) for m in record.messages],
        **({"branches": branch_tree(record)} if record.tree else {}),
    }


def branch_tree(record: "Transcript") -> list[dict[str, Any]]:
    """Every branch of a session as people read it: the tree's rows (`branches.rows`), each
    with its messages, whole."""
    from quipu.app.branches import rows
    from quipu.store.branches import current_branch, other_branches

    here, others = current_branch(record), other_branches(record)
    by_id = {b.id: b for b in [here, *others]}
    return [{**r.to_json(), "messages": [_readable(m, by_id[r.id].media) for m in by_id[r.id].messages]}
            for r in rows(here, others)]


def tree(env: Environment, name: str) -> list["BranchRow"]:
    """A session's branches, in the order a tree shows them (`branches.rows`)."""
    from quipu.app.branches import rows
    from quipu.store.branches import current_branch, other_branches

    record = _store(env).load_transcript(name)
    return rows(current_branch(record), other_branches(record))


def _readable(message: dict[str, Any], media: list[dict[str, Any]]) -> dict[str, Any]:
    """A message as people read it: a reply's reasoning beside its answer, markup and tokens
    aside, each medium in it as `[image: NAME]` (and named in `media`)."""
    out: dict[str, Any] = {k: message[k] for k in ("role", "content", "tool_calls", "tool_call_id", "name")
                           if k in message}
    if isinstance(message.get("reasoning"), str) and message["reasoning"].strip():
        out["reasoning"] = message["reasoning"].strip()
    held = []

    def shown(found: re.Match[str]) -> str:
        k = int(found.group(1))
        if k >= len(media):
            return str(found.group(0))
        held.append(media[k])
        after = out["content"][found.end():found.end() + 1]
        return f"[{media[k]['kind']}: {media[k]['name']}]" + ("\n" if after and after != "\n" else "")

    out["content"] = MEDIA_MARK.sub(shown, out["content"])
    if held:
        out["media"] = held
    return out


def spelled_calls(message: dict[str, Any]) -> list[str]:
    """An assistant message's calls as `name({"arguments"})`, one a line."""
    from quipu.sessions.toolspec import spell_call

    return [spell_call(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or ()]


def export(env: Environment, name: str, fmt: str) -> str:
    data = transcript(env, name)
    if fmt == "json":
        return json.dumps(data, ensure_ascii=False, indent=2) + "\n"
    if fmt == "markdown":
        lines = [f"# {name}", "", f"Model: {data['model']}. Last used: {data['updated']}.", ""]
        for m in data["messages"]:
            head = f"## Tool result ({m['name']})" if m["role"] == "tool" and m.get("name") else f"## {m['role'].capitalize()}"
            lines += [head, ""]
            if m.get("reasoning"):
                lines += ["> " + line if line else ">" for line in m["reasoning"].splitlines()] + [""]
            lines += [m["content"].rstrip(), ""]
            lines += [f"Calls `{call}`" for call in spelled_calls(m)] + ([""] if m.get("tool_calls") else [])
        return "\n".join(lines)
    raise UsageError(f"--format must be markdown or json, not '{fmt}'")


def remove(env: Environment, names: list[str]) -> None:
    store = _store(env)
    for name in names:
        store.remove(name)
    prune_media(store)


def prune_media(store: SessionStore) -> None:
    """Removes the media no session names any more (none while a transcript cannot be read:
    what it names is not known)."""
    from quipu.app.local_media import media_store, referenced_media

    referenced = referenced_media(store)
    if referenced is not None:
        media_store(store).prune(referenced)


def rename(env: Environment, old: str, new: str) -> None:
    _store(env).rename(old, new)


def fork(env: Environment, src: str, dst: str, branch: int | None = None) -> None:
    """`src` copied as `dst`; with `branch`, that branch of it alone (its state files are copied
    whole: each branch's state is found in them by its tokens)."""
    from quipu.store.branches import only
    from quipu.store.store import KEEP_STATE

    store = _store(env)
    if branch is not None:
        record = store.load_transcript(src)
        try:
            alone = only(record, branch)
        except KeyError:
            raise UsageError(f"session '{src}' has no branch {branch} (`quipu sessions tree {src}` shows them)") from None
    store.fork(src, dst)
    if branch is not None:
        with store.lock(dst):
            store.save(dst, alone, KEEP_STATE)
