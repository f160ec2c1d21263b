"""A named session's context on llama.cpp's llama-server, kept in a slot file of the server's
between turns (`SlotFile`): what `LlamaServerSession` restores before a turn and saves after it.
The file's name is the session's to keep (in its transcript)."""

from __future__ import annotations

import uuid
import zlib
from typing import Any

from quipu.engine.http import ServerError
from quipu.engine.llama_server import LlamaServerModel


class SlotFile:
    """A named session's context on llama.cpp's llama-server, kept in a slot file between turns
    (the server must be started with --slot-save-path). Before a turn the file is restored into
    the session's slot, unless the slot is as the last save left it (the same last task, the same
    size: a chat's next turn), after it the slot is saved; the conversation is sent whole all the
    same, so the server reuses what the slot holds and reads only the rest. That it was reused is
    checked on the reply's cached-token count against what the new prompt shares with the held
    context: when it was not, the turn was read again (correct, only slower), and a warning says
    so. Other servers: nothing is done."""

    def __init__(self, filename: str | None, name: str = ""):
        self.name = name  # the session's, for the notices
        self.notices: list[str] = []  # what went wrong with a turn's slot, to be said
        self.filename = filename
        self.restored = 0  # the tokens the slot holds for the session when a turn starts
        self.slot = -1
        self.why_not = ""
        self.saved = 0
        self.left: tuple[Any, ...] | None = None  # how the slot looked after the last save

    def before(self, served: LlamaServerModel) -> int:
        """Restores the session's file into its slot; the slot to use (-1: the server has none)."""
        slots = served.slots()
        if not slots:
            return -1
        self.why_not, self.restored = "", 0
        filename = self.filename
        if filename is None:  # a new session (or a server that kept no file): nothing to restore
            self.filename = f"quipu-{uuid.uuid4().hex}.bin"
            self.slot = self.slot_of(slots)
            return self.slot
        self.slot = self.slot_of(slots)
        if self.left is not None and served.slot_look(self.slot) == self.left:
            self.restored = self.saved  # nobody used the slot since: it holds the session still
            return self.slot
        try:
            self.restored = served.slot_file(self.slot, "restore", filename)
        except ServerError as exc:
            self.restored, self.why_not = 0, str(exc)
        return self.slot

    def slot_of(self, slots: int) -> int:
        return zlib.crc32((self.filename or "").encode()) % slots

    def after(self, served: LlamaServerModel, cached_tokens: int, held: int) -> None:
        """Saves the slot; says (`notices`) where a context was not reused (`held`: the tokens the
        turn's prompt shared with the session's context)."""
        if self.slot < 0:
            return
        notices = self.notices
        expected = min(self.restored, held)
        if self.why_not:
            notices.append(f"session '{self.name}': its context could not be restored on llama-server "
                           f"({self.why_not}); the conversation was read again")
        elif expected and cached_tokens < expected * 0.9:
            notices.append(f"session '{self.name}': llama-server did not reuse its context ({cached_tokens} of "
                           f"{expected} tokens); the conversation was read again")
        self.left = None
        assert self.filename is not None  # (named by `before`, which gave the slot)
        try:
            self.saved = served.slot_file(self.slot, "save", self.filename)
        except ServerError:
            self.filename = None  # the server keeps no slot files (no --slot-save-path): nothing to restore
            return
        self.left = served.slot_look(self.slot)
