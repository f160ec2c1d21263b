"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), as Anthropic
documents it, on the chat API's plan: a request's `system`, `messages` (text, image, `tool_use`,
`tool_result` and `thinking` blocks) and `tools` read into the OpenAI shape the one turn path
takes, its sampling read by the registry under Anthropic's names; the reply's `content` blocks,
`stop_reason` and `usage` (`cache_read_input_tokens`: what the server restored rather than read),
whole or as Anthropic's events; its errors in Anthropic's shape."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any, AsyncIterator, Mapping

from quipu.app.turn_options import TurnOptions
from quipu.options import OPTIONS
from quipu.serve.plan import (RequestError, ChatRequest, _asked, chat_messages, let_be, logit_bias, plan_of,
                              request_tools, response_schema)

if TYPE_CHECKING:
    from quipu.app.answer import Answer
    from quipu.serve.stream import Event, Reply

# Anthropic's names of the registry's options a request may give (`Option.anthropic`).
NAMES = {name: o.anthropic for name, o in OPTIONS.items() if o.anthropic is not None}
# What a request may hold that the server does not do: refused, never dropped silently.
NOT_TAKEN = {"mcp_servers": "MCP servers of the request's (give quipu serve --mcp)",
             "container": "containers"}
# `context_management`'s edits: what each does here.
THINKING_EDIT = "clear_thinking_20251015"
KEEP_ALL = "all"
BILLING = "x-anthropic-billing-header:"  # what Claude Code's attribution line begins with
# The fields a request's reading reads (the rest, `metadata` and the like, tune a hosted service: let
# be, and said in the log).
READ = frozenset(("model", "messages", "system", "tools", "tool_choice", "thinking", "output_config", "stream",
                  "context_management", "logit_bias", *NAMES.values(), *NOT_TAKEN))
# Anthropic's efforts as a template's reasoning_effort.
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
STOP = {"tool_calls": "tool_use", "length": "max_tokens", "context_full": "max_tokens",
        "stop_sequence": "stop_sequence"}
ERRORS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 408: "timeout_error", 409: "invalid_request_error", 413: "request_too_large",
          429: "rate_limit_error", 503: "overloaded_error"}


