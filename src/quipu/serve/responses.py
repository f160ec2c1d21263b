"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`): a
request's `input` (a text, or items: messages, `function_call`, `function_call_output`),
`instructions`, `tools`, `tool_choice`, `text.format`, `reasoning.effort` and
`max_output_tokens` read into the OpenAI chat shape the one turn path takes; the reply's `output`
items, whole or as the API's events. A response kept (`store`, as by default) is a turn of a
session of quipu's, named by its conversation's first response; `previous_response_id` goes on
in that session from the kept context (after a restart too), on the branch the response ended."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Mapping, Sequence

from quipu.app.turn_options import TurnOptions
from quipu.options import OPTIONS
from quipu.serve.plan import (RequestError, ChatRequest, _asked, chat_messages, let_be, plan_of, request_tools,
                              response_schema)

if TYPE_CHECKING:
    from quipu.app.answer import Answer
    from quipu.app.responses import KeptResponse
    from quipu.serve.stream import Event, Reply
    from quipu.sessions.base import Message

# The Responses API's names of the registry's options a request may give (`Option.responses`).
NAMES = {name: o.responses for name, o in OPTIONS.items() if o.responses is not None}
# What a request may hold that the server does not do: refused, never dropped silently.
NOT_TAKEN = {"background": "background responses", "conversation": "conversations by id (previous_response_id "
             "goes on from a response)", "prompt": "prompt templates", "top_logprobs": "log probabilities "
             "(/v1/chat/completions gives them)"}
# The fields a request's reading reads (the rest tune a hosted service: let be, and said in the log).
READ = frozenset(("model", "input", "instructions", "tools", "tool_choice", "text", "reasoning", "include", "store",
                  "stream", "previous_response_id", "truncation", *NAMES.values(), *NOT_TAKEN))
# The tools OpenAI's service runs itself, which no model here can call: left out of the model's
# tools (and named in the server's log), as a request with a search the client has switched off.
HOSTED = frozenset(("web_search", "web_search_preview", "file_search", "computer_use_preview", "computer_use",
                    "code_interpreter", "image_generation", "local_shell", "mcp", "shell", "apply_patch"))
HOSTED_FAMILIES = ("web_search_", "computer_use_", "file_search_", "image_generation_")
# `include`s the server gives without being asked (reasoning as text), or has nothing for.
INCLUDED = {"reasoning.encrypted_content", "message.output_text.logprobs"}


def responses_request(body: Mapping[str, Any], base: TurnOptions, previous: KeptResponse | None = None
                      ) -> ChatRequest:
    """What a Responses request asks, going on from `previous` (its `previous_response_id`, found)."""
    for field, what in NOT_TAKEN.items():
        if body.get(field) not in (None, False, [], {}, 0):
            raise RequestError(f"{field}: quipu serve does not take {what}")
    include = body.get("include") or []
    if not isinstance(include, list) or any(not isinstance(i, str) or i not in INCLUDED for i in include):
        raise RequestError(f"include: quipu serve gives {', '.join(sorted(INCLUDED))} and nothing else")
    if body.get("truncation") not in (None, "disabled"):
        raise RequestError("truncation: quipu serve drops nothing of a conversation (disabled)")
    if not isinstance(body.get("store", True), bool):
        raise RequestError("store must be true or false")
    opts = plan_of(body, NAMES, base, _format(body.get("text")))
    reasoning = body.get("reasoning")
    if reasoning is not None:
        effort = reasoning.get("effort") if isinstance(reasoning, dict) else False
        if effort not in (None, "none", "minimal", "low", "medium", "high"):
            raise RequestError("reasoning.effort must be none, minimal, low, medium or high")
        if effort is not None:  # (the template's effort where it takes one; reasoning on, or off for none)
            opts = dataclasses.replace(opts, think=effort != "none",
                                       effort_if_taken=effort if effort not in ("none", "minimal") else "low")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("instructions must be a text")
    # (a call's output names its tool, as the response before called it)
    names = _names([*previous.input, *previous.response.get("output", [])] if previous is not None else [])
    items = openai_messages(body.get("input"), names)
    if previous is None and instructions:
        items = [{"role": "system", "content": instructions}] + items
    skipped: list[str] = []
    chat = {"messages": items, "tools": openai_tools(body.get("tools"), skipped),
            "tool_choice": openai_choice(body.get("tool_choice"))}
    tools, opts = request_tools(chat, opts)
    messages, media = chat_messages(chat)
    ignored = let_be(body, READ, skipped)
    if previous is not None:  # (its conversation is the session's)
        return ChatRequest(opts, messages, tools=tools, media=media, ignored=ignored)
    return dataclasses.replace(_asked(opts, messages, media, tools), ignored=ignored)


