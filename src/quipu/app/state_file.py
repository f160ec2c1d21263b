"""A local session's context state in a state file beside its transcript: written whole, or
only what a turn added as a piece of the state's log (`store/statefile.py`, `store/chain.py`);
in a chat, written while the user types. What the file holds is kept here (`Chain`), known from
the last save or from the resume that read it.

A hybrid or recurrent model's recurrent state is kept apart from its cells (`Memory.state_since`
gives the cells alone), in two files of one state each: a save writes the state where it ends
into the one that does not hold the state where the last prompt began (the one before), so a
turn writes one recurrent state beside its cells, and a session keeps two: a resume sets the
last, an /undo or a retry of the last turn goes back to the other. A rewrite of the whole file
(`_whole`) is of the cells alone."""

from __future__ import annotations

import json
import secrets
import threading
from typing import Any, Callable

from quipu import __version__
from quipu.app.environment import DEFAULT_MAX_STATE_BYTES
from quipu.engine.checkpoints import Checkpoint
from quipu.engine.kvstate import LAYOUT
from quipu.errors import SnapshotError
from quipu.sessions.inference import InferenceSession
from quipu.store.chain import Chain, tokens_digest
from quipu.store.statefile import StateBlob
from quipu.store.store import KEEP_STATE, RECURRENT_SLOTS, SessionStore
from quipu.store.transcript import Transcript

# The log's pieces are put together into one state file again when they outgrow it twice over,
# or number MAX_PIECES and outgrow it at all: a rewrite then writes at most 1.5 (or 2) times what
# the pieces since the last one wrote, so a turn's cells are written 2.5 (at most 3) times on
# average, its piece included, and a long chat's file is rewritten ever more rarely as it grows.
# A recurrent state is never rewritten (it is kept apart).
MAX_PIECES = 64
GROWTH = 2
APART = "apart"  # a state file's "recurrent": its recurrent state is kept apart (in the slots)


def state_key(session: InferenceSession, held: int | None = None) -> tuple[Any, ...]:
    """What a state file's bytes depend on: the decoded tokens (the first `held` of them, where
    it holds fewer) and the context settings."""
    key = session.backend.context.state_key()
    held = session.n_decoded if held is None else held
    return (held, tokens_digest(session.tokens[:held]), tuple(sorted(key.items())))