def messages_request(body: Mapping[str, Any], base: TurnOptions, counting: bool = False) -> ChatRequest:
    """What a Messages request asks (`counting`: a count_tokens request, which takes no
    `max_tokens`)."""
    for field, what in NOT_TAKEN.items():
        if body.get(field) not in (None, [], {}):
            raise RequestError(f"{field}: quipu serve does not take {what}")
    if not counting and body.get("max_tokens") is None:
        raise RequestError("max_tokens: a Messages request gives the most tokens its reply may have")
    output = body.get("output_config") or {}
    if not isinstance(output, dict):
        raise RequestError("output_config must be an object ({\"format\", \"effort\"})")
    form = output.get("format")
    if form is not None and (not isinstance(form, dict) or form.get("type") != "json_schema"):
        raise RequestError('output_config.format must be {"type": "json_schema", "schema": ...}')
    schema = response_schema({"type": "json_schema", "json_schema": form}) if form is not None else None
    opts = plan_of(body, {k: v for k, v in NAMES.items() if not (counting and k == "max_tokens")}, base, schema)
    opts = _thinking(body.get("thinking"), opts)
    effort = output.get("effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise RequestError(f"output_config.effort must be {', '.join(EFFORTS)}")
        opts = dataclasses.replace(opts, effort_if_taken=EFFORTS[effort])  # (where the template takes one)
    messages = openai_messages(body.get("system"), body.get("messages"))
    kept = thinking_kept(body.get("context_management"))
    skipped: list[str] = []
    chat = {"messages": clear_thinking(messages, kept) if isinstance(kept, int) else messages,
            "tools": openai_tools(body.get("tools"), skipped), "tool_choice": openai_choice(body.get("tool_choice"))}
    tools, opts = request_tools(chat, opts)
    biases = logit_bias(body.get("logit_bias"))  # (llama-server's, beside Anthropic's fields)
    if biases:
        opts = dataclasses.replace(opts, logit_bias=biases)
    return dataclasses.replace(_asked(opts, *chat_messages(chat), tools), ignored=let_be(body, READ, skipped))


def thinking_kept(given: Any) -> int | str:
    """How many of the last assistant turns keep their thinking, as `context_management`'s
    `clear_thinking` edit says (`keep`: "all", or {"type": "thinking_turns", "value": N}; 1
    where the edit gives no `keep`, as Anthropic's); "all" where there is no such edit. An edit
    of another kind (tool results cleared) is refused: quipu drops nothing else of a conversation."""
    if given is None:
        return KEEP_ALL
    edits = given.get("edits") if isinstance(given, dict) else None
    if not isinstance(edits, list):
        raise RequestError('context_management must be {"edits": [...]}')
    kept: int | str = KEEP_ALL
    for i, edit in enumerate(edits):
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind != THINKING_EDIT:
            raise RequestError(f"context_management.edits[{i}]: quipu serve takes {THINKING_EDIT} (earlier turns' "
                               f"thinking dropped or kept), not {str(kind)[:40]}")
        keep = edit.get("keep", {"type": "thinking_turns", "value": 1})
        if keep == KEEP_ALL:
            continue
        value = keep.get("value") if isinstance(keep, dict) and keep.get("type") == "thinking_turns" else None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise RequestError(f'context_management.edits[{i}].keep must be "all" or {{"type": "thinking_turns", '
                               '"value": N}')
        kept = value
    return kept


def clear_thinking(messages: list[dict[str, Any]], keep: int) -> list[dict[str, Any]]:
    """`messages` with the thinking of every assistant turn but the last `keep` dropped (a turn:
    the assistant's messages between two messages of the user's, its calls and their results
    among them)."""
    out: list[dict[str, Any]] = []
    turns, in_turn = 0, False
    for m in reversed(messages):
        if m["role"] == "assistant":
            turns, in_turn = turns + (not in_turn), True
            if turns > keep and "reasoning_content" in m:
                m = {k: v for k, v in m.items() if k != "reasoning_content"}
        elif m["role"] == "user":
            in_turn = False
        out.append(m)
    return out[::-1]


def _thinking(given: Any, opts: TurnOptions) -> TurnOptions:
    """`thinking`: {"type": "enabled", "budget_tokens": N} (reasoning, at most N tokens of it),
    {"type": "adaptive"} (reasoning as the model likes) or {"type": "disabled"}."""
    if given is None:
        return opts
    kind = given.get("type") if isinstance(given, dict) else None
    if kind == "disabled":
        return dataclasses.replace(opts, think=False)
    if kind in ("adaptive", "between_tools"):
        return dataclasses.replace(opts, think=True)
    if kind == "enabled":
        budget = given.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise RequestError("thinking.budget_tokens must be a whole number of tokens, at least 1")
        return dataclasses.replace(opts, think=True, reasoning_budget=budget)
    raise RequestError('thinking must be {"type": "enabled", "budget_tokens": N}, {"type": "adaptive"}, '
                       '{"type": "between_tools"} or {"type": "disabled"}')


def _text_of(value: Any, where: str) -> str:
    """A text given as a text, or as text blocks (their texts joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, block in enumerate(value):
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise RequestError(f"{where}[{j}] must be a text block ({{\"type\": \"text\", \"text\": ...}})")
            texts.append(block["text"])
        return "\n\n".join(texts)
    raise RequestError(f"{where} must be a text or a list of text blocks")


def _unbilled(system: Any) -> Any:
    """A system prompt without Claude Code's attribution line (`x-anthropic-billing-header: ...`,
    its first block), which tells a hosted service who sent the request and changes between the
    client's versions: in the prompt, it would make every version's prompt a new one to read."""
    if isinstance(system, list):
        return [b for b in system if not (isinstance(b, dict) and isinstance(b.get("text"), str)
                                          and b["text"].startswith(BILLING))]
    return system


def openai_messages(system: Any, messages: Any) -> list[dict[str, Any]]:
    """A Messages request's system prompt and messages in the OpenAI shape: a user's
    `tool_result` blocks each a tool message (before the rest of what it says), an assistant's
    `tool_use` blocks its calls, `thinking` blocks its reasoning, an image a data URL."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: a Messages request needs its messages (a list, not empty)")
    out: list[dict[str, Any]] = []
    if system is not None:
        text = _text_of(_unbilled(system), "system")
        if text:
            out.append({"role": "system", "content": text})
    names: dict[str, str] = {}  # each call's tool, by its id
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise RequestError(f"{where} must be a message whose role is user, assistant or system")
        content = m.get("content")
        if m["role"] == "system":
            out.append({"role": "system", "content": _text_of(content, f"{where}.content")})
            continue
        if content in ("", []) and not (m["role"] == "assistant" and i == len(messages) - 1):
            raise RequestError(f"{where}.content is empty: every message but a last assistant's says something")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise RequestError(f"{where}.content must be a text or a list of content blocks")
        if m["role"] == "assistant":
            out.append(_assistant(content, where, names))
        else:
            out.extend(_user(content, where, names))
    return out