def _format(text: Any) -> str | None:
    """`text.format`'s JSON Schema (its text): json_schema's, any object for json_object."""
    if text is None:
        return None
    form = text.get("format") if isinstance(text, dict) else False
    if form is None:
        return None
    if not isinstance(form, dict):
        raise RequestError("text.format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                           "{\"type\": \"json_schema\", \"schema\": ...}")
    if form.get("type") == "json_schema":
        return response_schema({"type": "json_schema", "json_schema": {"schema": form.get("schema")}})
    return response_schema(form)


def _names(items: Sequence[Any]) -> dict[str, str]:
    """Each call's tool, by its call_id, among `items`."""
    return {i["call_id"]: i["name"] for i in items if isinstance(i, dict) and i.get("type") == "function_call"
            and isinstance(i.get("call_id"), str) and isinstance(i.get("name"), str)}


def _text(content: Any, where: str) -> Any:
    """A message's content: a text, or its parts as the chat API's (text, images)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a text or a list of parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text") \
                and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise RequestError(f"{where}[{j}]: a part is input_text, output_text or input_image (as a data URL), "
                               f"not {str(kind)[:40]}")
    return parts


def openai_messages(given: Any, names: dict[str, str]) -> list[dict[str, Any]]:
    """A request's `input` in the chat API's shape: a message each message (a developer's a
    system prompt), the calls that follow a reply made its calls, each call's output a tool
    message, a reasoning item the next reply's reasoning."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise RequestError("input must be a text or a list of items, not empty")
    names = {**names, **_names(given)}
    out: list[dict[str, Any]] = []
    reasoning = None
    for i, item in enumerate(given):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(f"{where}.role must be user, assistant, system or developer")
            content = _text(item.get("content"), f"{where}.content")
            if role == "assistant":
                text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
                out.append({"role": "assistant", "content": text,
                            **({"reasoning_content": reasoning} if reasoning else {})})
                reasoning = None
            else:
                out.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(x, str) for x in (call_id, name, arguments)):
                raise RequestError(f"{where}: a function_call has its call_id, name and arguments (a JSON text)")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call],
                            **({"reasoning_content": reasoning} if reasoning else {})})
                reasoning = None
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise RequestError(f"{where}: a function_call_output names its call (call_id)")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text,
                        **({"name": names[call_id]} if call_id in names else {})})
        elif kind == "reasoning":
            parts = (item.get("content") or []) + (item.get("summary") or [])
            reasoning = "".join(p.get("text", "") for p in parts if isinstance(p, dict)) or None
        else:
            raise RequestError(f"{where}: an item is a message, function_call, function_call_output or reasoning, "
                               f"not {str(kind)[:40]} (previous_response_id goes on from a kept response)")
    return out


def openai_tools(tools: Any, skipped: list[str] | None = None) -> list[dict[str, Any]] | None:
    """A request's function tools in the chat API's shape, a namespace's functions among them (as
    Codex groups its agents' tools); a tool the server would run (web search, files, a computer:
    `HOSTED`) is left out, its type added to `skipped`: the client runs every tool the model is
    offered."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of tools ({\"type\": \"function\", \"name\", \"parameters\"})")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "namespace" and isinstance(tool.get("tools"), list):
            out += openai_tools(tool["tools"], skipped) or []
        elif kind == "function":
            out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                         if tool.get(k) is not None}})
        elif isinstance(kind, str) and (kind in HOSTED or kind.startswith(HOSTED_FAMILIES)):
            if skipped is not None:
                skipped.append(kind)
        else:
            raise RequestError(f"tools[{i}]: a tool is a function (its name and parameters, which the client runs), "
                               f"not {str(kind)[:40]}")
    return out


def openai_choice(choice: Any) -> Any:
    """`tool_choice` ("auto", "none", "required", {"type": "function", "name": NAME}) as the chat API's."""
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


# ---- the reply ----------------------------------------------------------------------------

def _ids(ident: str) -> tuple[str, str, str]:
    """The ids of a response's reasoning, message and calls (made of its own)."""
    tail = ident.removeprefix("resp_")
    return f"rs_{tail}", f"msg_{tail}", f"fc_{tail}"


