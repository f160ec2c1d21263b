"""The log of answers: every reply quipu gives, one record each, in a SQLite database in the
data folder (0600, its WAL and shared-memory files too: SQLite makes them with the database's
own mode), searched with SQLite's FTS5.

Many processes write it at once (a batch, a chat and a run): WAL lets readers and one writer
work together, and a writer that finds it busy waits up to BUSY_MS. A record is written in one
transaction; a database that cannot be read, written or locked raises LogError, which the
caller turns into one warning (an answer never waits on its log, nor fails with it)."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from quipu.errors import QuipuError, UsageError
from quipu.paths import open_private, private_dir

BUSY_MS = 2000
SCHEMA = 2  # (2: `parent`, the answer one follows up)

_TABLES = """
CREATE TABLE IF NOT EXISTS answers (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    conversation TEXT NOT NULL,
    command TEXT NOT NULL,
    model TEXT NOT NULL,
    fingerprint TEXT,
    system TEXT,
    prompt TEXT NOT NULL,
    answer TEXT NOT NULL,
    reasoning TEXT,
    tool_calls TEXT,
    attachments TEXT,
    options TEXT,
    finish_reason TEXT,
    prompt_tokens INTEGER,
    completion_tokens INTEGER,
    cached_tokens INTEGER,
    timings TEXT,
    session TEXT,
    parent INTEGER
);
CREATE INDEX IF NOT EXISTS answers_conversation ON answers (conversation, id);
CREATE INDEX IF NOT EXISTS answers_at ON answers (at);
CREATE VIRTUAL TABLE IF NOT EXISTS answers_text USING fts5(
    system, prompt, answer, reasoning, content='answers', content_rowid='id'
);
CREATE TRIGGER IF NOT EXISTS answers_in AFTER INSERT ON answers BEGIN
    INSERT INTO answers_text (rowid, system, prompt, answer, reasoning)
    VALUES (new.id, new.system, new.prompt, new.answer, new.reasoning);
END;
CREATE TRIGGER IF NOT EXISTS answers_out AFTER DELETE ON answers BEGIN
    INSERT INTO answers_text (answers_text, rowid, system, prompt, answer, reasoning)
    VALUES ('delete', old.id, old.system, old.prompt, old.answer, old.reasoning);
END;
"""


class LogError(QuipuError):
    """The log of answers could not be read or written."""


class BadSearch(UsageError):
    """A search that SQLite's full-text search cannot read."""


@dataclass
class Record:
    """One answer, as the log keeps it."""

    prompt: str
    answer: str
    model: str
    command: str = "run"
    conversation: str = ""  # the first record's of the conversation (its own for a first exchange)
    system: str | None = None
    reasoning: str | None = None
    fingerprint: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    attachments: list[dict[str, Any]] = field(default_factory=list)  # {"name", "sha256"}
    options: dict[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    timings: dict[str, float] = field(default_factory=dict)
    session: str | None = None
    parent: int | None = None  # the answer this one follows up (a branch of its conversation from there)
    id: int | None = None
    at: float = 0.0

    _JSON = ("tool_calls", "attachments", "options", "timings")

    def row(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "id"}
        for k in self._JSON:
            out[k] = json.dumps(out[k], ensure_ascii=False) if out[k] else None
        return out

    @classmethod
    def of(cls, row: sqlite3.Row) -> "Record":
        """The record a row holds: the columns quipu knows (a table another tool added to keeps
        its own), each of the shape quipu writes; LogError where one is not (a row written by
        hand), naming it."""
        values = {k: row[k] for k in row.keys() if k in _SHAPES}
        for k, shape in _SHAPES.items():
            value = values.get(k)
            if k in cls._JSON:
                empty: list[Any] | dict[str, Any] = [] if shape is list else {}
                try:
                    value = json.loads(value) if value else empty
                except (ValueError, TypeError, RecursionError):
                    value = empty
                fits = isinstance(value, shape) and (shape is dict or all(isinstance(v, dict) for v in value))
            else:
                fits = isinstance(value, shape) and not isinstance(value, bool)
            if not fits:
                raise LogError(f"the log of answers holds an answer (id {values.get('id')!r:.40}) whose {k} is not "
                               f"what quipu writes there; `quipu logs rm` it, or mend it with any SQLite tool")
            values[k] = value
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.at)),
                **{k: v for k, v in self.__dict__.items() if k not in ("id", "at")}}


# The shape of each of a record's columns, as quipu writes them (the JSON ones once read).
_SHAPES: dict[str, Any] = {
    "prompt": str, "answer": str, "model": str, "command": str, "conversation": str,
    **{k: (str, type(None)) for k in ("system", "reasoning", "fingerprint", "finish_reason", "session")},
    "tool_calls": list, "attachments": list, "options": dict, "timings": dict,
    **{k: (int, type(None)) for k in ("prompt_tokens", "completion_tokens", "cached_tokens", "parent")},
    "id": int, "at": (int, float),
}