def _assistant(blocks: list[Any], where: str, names: dict[str, str]) -> dict[str, Any]:
    texts, reasoning, calls = [], [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # (another server's sealed reasoning: nothing in it this model can read)
        elif kind == "tool_use":
            ident, name, given = block.get("id"), block.get("name"), block.get("input")
            if not isinstance(ident, str) or not isinstance(name, str) or not isinstance(given, dict):
                raise RequestError(f"{at}: a tool_use block has its id, name and input (an object)")
            names[ident] = name
            calls.append({"id": ident, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(given, ensure_ascii=False)}})
        else:
            raise RequestError(f"{at}: an assistant's block is text, thinking or tool_use, not {str(kind)[:40]}")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list[Any], where: str, names: dict[str, str]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append(_image(block.get("source"), at))
        elif kind == "tool_result":
            ident = block.get("tool_use_id")
            if not isinstance(ident, str):
                raise RequestError(f"{at}: a tool_result block names its call (tool_use_id)")
            given = block.get("content")
            text = "" if given is None else _text_of(given, f"{at}.content")
            if block.get("is_error") is True:
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": ident, "content": text,
                            **({"name": names[ident]} if ident in names else {})})
        else:
            raise RequestError(f"{at}: a user's block is text, image or tool_result, not {str(kind)[:40]}")
    return results + ([{"role": "user", "content": parts}] if parts else [])


def _image(source: Any, where: str) -> dict[str, Any]:
    """An image block's source as an image part (a data URL): the server fetches no link."""
    if not isinstance(source, dict) or source.get("type") != "base64":
        raise RequestError(f"{where}: quipu serve takes an image as base64 data ({{\"type\": \"base64\", "
                           "\"media_type\", \"data\"}), not a link for it to fetch")
    media, data = source.get("media_type"), source.get("data")
    if not isinstance(media, str) or not isinstance(data, str):
        raise RequestError(f"{where}: an image's source has its media_type and data")
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}


def openai_tools(tools: Any, skipped: list[str] | None = None) -> list[dict[str, Any]] | None:
    """A request's tools (a name, a description, an input_schema) in the OpenAI shape; a tool of
    Anthropic's own kinds (web search, a computer, its bash and editor: `{"type":
    "web_search_20250305", ...}`), whose schema is Anthropic's to know, is left out of the model's
    tools, its type added to `skipped`."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of tools ({\"name\", \"description\", \"input_schema\"})")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "custom" and "input_schema" not in tool:
            if skipped is not None:
                skipped.append(kind[:40])
            continue
        if not isinstance(tool, dict) or kind not in (None, "custom") or "input_schema" not in tool:
            raise RequestError(f"tools[{i}]: a tool has its name, description and input_schema, and the client "
                               "runs it")
        out.append({"type": "function", "function": {"name": tool.get("name"), "parameters": tool["input_schema"],
                                                     **({"description": tool["description"]}
                                                        if tool.get("description") is not None else {})}})
    return out


def openai_choice(choice: Any) -> Any:
    """`tool_choice` ({"type": "auto" | "any" | "tool" | "none"}) as the chat API's."""
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    raise RequestError('tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": NAME} or '
                       '{"type": "none"}')


# ---- the reply ----------------------------------------------------------------------------

def _usage(answer: Answer) -> dict[str, Any]:
    """The prompt's tokens as Anthropic counts them: those restored (`cache_read_input_tokens`),
    those read and written to the prompt cache (`cache_creation_input_tokens`), the rest."""
    s = answer.stats
    made = min(answer.cache_written, s.prompt_tokens - s.cached_tokens)
    return {"input_tokens": s.prompt_tokens - s.cached_tokens - made, "cache_creation_input_tokens": made,
            "cache_read_input_tokens": s.cached_tokens, "output_tokens": s.completion_tokens}