class StateFile:
    """Writes a local session's state file. `fingerprint`: the model's, which the file names."""

    def __init__(self, fingerprint: str, max_state_bytes: int = DEFAULT_MAX_STATE_BYTES, *, verbose: bool = False):
        self.fingerprint = fingerprint
        self.max_state_bytes = max_state_bytes
        self.verbose = verbose
        # What the file on disk holds (decoded tokens and context settings), when it is known to
        # be current: a save with nothing new in the context leaves the file alone.
        self._saved: tuple[Any, ...] | None = None
        self._chain: Chain | None = None  # what the state file and its log hold, when known
        self._background = False  # (a chat's: the state written while the user types)
        self._writer: threading.Thread | None = None
        self._failed: str | None = None
        # What each recurrent state file holds (`_slot`), once read or written
        # (None: not yet known; a slot's None: nothing usable).
        self._slots: list[tuple[int, str, str] | None] | None = None

    def holds(self, chain: Chain | None, session: InferenceSession | None = None) -> None:
        """What a resume found in the file: its chain (None: nothing it can add to), and, where
        `session` was restored from it whole, that the file is current for it."""
        self._chain = chain
        self._saved = state_key(session) if session is not None else None
        self._slots = None

    def write_behind(self) -> None:
        """From now on a save takes the state's bytes and writes them while the user types
        (`wait` waits for that write and says what went wrong with it)."""
        self._background = True

    def save(self, store: SessionStore, name: str, record: Transcript, session: InferenceSession,
             until: int | None = None) -> list[str]:
        """Transcript and state, each atomically: at worst the turn in progress is lost. The
        state is written only when the context's decoded tokens or settings changed, and then
        only what the turn added where it can be (a piece of the state log). Written behind (a
        chat), the state's bytes are taken now, the transcript written, and the state written
        while the user types: a crash before it is on disk costs re-reading that turn. `until`:
        where the next turn goes back to, when it is known to go back (a recurrent memory's save
        then ends at its checkpoint there, the state written that one: what follows it would be
        read again anyway)."""
        notices = self.wait()
        if self.verbose and session.went_back:
            notices.append(f"session '{name}': the context {session.went_back}")
        held = session.save_point(until)
        key = state_key(session, held)
        if key == self._saved and store.has_state(name):
            store.save(name, record, KEEP_STATE)
        else:
            write, why = self._piece(store, name, session, key, session.take_low_water(), held,
                                     branched=bool(record.tree and record.tree["branches"]))
            if write is None:
                if self.verbose and self._chain is not None:
                    notices.append(f"session '{name}': the context state is saved whole ({why})")
                write = self._whole(store, name, record, session, key)
            if session.backend.memory.recurrent:
                write = _then(write, self._recurrent(store, name, record, session, held))
            self._saved = key
            if self._background:
                store.save(name, record, KEEP_STATE)
                self._writer = threading.Thread(target=self._write, args=(write, name), daemon=True)
                self._writer.start()
            else:
                write()
                store.save(name, record, KEEP_STATE)
        return notices + [f"session '{dropped}' lost its saved context to the disk budget; it will be re-read"
                          for dropped in store.enforce_budget(self.max_state_bytes, keep=name)]

    def _write(self, write: Callable[[], None], name: str) -> None:
        try:
            write()
        except Exception as exc:  # (the transcript is safe: the turn is read again on resume)
            self._saved, self._chain, self._slots = None, None, None
            self._failed = f"session '{name}': its context state could not be written ({exc}); it will be re-read"

    def wait(self) -> list[str]:
        """Waits for a state being written in the background; what went wrong with it."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        failed, self._failed = self._failed, None
        return [failed] if failed else []

    def _whole(self, store: SessionStore, name: str, record: Transcript, session: InferenceSession,
               key: tuple[Any, ...]) -> Callable[[], None]:
        """The state of the first `key[0]` tokens saved whole (a new state file; the log after the
        old one goes), to write: a recurrent memory's cells alone (its state is kept apart)."""
        memory, held = session.backend.memory, key[0]
        nonce = secrets.token_hex(8)
        meta = {
            "fingerprint": self.fingerprint,
            "build": session.backend.build,
            "context": record.context,
            "n_decoded": held,
            "tokens_sha256": key[1],
            "quipu": __version__,
            "created": record.updated,
            "nonce": nonce,  # (the pieces of the log after it name it)
            "tokens": session.tokens[:held],
            **({"recurrent": APART} if memory.recurrent else {}),
        }
        # (a recurrent memory's cells all: those past `held` go when its state there is set)
        state = memory.state_since(0) if memory.recurrent else memory.snapshot_bytes()

        def write() -> None:
            store.write_state(name, state, meta)
            self._chain = Chain(nonce, held, base_bytes=len(state))

        return write

    def _piece(self, store: SessionStore, name: str, session: InferenceSession, key: tuple[Any, ...],
               low_water: int, held: int, branched: bool = False) -> tuple[Callable[[], None] | None, str | None]:
        """Only the cells the context gained since the last save (the context has held no fewer
        than `low_water` tokens since), up to its first `held` tokens, as a piece of the state
        log on top of the piece the context's state followed (its parent), to write; or None
        and why it cannot be (the state is then saved whole). Where the conversation has other
        branches, whose states are paths of the log too, it is never saved whole while a piece
        can hold it: a path grown long starts again from the first cell."""
        chain, backend = self._chain, session.backend
        if chain is None or chain.nonce is None or not store.has_state(name):
            return None, "no state file to add to"
        # The piece replaces the cells from where the context went back to, if it did (the
        # last reply's end token, which the template writes its own way; an /undo), and adds the new.
        start = min(low_water, chain.held)
        if branched and chain.pieces >= MAX_PIECES:
            start = 0
        unsupported = backend.memory.partial_state(start)
        if unsupported:
            return None, f"{unsupported} is saved whole"
        if held < start or not branched and (held - start) * 2 > held:  # (none new: a piece that only cuts)
            return None, "most of the context is new"
        if not branched and chain.piece_bytes > chain.base_bytes * (1 if chain.pieces >= MAX_PIECES else GROWTH):
            return None, "the pieces are many: put together again"
        piece = backend.memory.state_since(start, held)
        try:
            made = backend.memory.check_piece(piece, start, held - start)
        except SnapshotError as exc:
            return None, f"the state's layout is not the one quipu reads: {exc}"
        if made.v_trans is not None and made.v_trans != backend.context.v_trans:  # (a piece of no cells says none)
            return None, "the state's V layout is not the one its context settings record"
        made_id = secrets.token_hex(8)
        meta = {"base": chain.nonce, "start": start, "n_decoded": held, "tokens_sha256": key[1],
                "layout": LAYOUT, "build": backend.build, "id": made_id, "parent": chain.tip or chain.nonce}

        def write() -> None:
            end = store.append_piece(name, meta, piece, chain.log_end)
            path = 1 if start == 0 else chain.pieces + 1
            self._chain = Chain(chain.nonce, held, path, chain.piece_bytes + len(piece), chain.base_bytes, end,
                                made_id)

        return write, None

    def _recurrent(self, store: SessionStore, name: str, record: Transcript, session: InferenceSession,
                   held: int) -> Callable[[], None]:
        """The recurrent state after the first `held` tokens, to write into the slot that does not
        hold the nearest state before it on the history's way (where the last prompt began);
        nothing where a slot holds it already."""
        if self._slots is None:
            self._slots = [_slot(meta) for meta in store.recurrent_metas(name)]
        slots = self._slots
        meta = {"fingerprint": self.fingerprint, "build": session.backend.build, "context": record.context,
                "n": held, "tokens_sha256": tokens_digest(session.tokens[:held]), "quipu": __version__}
        made = _slot(meta)
        if made in slots:  # (an /undo back to where the last save ended: the state is there)
            return lambda: None
        state = session.backend.memory.recurrent_at(held)
        meta["at"] = state.at
        on_way = [i for i, s in enumerate(slots) if s is not None and made is not None and s[0] < held
                  and s[2] == made[2] and s[1] == tokens_digest(session.tokens[:s[0]])]
        keep = max(on_way, key=lambda i: slots[i][0], default=None)  # type: ignore[index]
        slot = next(i for i in range(RECURRENT_SLOTS) if i != keep)

        def write() -> None:
            store.write_recurrent(name, slot, state.state, meta)
            slots[slot] = made

        return write


