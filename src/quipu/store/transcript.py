"""The transcript file, `NAME.json`: the truth of a session, and the one home of its format.

A transcript is UTF-8 JSON: the messages, the sampling parameters, the context settings, the
model (name, path, fingerprint), the exact context token history (`tokens`, of which the first
`n_decoded` were in the KV cache when it was saved) and the number of random draws made. It
is read and checked here and nowhere else; the session layer turns its plain values into live
objects.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from quipu.store.files import lone_surrogate

DIGEST = re.compile(r"[0-9a-f]{64}")
FORMAT = "quipu-session"
VERSION = 1
ROLES = ("system", "user", "assistant", "tool")


class TranscriptError(ValueError):
    """What is wrong with a transcript, in words for a user."""


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class Transcript:
    model: dict[str, Any]  # name, path, fingerprint
    params: dict[str, Any]
    context: dict[str, Any]  # n_ctx, n_batch, kv_type
    messages: list[dict[str, Any]]
    tokens: list[int]
    n_decoded: int
    draws: int
    created: str = field(default_factory=now_iso)
    updated: str = field(default_factory=now_iso)
    quipu: str = ""
    build: str = ""
    chat_template: str | None = None  # a template given by the user, in place of the model's
    template_variables: dict[str, Any] = field(default_factory=dict)
    # A context kept on llama-server: the model it was made on (`identity`), the text the tokens
    # spell, and the places a turn may go on from (`marks`, [tokens, characters] pairs).
    served: dict[str, Any] | None = None
    # What a reply may be, when the session was given it: `max_tokens`, `stop` (a list of texts).
    limits: dict[str, Any] = field(default_factory=dict)
    # The tools the model was told of (OpenAI's shape): definitions only, never what runs them.
    tools: list[dict[str, Any]] = field(default_factory=list)
    # The media its messages hold (images, recordings), in the order its context took them: each
    # {"sha256", "kind", "format", "name"}; the bytes are kept once for every session (`media.py`).
    media: list[dict[str, Any]] = field(default_factory=list)
    # The other branches of the conversation, each as what it adds to this one's beginning, and
    # which branch this is (`branches.py`); None for a conversation that never branched.
    tree: dict[str, Any] | None = None

    @property
    def turns(self) -> int:
        return sum(1 for m in self.messages if m["role"] == "assistant")

    def encode(self) -> bytes:
        record = {"format": FORMAT, "version": VERSION, **asdict(self)}
        if record["tree"] is None:  # (a conversation that never branched is written as it always was)
            del record["tree"]
        return json.dumps(record, ensure_ascii=False, indent=1).encode("utf-8")

    @classmethod
    def decode(cls, raw: bytes) -> "Transcript":
        """Parses and checks; raises TranscriptError saying what is wrong."""
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise TranscriptError("the transcript is not valid JSON") from None
        if lone_surrogate(record):  # (JSON allows "\ud800"; no text, and no tokenizer, does)
            raise TranscriptError("the transcript holds a lone half of a UTF-16 pair (\\ud800-\\udfff), which is "
                                  "no text")
        problem = check(record)
        if problem:
            raise TranscriptError(problem)
        return cls(
            model=record["model"], params=record["params"], context=record["context"],
            messages=record["messages"], tokens=record["tokens"], n_decoded=record["n_decoded"],
            draws=record["draws"], created=str(record.get("created", "")), updated=str(record.get("updated", "")),
            quipu=str(record.get("quipu", "")), build=str(record.get("build", "")),
            chat_template=record.get("chat_template"), template_variables=record.get("template_variables") or {},
            served=record.get("served"), limits=record.get("limits") or {}, tools=record.get("tools") or [],
            media=record.get("media") or [], tree=record.get("tree"),
        )


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _check_message(m: Any) -> str | None:
    if not isinstance(m, dict):
        return "a message is not an object"
    if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
        return "a message has no known role or no text"
    tokens = m.get("tokens")
    if tokens is not None and not (isinstance(tokens, list) and all(_is_count(t) for t in tokens)):
        return "a message's tokens are not a list of token ids"
    for key in ("context_before", "draws_before", "decoded_before", "logged"):
        if m.get(key) is not None and not _is_count(m[key]):
            return f"a message's {key} is not a count"
    calls = m.get("tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
            and isinstance(c["function"].get("arguments"), dict) for c in calls)):
        return "a message's tool calls are not calls"
    for key in ("tool_call_id", "name", "reasoning", "spelled"):
        if m.get(key) is not None and not isinstance(m[key], str):
            return f"a message's {key} is not a text"
    return None


def check(record: Any) -> str | None:
    """What is wrong with a parsed transcript, or None."""
    if not isinstance(record, dict):
        return "the transcript is not a JSON object"
    if record.get("format") != FORMAT:
        return "the transcript is not a quipu session"
    if record.get("version") != VERSION:
        return f"transcript version {record.get('version')!r} is not one this quipu reads"
    if not isinstance(record.get("model"), dict):
        return "the transcript has no model"
    messages = record.get("messages")
    if not isinstance(messages, list):
        return "the transcript's messages are not a list"
    tokens = record.get("tokens")
    if not isinstance(tokens, list) or not all(_is_count(t) for t in tokens):
        return "the transcript's tokens are not a list of token ids"
    problem = _check_tree(record.get("tree"), messages, tokens)
    if problem:
        return problem
    for m in [*messages, *(m for b in (record.get("tree") or {}).get("branches", ()) for m in b["messages"])]:
        problem = _check_message(m)
        if problem:
            return problem
    for key in ("n_decoded", "draws"):
        if not _is_count(record.get(key)):
            return f"the transcript's {key} is not a count"
    if record["n_decoded"] > len(tokens):
        return "the transcript's n_decoded is past its tokens"
    if not isinstance(record.get("chat_template"), (str, type(None))):
        return "the transcript's chat template is not text"
    if not isinstance(record.get("template_variables", {}), dict):
        return "the transcript's template variables are not an object"
    limits = record.get("limits") or {}
    if not isinstance(limits, dict) or not (
            limits.get("max_tokens") is None or (_is_count(limits["max_tokens"]) and limits["max_tokens"] > 0)) or not (
            limits.get("stop") is None or (isinstance(limits["stop"], list)
                                           and all(isinstance(t, str) for t in limits["stop"]))) or not (
            limits.get("reasoning_budget") is None or _is_count(limits["reasoning_budget"])):
        return "the transcript's reply limits are damaged"
    tools = record.get("tools") or []
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            and isinstance(t["function"].get("parameters", {}), dict) for t in tools):
        return "the transcript's tools are damaged"
    if not _media_ok(record.get("media") or []):
        return "the transcript's media are damaged"
    problem = _check_served(record.get("served"), tokens)
    if problem:
        return problem
    context = record.get("context")
    if not isinstance(record.get("params"), dict) or not isinstance(context, dict):
        return "the transcript has no settings"
    if not (_is_count(context.get("n_ctx")) and _is_count(context.get("n_batch"))
            and isinstance(context.get("kv_type"), str)):
        return "the transcript's context settings are incomplete"
    return None


def _check_tree(tree: Any, messages: list[Any], tokens: list[Any]) -> str | None:
    """What is wrong with a transcript's branches (`branches.py`), or None; their messages are
    checked as the current branch's are."""
    if tree is None:
        return None
    if not isinstance(tree, dict) or not isinstance(tree.get("current"), dict) or \
            not isinstance(tree.get("branches"), list) or not _is_count(tree.get("next")):
        return "the transcript's branches are damaged"
    head = tree["current"]
    if not (_is_count(head.get("id")) and _id_or_none(head.get("parent")) and isinstance(head.get("made"), str)):
        return "the transcript's current branch is damaged"
    seen = {head["id"]}
    for b in tree["branches"]:
        if not (isinstance(b, dict) and _is_count(b.get("id")) and b["id"] not in seen
                and _id_or_none(b.get("parent")) and isinstance(b.get("made"), str)
                and isinstance(b.get("updated"), str) and _is_count(b.get("shared")) and b["shared"] <= len(messages)
                and isinstance(b.get("messages"), list) and _is_count(b.get("tokens_shared"))
                and b["tokens_shared"] <= len(tokens) and isinstance(b.get("tokens"), list)
                and all(_is_count(t) for t in b["tokens"]) and _is_count(b.get("n_decoded"))
                and b["n_decoded"] <= b["tokens_shared"] + len(b["tokens"]) and _is_count(b.get("draws"))
                and _media_ok(b.get("media", []))):
            return "a branch of the transcript is damaged"
        seen.add(b["id"])
    if tree["next"] <= max(seen):  # (the next branch made would take an id one has)
        return "the transcript's branches are damaged: its next branch's id is one a branch has"
    return None


def _media_ok(media: Any) -> bool:
    return isinstance(media, list) and all(
        isinstance(m, dict) and isinstance(m.get("sha256"), str) and DIGEST.fullmatch(m["sha256"]) is not None
        and m.get("kind") in ("image", "audio") and isinstance(m.get("format"), str)
        and isinstance(m.get("name"), str) for m in media)


def _id_or_none(value: Any) -> bool:
    return value is None or _is_count(value)


def _check_served(served: Any, tokens: list[Any]) -> str | None:
    if served is None:
        return None
    marks = served.get("marks") if isinstance(served, dict) else None
    if not (isinstance(served, dict) and isinstance(served.get("identity"), str) and isinstance(served.get("text"), str)
            and isinstance(marks, list) and all(isinstance(m, list) and len(m) == 2 and all(_is_count(x) for x in m)
                                                 for m in marks)):
        return "the transcript's server context is damaged"
    if any(k > len(tokens) or n > len(served["text"]) for k, n in marks):
        return "the transcript's server context marks are past its tokens"
    return None