def _stop(answer: Answer) -> tuple[str, str | None]:
    return STOP.get(answer.finish_reason, "end_turn"), answer.stop_sequence


def _calls(answer: Answer) -> list[dict[str, Any]]:
    from quipu.serve.wire import waiting_calls

    return [{"type": "tool_use", "id": call.id or f"toolu_{i}", "name": call.name, "input": call.arguments}
            for i, call in enumerate(waiting_calls(answer))]


def message(answer: Answer, ident: str) -> dict[str, Any]:
    """The reply whole: its thinking, text and tool_use blocks, why it ended, its usage."""
    blocks: list[dict[str, Any]] = []
    if answer.reasoning:
        blocks.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
    calls = _calls(answer)
    if answer.text or not calls:
        blocks.append({"type": "text", "text": answer.text})
    reason, sequence = _stop(answer)
    return {"id": ident, "type": "message", "role": "assistant", "model": answer.model, "content": blocks + calls,
            "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(answer)}


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """A failure in Anthropic's shape."""
    from quipu.serve.wire import error_body as openai_error

    status, shaped = openai_error(exc)
    kind = ERRORS.get(status, "api_error")
    return status, {"type": "error", "error": {"type": kind, "message": shaped["error"]["message"]}}


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


async def message_stream(reply: Reply, first: Event | None, plan: ChatRequest, head: dict[str, Any]) -> AsyncIterator[str]:
    """The reply as Anthropic's events: message_start (with the prompt's tokens, as its reading
    begins), a ping (and one every `PING_S` while the prompt is read), each block's start, deltas
    and stop (thinking, text, then each tool_use with its input whole), message_delta (why it
    ended, its usage) and message_stop."""
    from quipu.serve.stream import ALIVE, PING_S

    def started(tokens: int, cached: int) -> str:
        usage = {"input_tokens": tokens - cached, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
                 "output_tokens": 0}
        return _event("message_start", {"message": {
            "id": head["ident"], "type": "message", "role": "assistant", "model": plan.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage}})

    index, open_kind, begun = -1, None, False
    event = first
    try:
        while True:
            if event is None:  # (nothing yet: a ping while its prompt is read; before it, while its turn waits)
                yield _event("ping", {}) if begun else ALIVE
                event = await reply.within(PING_S)
                continue
            kind, _, value = event
            if not begun and kind != "error":  # (its prompt's tokens: as its reading begins, else as its answer says)
                tokens, cached = value if kind == "prompt" else \
                    (value.stats.prompt_tokens, value.stats.cached_tokens) if kind == "done" else (0, 0)
                yield started(tokens, cached)
                yield _event("ping", {})
                begun = True
            if kind in ("content", "reasoning_content"):
                block = "text" if kind == "content" else "thinking"
                if open_kind != block:
                    if open_kind is not None:
                        yield _event("content_block_stop", {"index": index})
                    index, open_kind = index + 1, block
                    yield _event("content_block_start", {"index": index, "content_block": {
                        "type": "text", "text": ""} if block == "text" else {
                        "type": "thinking", "thinking": "", "signature": ""}})
                delta = {"type": "text_delta", "text": value} if block == "text" else \
                    {"type": "thinking_delta", "thinking": value}
                yield _event("content_block_delta", {"index": index, "delta": delta})
            elif kind == "done":
                answer: Answer = value
                calls = _calls(answer)
                if open_kind is None and not calls:  # (a reply of no text is one empty text block, as whole)
                    index, open_kind = 0, "text"
                    yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                if open_kind is not None:
                    yield _event("content_block_stop", {"index": index})
                for call in calls:
                    index += 1
                    yield _event("content_block_start", {"index": index, "content_block": {**call, "input": {}}})
                    yield _event("content_block_delta", {"index": index, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(call["input"], ensure_ascii=False)}})
                    yield _event("content_block_stop", {"index": index})
                reason, sequence = _stop(answer)
                yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                               "usage": _usage(answer)})
                yield _event("message_stop", {})
                reply.sent()  # (resumed once the last event is out)
                break
            elif kind == "error":
                yield _event("error", {"error": error_body(value)[1]["error"]})
                break
            event = await reply.within(PING_S)
    finally:
        reply.close()