class Logbook:
    """The log database at `path`, opened (and made, 0600) on first use."""

    def __init__(self, path: Path):
        self.path = path
        self._db: sqlite3.Connection | None = None

    def _open(self) -> sqlite3.Connection:
        if self._db is not None:
            return self._db
        try:
            private_dir(self.path.parent)
            if not self.path.exists():  # (made private before SQLite opens it: its WAL files take its mode)
                os.close(open_private(self.path, os.O_RDWR))
            db = sqlite3.connect(self.path, timeout=BUSY_MS / 1000, isolation_level=None)
            db.row_factory = sqlite3.Row
            db.execute(f"PRAGMA busy_timeout = {BUSY_MS}")
            if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = NORMAL")  # (WAL: a crash may lose the last record, never the file)
            if db.execute("PRAGMA user_version").fetchone()[0] != SCHEMA:
                db.executescript(_TABLES)
                if "parent" not in {c[1] for c in db.execute("PRAGMA table_info(answers)")}:  # (a log of before)
                    db.execute("ALTER TABLE answers ADD COLUMN parent INTEGER")
                db.execute(f"PRAGMA user_version = {SCHEMA}")
        except (sqlite3.Error, OSError) as exc:
            raise LogError(f"the log of answers ({self.path}) cannot be opened: {_said(exc)}") from None
        self._db = db
        return db

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def add(self, record: Record, *, max_records: int | None = None, max_days: float | None = None) -> int:
        """Writes `record`, and drops the oldest past the limits, in one transaction; its id."""
        db = self._open()
        row = record.row()
        row["at"] = row["at"] or time.time()
        try:
            with _transaction(db):
                cursor = db.execute(f"INSERT INTO answers ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                                    list(row.values()))
                new = int(cursor.lastrowid or 0)
                if not record.conversation:
                    db.execute("UPDATE answers SET conversation = ? WHERE id = ?", (str(new), new))
                if max_days is not None:
                    db.execute("DELETE FROM answers WHERE at < ?", (time.time() - max_days * 86400,))
                if max_records is not None:
                    db.execute("DELETE FROM answers WHERE id <= ?", (new - max_records,))
        except sqlite3.Error as exc:
            raise LogError(f"the log of answers ({self.path}) could not be written: {_said(exc)}") from None
        return new

    def find(self, *, query: str | None = None, model: str | None = None, session: str | None = None,
             since: float | None = None, limit: int = 10) -> list[Record]:
        """The last `limit` records (newest first), or with `query` the best matches first (FTS5's
        rank), as far as the filters let them through."""
        where: list[str] = []
        args: list[Any] = []
        if model is not None:
            where.append("answers.model LIKE ?")
            args.append(f"%{model}%")
        if session is not None:
            where.append("answers.session = ?")
            args.append(session)
        if since is not None:
            where.append("answers.at >= ?")
            args.append(since)
        if query is not None:
            where.append("answers_text MATCH ?")
            args.append(query)
            sql = (f"SELECT answers.* FROM answers_text JOIN answers ON answers.id = answers_text.rowid "
                   f"WHERE {' AND '.join(where)} ORDER BY rank, answers.id DESC LIMIT ?")
        else:
            sql = (f"SELECT * FROM answers {'WHERE ' + ' AND '.join(where) if where else ''} "
                   f"ORDER BY id DESC LIMIT ?")
        return self._rows(sql, [*args, limit], query)

    def get(self, record_id: int) -> Record | None:
        found = self._rows("SELECT * FROM answers WHERE id = ?", [record_id])
        return found[0] if found else None

    def last(self) -> Record | None:
        found = self._rows("SELECT * FROM answers ORDER BY id DESC LIMIT 1", [])
        return found[0] if found else None

    def conversation(self, conversation: str, upto: int | None = None) -> list[Record]:
        """The records of a conversation, oldest first (up to the record `upto`)."""
        return self._rows("SELECT * FROM answers WHERE conversation = ? AND id <= ? ORDER BY id",
                          [conversation, upto if upto is not None else 2**62])

    def remove(self, *, ids: Sequence[int] = (), before: float | None = None, everything: bool = False) -> int:
        """Drops records by id, older than `before`, or all of them; how many went."""
        db = self._open()
        try:
            with _transaction(db):
                if everything:
                    gone = db.execute("DELETE FROM answers").rowcount
                elif before is not None:
                    gone = db.execute("DELETE FROM answers WHERE at < ?", (before,)).rowcount
                else:
                    gone = sum(db.execute("DELETE FROM answers WHERE id = ?", (i,)).rowcount for i in ids)
            if everything:
                db.execute("VACUUM")
        except sqlite3.Error as exc:
            raise LogError(f"the log of answers ({self.path}) could not be changed: {_said(exc)}") from None
        return gone

    def _rows(self, sql: str, args: list[Any], query: str | None = None) -> list[Record]:
        if query is not None:
            check_search(query)
        return [Record.of(row) for row in self._rows_raw(sql, args)]

    def _rows_raw(self, sql: str, args: list[Any]) -> list[sqlite3.Row]:
        db = self._open()
        try:
            return db.execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            raise LogError(f"the log of answers ({self.path}) cannot be read: {_said(exc)}") from None


def check_search(query: str) -> None:
    """Refuses a search FTS5 cannot read, tried on an empty table in memory (so that what is
    wrong with the words is never taken for what is wrong with the log)."""
    db = sqlite3.connect(":memory:")
    try:
        db.execute("CREATE VIRTUAL TABLE t USING fts5(system, prompt, answer, reasoning)")
        db.execute("SELECT * FROM t WHERE t MATCH ?", (query,)).fetchall()
    except sqlite3.Error as exc:
        raise BadSearch(f"cannot search for {query!r}: {_said(exc)} (words match words; \"quoted text\" a phrase; "
                        "AND, OR, NOT and a trailing * as SQLite's full-text search reads them)") from None
    finally:
        db.close()


class _transaction:
    """BEGIN IMMEDIATE ... COMMIT (the write lock taken at once, so a busy database waits
    BUSY_MS at the start and not halfway), ROLLBACK on failure."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, kind: Any, *_: Any) -> None:
        self.db.execute("COMMIT" if kind is None else "ROLLBACK")


def _said(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__