def _slot(meta: dict[str, Any] | None) -> tuple[int, str, str] | None:
    """What a recurrent state file's metadata says it holds: (tokens, their digest, what it was
    made under: the model, the build, the context settings)."""
    if meta is None or not isinstance(meta.get("n"), int) or not isinstance(meta.get("tokens_sha256"), str):
        return None
    made = [meta.get("fingerprint"), meta.get("build"), meta.get("context")]
    return meta["n"], meta["tokens_sha256"], json.dumps(made, sort_keys=True)


def _then(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        first()
        second()

    return both


def saved_recurrent(found: list[StateBlob], meta: dict[str, Any], tokens: list[int],
                    cells: int) -> list[Checkpoint]:
    """Of the recurrent states a session's files hold (`SessionStore.load_recurrent`), those a
    resume can set, oldest first: made with the state file's model, build and context settings,
    of `tokens`' beginnings, and within the first `cells` tokens the state file and log hold."""
    usable = []
    for blob in found:
        m = blob.meta
        n, at = m.get("n"), m.get("at")
        if not isinstance(n, int) or not isinstance(at, int) or not 0 < n <= cells or at <= 0 \
                or any(m.get(k) != meta.get(k) for k in ("fingerprint", "build", "context")) \
                or m.get("tokens_sha256") != tokens_digest(tokens[:n]):
            continue
        usable.append(Checkpoint(n, at, blob.state, kept=True))
    return sorted(usable, key=lambda c: c.n)
