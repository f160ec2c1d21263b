"""Text from outside quipu (a file's metadata, the Hub's names, a template, an error naming
them) as a terminal may be given it: control characters (C0, DEL, C1) and the bidirectional
controls that reorder what a line shows (U+202A-202E, U+2066-2069, U+200E/200F, U+061C)
escaped, never written raw."""

from __future__ import annotations

import re

# Every character a terminal acts on or that changes how the rest of a line reads (a tab is
# neither); the same but a new line, for messages of several lines.
UNSAFE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
UNSAFE_IN_LINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def has_unsafe(text: str) -> bool:
    return UNSAFE.search(text) is not None


def _escape(m: re.Match[str]) -> str:
    return m.group().encode("unicode_escape").decode("ascii")


def shown(text: str, *, lines: bool = False) -> str:
    """`text` with each unsafe character written as its escape (`\\x1b`, `\\u202e`); with
    `lines`, its line breaks kept."""
    return (UNSAFE_IN_LINES if lines else UNSAFE).sub(_escape, text)