def output(answer: Answer, ident: str) -> list[dict[str, Any]]:
    """The reply's output items: its reasoning, its message, each call it ends with."""
    from quipu.serve.wire import waiting_calls

    reasoning_id, message_id, call_id = _ids(ident)
    items: list[dict[str, Any]] = []
    if answer.reasoning:
        items.append(reasoning_item(reasoning_id, answer.reasoning))
    calls = waiting_calls(answer)
    if answer.text or not calls:
        items.append(message_item(message_id, answer.text))
    items += [call_item(f"{call_id}_{i}", call.id or f"call_{i}", call.name, call.arguments)
              for i, call in enumerate(calls)]
    return items


def reasoning_item(ident: str, text: str | None) -> dict[str, Any]:
    return {"type": "reasoning", "id": ident, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text is not None else []}


def message_item(ident: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": ident, "status": status, "role": "assistant",
            "content": [] if text is None else [{"type": "output_text", "text": text, "annotations": [],
                                                 "logprobs": []}]}


def call_item(ident: str, call_id: str, name: str, arguments: Any, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": ident, "call_id": call_id, "name": name,
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False),
            "status": status}


def response(head: dict[str, Any], model: str, answer: Answer | None) -> dict[str, Any]:
    """The response object: what its request asked (`head["body"]`), and once `answer` is in,
    its output, status and usage."""
    body = head["body"]
    text = body.get("text") if isinstance(body.get("text"), dict) else {"format": {"type": "text"}}
    out: dict[str, Any] = {
        "id": head["ident"], "object": "response", "created_at": head["created"], "model": model,
        "status": "in_progress", "error": None, "incomplete_details": None,
        "instructions": body.get("instructions"), **{field: body.get(field) for field in NAMES.values()},
        "output": [], "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "store": body.get("store", True), "text": text,
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "truncation": "disabled", "metadata": body.get("metadata") or {}, "usage": None}
    if answer is None:
        return out
    s = answer.stats
    cut = answer.finish_reason in ("length", "context_full")
    out.update(status="incomplete" if cut else "completed", output=output(answer, head["ident"]),
               incomplete_details={"reason": "max_output_tokens"} if cut else None,
               completed_at=int(time.time()),
               usage={"input_tokens": s.prompt_tokens, "input_tokens_details": {"cached_tokens": s.cached_tokens},
                      "output_tokens": s.completion_tokens,
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": s.prompt_tokens + s.completion_tokens})
    return out


def kept_by(env: Any, head: dict[str, Any], model: str, input_items: Any, session: str
            ) -> Callable[[Answer, Sequence[Message]], None]:
    """What keeps a response once its turn is kept: the response whole and where its
    conversation is (`app.responses.keep`)."""
    from quipu.app.responses import keep

    def kept(answer: Answer, messages: Sequence[Message]) -> None:
        keep(env, head["ident"], session, messages, response(head, model, answer),
             input_items if isinstance(input_items, list) else [{"role": "user", "content": input_items}])
    return kept


class Events:
    """The Responses API's events of one response, numbered as they go: its output items opened
    as their text (or reasoning) begins, their deltas, each closed as the next begins or the
    reply ends, the calls it ends with, and the response whole."""

    def __init__(self, head: dict[str, Any], model: str):
        self.head, self.model, self.sequence = head, model, 0
        self.reasoning_id, self.message_id, self.call_id = _ids(head["ident"])
        self.at, self.open, self.texts = -1, "", {"content": "", "reasoning_content": ""}

    def event(self, kind: str, **data: Any) -> str:
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.sequence, **data})}\n\n"

    def begun(self) -> list[str]:
        begun = response(self.head, self.model, None)
        return [self.event("response.created", response=begun), self.event("response.in_progress", response=begun)]

    def piece(self, kind: str, value: str) -> list[str]:
        """A piece of the reply's text ("content") or reasoning ("reasoning_content")."""
        out = self.close() + self.opened(kind) if self.open != kind else []
        self.texts[kind] += value
        if kind == "content":
            return out + [self.event("response.output_text.delta", item_id=self.message_id, output_index=self.at,
                                     content_index=0, delta=value, logprobs=[])]
        return out + [self.event("response.reasoning_text.delta", item_id=self.reasoning_id, output_index=self.at,
                                 content_index=0, delta=value)]

    def opened(self, kind: str) -> list[str]:
        self.at, self.open = self.at + 1, kind
        if kind == "content":
            return [self.event("response.output_item.added", output_index=self.at,
                               item=message_item(self.message_id, None, "in_progress")),
                    self.event("response.content_part.added", item_id=self.message_id, output_index=self.at,
                               content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                      "logprobs": []})]
        return [self.event("response.output_item.added", output_index=self.at,
                           item=reasoning_item(self.reasoning_id, None))]

    def close(self) -> list[str]:
        at, text = self.at, self.texts.get(self.open, "")
        if self.open == "content":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            return [self.event("response.output_text.done", item_id=self.message_id, output_index=at,
                               content_index=0, text=text, logprobs=[]),
                    self.event("response.content_part.done", item_id=self.message_id, output_index=at,
                               content_index=0, part=part),
                    self.event("response.output_item.done", output_index=at, item=message_item(self.message_id, text))]
        if self.open == "reasoning_content":
            return [self.event("response.reasoning_text.done", item_id=self.reasoning_id, output_index=at,
                               content_index=0, text=text),
                    self.event("response.output_item.done", output_index=at,
                               item=reasoning_item(self.reasoning_id, text))]
        return []

    def done(self, answer: Answer) -> list[str]:
        """The reply is over: its open item closed (an empty message, where it said nothing and
        called nothing), each call, the response whole."""
        from quipu.serve.wire import waiting_calls

        calls = waiting_calls(answer)
        out = self.opened("content") if not self.open and not calls else []
        out += self.close()
        for i, call in enumerate(calls):
            self.at += 1
            made = call_item(f"{self.call_id}_{i}", call.id or f"call_{i}", call.name, call.arguments)
            out += [self.event("response.output_item.added", output_index=self.at,
                               item={**made, "arguments": "", "status": "in_progress"}),
                    self.event("response.function_call_arguments.delta", item_id=made["id"], output_index=self.at,
                               delta=made["arguments"]),
                    self.event("response.function_call_arguments.done", item_id=made["id"], output_index=self.at,
                               name=call.name, arguments=made["arguments"]),
                    self.event("response.output_item.done", output_index=self.at, item=made)]
        whole = response(self.head, self.model, answer)
        kind = "response.completed" if whole["status"] == "completed" else "response.incomplete"
        return out + [self.event(kind, response=whole)]

    def failed(self, exc: BaseException) -> list[str]:
        from quipu.serve.wire import error_body

        shaped = error_body(exc)[1]["error"]
        return [self.event("error", code=shaped.get("code"), message=shaped["message"], param=shaped.get("param"))]


