"""The log of answers as quipu keeps it (`store/logbook.py`): each answer of `run` (a batch's
rows too) and each chat turn written once it is out; on unless `logs off`, `[logs] enabled =
false` or `--no-log`; bounded by `[logs] max_records` (100,000 by default) and `max_days`. A log
that cannot be written costs one warning, never the answer. A follow-up (`run -F`, `chat -F`,
`--cid ID`) reads its conversation back from it."""

from __future__ import annotations

import os
from contextlib import closing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TYPE_CHECKING, Mapping, Sequence

from quipu.app.environment import DEFAULT_MAX_RECORDS, Environment
from quipu.errors import UsageError
from quipu.paths import create_private, private_dir
from quipu.store.logbook import Logbook, LogError
from quipu.store.logbook import Record as Record  # (what `quipu logs` shows)

if TYPE_CHECKING:
    from quipu.app.answer import Answer
    from quipu.app.attachments import Attachment
    from quipu.app.turn_options import TurnOptions
    from quipu.sessions.conversation import Message


def _off_mark(env: Environment) -> Path:
    return env.dirs.data / "logs-off"  # (`quipu logs off`: a mark, as the log itself may be damaged)


def logging_on(env: Environment) -> bool:
    """Whether answers are logged: not turned off by `quipu logs off` or the config."""
    return env.config.logs.get("enabled", True) and not _off_mark(env).exists()


def set_logging(env: Environment, on: bool) -> None:
    mark = _off_mark(env)
    if on:
        mark.unlink(missing_ok=True)
    elif not mark.exists():
        private_dir(mark.parent)
        os.close(create_private(mark))


def open_log(env: Environment) -> Logbook:
    return Logbook(env.log_path)


def log_answer(env: Environment, options: Mapping[str, Any] | None, command: str, prompt: str | None,
               result: Answer, *, system: str | None = None, conversation: str = "",
               attachments: Sequence["Attachment"] = (), log: Logbook | None = None,
               unkept: bool = False, parent: int | None = None) -> tuple[int | None, str | None]:
    """Writes one answer to the log with the options that shaped it (`TurnOptions.logged`; None:
    `--no-log`), unless logging is off; a warning where it could not be written, else None.
    `unkept`: the answer followed messages the log does not keep (`--messages`, a batch row's,
    a server request's), which a follow-up cannot give again (`followed`); `parent`, the answer
    it follows up. Returns its id (None: not logged) and the warning."""
    if options is None or not logging_on(env):
        return None, None
    s = result.stats
    record = Record(
        prompt=prompt or "", answer=result.text, model=result.model, command=command, conversation=conversation,
        system=system,
        reasoning=result.reasoning or None, fingerprint=result.fingerprint,
        tool_calls=[c.to_json() for c in result.tool_calls],
        attachments=[{"name": a.name, "sha256": a.digest} for a in attachments],
        options={**options, "seed": result.seed, **({"messages": "not kept"} if unkept else {})},
        finish_reason=result.finish_reason,
        prompt_tokens=s.prompt_tokens, completion_tokens=s.completion_tokens, cached_tokens=s.cached_tokens,
        timings={"prefill_s": round(s.prefill_s, 4), "decode_s": round(s.decode_s, 4), "ttft_s": round(s.ttft_s, 4)},
        session=result.session, parent=parent)
    book = log if log is not None else open_log(env)
    try:
        made = book.add(record, max_records=env.config.logs.get("max_records", DEFAULT_MAX_RECORDS),
                        max_days=env.config.logs.get("max_days"))
    except LogError as exc:
        return None, f"the answer was not logged: {exc}"
    finally:
        if log is None:
            book.close()
    return made, None


@dataclass(frozen=True)
class Followed:
    """The logged conversation a follow-up goes on with: its exchanges as messages, its id, and
    its system prompt."""

    messages: list["Message"]
    conversation: str
    system: str | None
    parent: int | None = None  # the answer it goes on from


def followed(env: Environment, cid: str | None) -> Followed:
    """The last logged conversation (to its last answer), or the one the record `cid` (an id)
    belongs to, up to that record."""
    from quipu.sessions.conversation import Message

    book = open_log(env)
    try:
        if cid is None:
            last = book.last()
            if last is None:
                raise UsageError("no answer is logged yet to follow up (`quipu logs` lists them)")
        else:
            if not (cid.isascii() and cid.isdigit() and len(cid) <= 18):  # (as SQLite holds an id)
                raise UsageError(f"--cid takes a logged answer's id (`quipu logs` lists them), not '{cid[:40]}'")
            last = book.get(int(cid))
            if last is None:
                raise UsageError(f"no logged answer has the id {cid} (`quipu logs` lists them)")
        records = path_to(book, last)
    except LogError as exc:
        raise UsageError(f"cannot follow up: {exc}") from None
    finally:
        book.close()
    for r in records:  # (a follow-up gives the model all it read, or is refused: never less, silently)
        if r.attachments or r.options.get("messages"):
            from quipu.shown import shown

            what = (f"files ({', '.join(shown(str(a.get('name')))[:60] for a in r.attachments)})" if r.attachments
                    else "earlier messages (--messages, a batch row's, a server request's)")
            raise UsageError(f"cannot follow up answer #{last.id}: its conversation read {what}, which the log "
                             "does not keep; give them again (-a FILE, --messages FILE), or go on in a session (-S NAME)")
    messages: list[Message] = []
    for r in records:
        messages += [Message("user", r.prompt), Message("assistant", r.answer, logged=r.id)]
    return Followed(messages, last.conversation, records[0].system if records else None, last.id)


