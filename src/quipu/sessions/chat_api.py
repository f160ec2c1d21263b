"""A conversation on a server spoken to through the OpenAI chat API (vLLM, Ollama, LM Studio,
llama-cpp-python's server, ...): the `ModelSession` whose context is the message list.

The server renders and tokenizes the messages itself and keeps its own prompt cache, so each
reply sends the whole conversation, and nothing here holds tokens: a turn's prompt is read again
by the server as far as its cache does not hold it. Only the sampling parameters that were
given are sent (`request`); the rest are the server's own. What the chat API cannot be asked
(grammars, logit biases, a reply continued, ...) is declared in `CHAT_API` and refused there.
"""

from __future__ import annotations

import base64
import json
from typing import TYPE_CHECKING, Any, Sequence

from quipu.engine.base import MEDIA_MARK, media_mark
from quipu.options import REQUEST
from quipu.sessions.base import CHAT_API, SILENT, Generation, Message, ReplySink, Stats, TurnPrompt
from quipu.sessions.params import SamplingParams
from quipu.sessions.toolspec import ToolCall

if TYPE_CHECKING:
    from quipu.engine.chat_api import ChatApiModel


class ChatApiSession:
    """Messages to a chat API, one request a reply; the figures are the server's."""

    capabilities = CHAT_API

    def __init__(self, client: ChatApiModel, request: dict[str, Any] | None = None):
        self.client = client
        self.request = {k: v for k, v in (request or {}).items() if k in REQUEST and v is not None}
        self.params = SamplingParams().replace(**self.request)
        self.stats = Stats()
        self.draws = 0
        self.model = ""  # the name the server answered to
        self._used = 0
        self._media: list[dict[str, Any]] = []  # the content parts of the media its messages hold

    def media_mark(self, data: bytes, mime: str) -> str:
        """A medium's marker in a message's text; the message goes with it as an OpenAI content
        part there (an image as a data URL, a recording as `input_audio`)."""
        encoded = base64.b64encode(data).decode("ascii")
        if mime.startswith("image/"):
            part = {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{encoded}"}}
        else:
            part = {"type": "input_audio", "input_audio": {"data": encoded, "format": mime.split("/")[1]}}
        if part not in self._media:
            self._media.append(part)
        return media_mark(self._media.index(part))

    @property
    def n_ctx(self) -> int:
        return 0  # the server's own

    @property
    def used(self) -> int:
        return self._used

    def set_params(self, params: SamplingParams) -> None:
        """New parameters: those that differ from the current ones are sent from now on."""
        for key in REQUEST:
            if getattr(params, key) != getattr(self.params, key):
                self.request[key] = getattr(params, key)
        self.params = params

    def check_text_fits(self, text: str) -> None:
        pass  # the server counts its own tokens, and says when a prompt does not fit

    def reply(self, prompt: TurnPrompt, max_tokens: int, stop: Sequence[str] = (),
              sink: ReplySink = SILENT) -> Generation:
        from quipu.engine.http import ServerError

        self.stats = Stats()
        wire = [self._wire(m) for m in prompt.messages]
        error = None
        # (tools offered: the server renders them and reads the calls itself)
        offer = prompt.offer
        tools = [t.to_openai() for t in offer.tools] if offer is not None and offer.tools else None
        try:
            sent = {REQUEST[k]: v for k, v in self.request.items()}  # (under the request's names)
            reply = self.client.chat(wire, params=sent, max_tokens=max_tokens, stop=tuple(stop),
                                     sink=sink, tools=tools,
                                     tool_choice=_choice(offer.choice) if tools and offer is not None else None)
            finish = reply.finish_reason
        except ServerError as exc:
            if exc.partial is None or not exc.partial.text:
                raise  # nothing came: the turn did not happen
            reply, finish, error = exc.partial, "interrupted", exc
        self.model = reply.model or self.model
        self.stats = Stats(prompt_tokens=reply.prompt_tokens, cached_tokens=reply.cached_tokens,
                           completion_tokens=reply.completion_tokens, ttft_s=reply.first_token_s,
                           prefill_tokens=max(0, reply.prompt_tokens - reply.cached_tokens),
                           prefill_s=reply.timings.get("prefill_s", 0.0),
                           decode_s=reply.timings.get("decode_s", 0.0))
        self._used = reply.prompt_tokens + reply.completion_tokens
        text = reply.text
        calls: list[ToolCall] = []
        for call in reply.tool_calls:
            try:
                arguments = json.loads(call["arguments"] or "{}")
            except ValueError:
                arguments = None
            if not call["name"] or not isinstance(arguments, dict):
                calls = []  # a call that does not parse: the reply stays text
                text += "".join(f"\n{c['name']}({c['arguments']})" for c in reply.tool_calls)
                break
            calls.append(ToolCall(call["name"], arguments, call["id"] or None))
        return Generation(text, [], "stop" if finish == "tool_calls" else finish, error, tool_calls=calls)

    def rewind(self, n_keep: int) -> None:
        pass  # nothing held: the next request sends the messages as they are

    def close(self) -> None:
        pass  # the connection is the server's host's to close

    def _wire(self, message: Message) -> dict[str, Any]:
        """A message as the chat API takes it: a call's arguments as JSON text, its media as
        content parts where they are in its text."""
        data: dict[str, Any] = {"role": message.role, "content": self._content(message.content)}
        if message.tool_calls:
            data["tool_calls"] = [{"id": c.get("id"), "type": "function",
                                   "function": {"name": c["function"]["name"],
                                                "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False)}}
                                  for c in message.tool_calls]
        if message.tool_call_id is not None:
            data["tool_call_id"] = message.tool_call_id
        if message.role == "tool" and message.name:
            data["name"] = message.name
        return data

    def _content(self, text: str) -> str | list[dict[str, Any]]:
        if not self._media or not MEDIA_MARK.search(text):
            return text
        parts: list[dict[str, Any]] = []
        at = 0
        for found in MEDIA_MARK.finditer(text):
            k = int(found.group(1))
            if k >= len(self._media):
                continue  # (text that looks like a marker)
            if text[at:found.start()].strip():
                parts.append({"type": "text", "text": text[at:found.start()]})
            parts.append(self._media[k])
            at = found.end()
        if text[at:].strip():
            parts.append({"type": "text", "text": text[at:].lstrip("\n")})
        return parts



def _choice(choice: str) -> Any:
    if choice in ("auto", "required", "none"):
        return choice
    return {"type": "function", "function": {"name": choice}}