async def response_stream(reply: Reply, first: Event | None, plan: ChatRequest, head: dict[str, Any]
                          ) -> AsyncIterator[str]:
    """The reply as the Responses API's events (`Events`); kept once the last is out."""
    from quipu.serve.stream import ALIVE, PING_S

    events = Events(head, plan.model)
    for line in events.begun():
        yield line
    event = first
    try:
        while True:
            if event is None:  # (nothing yet: its turn awaited, or its prompt read)
                yield ALIVE
                event = await reply.within(PING_S)
                continue
            kind, _, value = event
            if kind in ("content", "reasoning_content"):
                lines = events.piece(kind, value)
            elif kind == "done":
                lines = events.done(value)
            elif kind == "error":
                lines = events.failed(value)
            else:
                lines = []
            for line in lines:
                yield line
            if kind == "done":
                reply.sent()  # (kept once the last event is out)
            if kind in ("done", "error"):
                break
            event = await reply.within(PING_S)
    finally:
        reply.close()


def input_items(items: Sequence[Any], ident: str, limit: int = 20, order: str = "desc", after: str | None = None
                ) -> dict[str, Any]:
    """A kept response's input, as the API lists it (GET /v1/responses/{id}/input_items): each
    item with an id, a message's text as its part; a page of them, `limit` long, in `order`
    (desc: the last first), after the item `after` names."""
    data = []
    for i, item in enumerate(items):
        item = dict(item) if isinstance(item, dict) else {"role": "user", "content": str(item)}
        if item.get("type", "message") == "message":
            content = item.get("content")
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            item = {"type": "message", **item,
                    "content": [{"type": kind, "text": content}] if isinstance(content, str) else content}
        data.append({"id": item.get("id") or f"in_{ident.removeprefix('resp_')}_{i}", **item})
    if order == "desc":
        data.reverse()
    if after is not None:
        at = next((i for i, item in enumerate(data) if item["id"] == after), None)
        if at is None:
            raise RequestError(f"after: the input of '{ident[:80]}' has no item '{after[:80]}'")
        data = data[at + 1:]
    page = data[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(data) > limit}