# A logged answer's parent where its conversation begins with it (no answer has the id 0); None is
# an answer of a log of before parents were kept.
ROOT = 0


def follows(messages: Sequence[Message]) -> int | None:
    """The logged answer the next answer of a conversation (`messages`, its branch as it stands)
    follows up: the last reply before its last message of the user's (`Message.logged`); ROOT
    where there is none before; None where the replies before were not given ids (a session of
    before: the log's rule of before, the conversation up to it, holds)."""
    last = max((i for i, m in enumerate(messages) if m.role == "user"), default=len(messages))
    replies = [m for m in messages[:last] if m.role == "assistant"]
    found = next((m.logged for m in reversed(replies) if m.logged is not None), None)
    return found if found is not None else ROOT if not replies else None


def mark_logged(messages: list[Message], made: int | None) -> None:
    """Gives the reply that ends `messages` its id in the log (`made`; None: not logged)."""
    if made is not None and messages and messages[-1].role == "assistant":
        messages[-1] = replace(messages[-1], logged=made)


def path_to(book: Logbook, last: Record) -> list[Record]:
    """The answers `last` follows up, one from another, oldest first, and itself: its branch of
    the conversation (answers of before `parent` was logged: the conversation's, up to it)."""
    path = [last]
    while path[-1].parent and len(path) < 10_000:  # (ROOT: the conversation begins here)
        up = book.get(path[-1].parent)
        if up is None or up.conversation != last.conversation or up in path:
            break  # (an answer removed since: the path starts after it)
        path.append(up)
    if len(path) == 1 and last.conversation not in ("", str(last.id)) and last.parent is None:
        return book.conversation(last.conversation, upto=last.id)
    return path[::-1]


def since_time(text: str) -> float:
    """A moment `--since` names: a date (2026-12-01), a date and time (2026-12-01T14:00), or a
    span back from now (90m, 12h, 3d, 2w)."""
    import re
    import time
    from datetime import datetime

    text = text.strip()
    span = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smhdw])", text)
    if span:
        seconds = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[span.group(2)]
        return time.time() - float(span.group(1)) * seconds
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise UsageError(f"--since takes a date (2026-12-01), a date and time (2026-12-01T14:00) or a span "
                         f"back from now (90m, 12h, 3d, 2w), not '{text}'") from None


MAX_ID = 10**18 - 1  # the largest id or count the log takes (SQLite's integers hold 2**63 - 1)


def find_answers(env: Environment, *, query: str | None = None, model: str | None = None,
                 session: str | None = None, since: str | None = None, limit: int = 10) -> list[Record]:
    if not 1 <= limit <= MAX_ID:
        raise UsageError(f"-n takes a count of answers, from 1 to {MAX_ID:,}, not {str(limit)[:40]}")
    if query is not None and not query.strip():
        raise UsageError("-q takes words to search for")
    moment = since_time(since) if since is not None else None
    with closing(open_log(env)) as book:
        return book.find(query=query, model=model, session=session, since=moment, limit=limit)


def checked_id(record_id: int) -> int:
    """An answer's id as the log can hold one (SQLite's integers are 64-bit)."""
    if not 1 <= record_id <= MAX_ID:
        raise UsageError(f"an answer's id is from 1 to {MAX_ID:,} (`quipu logs` lists them), not {str(record_id)[:40]}")
    return record_id


def answer(env: Environment, record_id: int) -> Record:
    checked_id(record_id)
    with closing(open_log(env)) as book:
        found = book.get(record_id)
    if found is None:
        raise UsageError(f"no logged answer has the id {record_id} (`quipu logs` lists them)")
    return found


def answers_before(env: Environment, record: Record) -> list[int]:
    """The ids of the answers `record` follows up, one from another, oldest first (`path_to`)."""
    with closing(open_log(env)) as book:
        return [r.id for r in path_to(book, record)[:-1] if r.id is not None]


def remove_answers(env: Environment, ids: Sequence[int] = (), before: str | None = None,
                   everything: bool = False) -> int:
    if sum((bool(ids), before is not None, everything)) != 1:
        raise UsageError("logs rm takes ids, or --before DATE, or --all (one of them)")
    for record_id in ids:
        checked_id(record_id)
    with closing(open_log(env)) as book:
        return book.remove(ids=ids, before=since_time(before) if before is not None else None, everything=everything)



def session_from_log(env: Environment, record_id: int, name: str, opts: "TurnOptions") -> int:
    """Makes the new session `name` of the logged conversation up to the answer `record_id`, on
    that answer's model (or `opts.model`); its context is read on its first turn. How many
    exchanges it holds."""
    checked_id(record_id)
    from dataclasses import replace

    from quipu.app.choose import open_host
    from quipu.app.named import NamedSession, store_for
    from quipu.errors import SessionExists
    from quipu.store.store import validate_name

    found = answer(env, record_id)
    history = followed(env, str(record_id))
    validate_name(name)
    store = store_for(env)
    opts = replace(opts, model=opts.model or found.model, system=opts.system or history.system)
    with closing(open_host(opts.server)) as host, store.lock(name):
        if store.exists(name):
            raise SessionExists(f"session '{name}' exists already; give another name")
        named = NamedSession.open(store, name, opts, env, host)
        try:
            named.conversation.extend(history.messages)
            named.save()
        finally:
            named.close()
    return len(history.messages) // 2
