"""What a request to `quipu serve` asks, read and checked before anything is loaded: an
OpenAI-style or Ollama-style chat request made a plan (its fields read by the registry's request
names, `quipu.options`, over the server's own options), its messages and the tools its client
runs; texts to embed; how long the model stays loaded after it. A request the server refuses is
a `RequestError`, with its HTTP status."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence, Union

from quipu.app.attachments import Attachment
from quipu.app.served import Request
from quipu.app.tooldefs import Tool
from quipu.app.turn_options import TurnOptions
from quipu.app.turns import Following
from quipu.errors import UsageError
from quipu.options import MAX_SEED, MAX_STOP_CHARS, OPTIONS, SAMPLING, Option
from quipu.sessions.base import Message

# What a chat request may ask that this server does not do yet: refused, never dropped silently.
NOT_YET = {"functions": "functions (the old name of tools: send tools)", "function_call": "function_call (send "
           "tools and tool_choice)", "audio": "audio replies", "prediction": "predicted outputs"}
MAX_CHOICES = 8  # answers a request may ask for (`n`), each drawn in turn
MAX_TOP_LOGPROBS = 20  # the likeliest tokens a reply's token may be given beside it (OpenAI's bound)
MAX_INPUTS = 2048  # texts an embedding request may hold
MAX_MESSAGES = 4096  # messages a request may hold
MAX_LOGIT_BIASES = 1024  # tokens a request may bias
MAX_TOOLS = 128  # tools a request may offer (OpenAI's bound)
MAX_KEEP = 365 * 86400.0  # the longest keep-alive a request may ask for, in seconds (-1: for good)
# How long a model stays loaded after a request: seconds, "forever" (-1), or the server's (None).
Keep = Union[float, str, None]
FOREVER = "forever"
DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


class RequestError(UsageError):
    """A request the server refuses: its HTTP status, and the kind the API's error names."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


def chat_plan(body: Mapping[str, Any], base: TurnOptions) -> TurnOptions:
    """The plan of an OpenAI-style chat request: its sampling fields, reply length, stop strings
    and response format, by their names there (`Option.request`), over the server's own options
    (`base`)."""
    for field, what in NOT_YET.items():
        if body.get(field) not in (None, False, [], {}):
            raise RequestError(f"{field}: quipu serve does not take {what} yet")
    n = body.get("n", 1)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES):
        raise RequestError(f"n must be a whole number from 1 to {MAX_CHOICES}")
    names = {name: o.request for name, o in OPTIONS.items() if o.request is not None}
    if body.get("max_completion_tokens") is not None:
        names["max_tokens"] = "max_completion_tokens"
    opts = plan_of(body, names, base, response_schema(body.get("response_format")))
    biases = logit_bias(body.get("logit_bias"))
    return dataclasses.replace(opts, logit_bias=biases) if biases else opts


def logit_bias(given: Any, field: str = "logit_bias") -> tuple[str, ...]:
    """A request's logit biases as `--logit-bias` takes them (TOKEN=BIAS): OpenAI's object of
    token ids (as texts) and numbers, or llama-server's list of [token id or text, number or false
    (banned)]."""
    if given in (None, {}, []):
        return ()
    pairs = list(given.items()) if isinstance(given, dict) else given
    if not isinstance(pairs, list) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise RequestError(f"{field} must map token ids to numbers ({{\"15339\": -100}})")
    if len(pairs) > MAX_LOGIT_BIASES:
        raise RequestError(f"{field} holds {len(pairs)} tokens; at most {MAX_LOGIT_BIASES}")
    specs = []
    for token, bias in pairs:
        if isinstance(token, int) and not isinstance(token, bool) and token >= 0:
            token = str(token)
        elif isinstance(token, str) and token and not isinstance(given, dict):
            token = f'"{token}"'  # (llama-server's list: a text is text, digits too; only a number is an id)
        if not isinstance(token, str) or not token:
            raise RequestError(f"{field}: a token is a token id or a text, not {str(token)[:40]!r}")
        if bias is False:
            bias = -math.inf
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias) or bias == math.inf \
                or (math.isfinite(bias) and not -100 <= bias <= 100):
            raise RequestError(f"{field}: token {token[:40]}'s bias must be a number from -100 to 100")
        specs.append(f"{token}={bias}")
    return tuple(specs)


def ollama_plan(body: Mapping[str, Any], base: TurnOptions) -> TurnOptions:
    """The plan of an Ollama-style request: its `options` by their names there (`Option.ollama`;
    others, such as the server's own `num_ctx`, are the server's), and its `format` ("json", or
    a JSON Schema), over the server's own options (`base`)."""
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise RequestError("options must be an object")
    form = body.get("format")
    if form in (None, ""):
        schema = None
    elif form == "json":
        schema = '{"type": "object"}'
    elif isinstance(form, dict):
        schema = json.dumps(form)
    else:
        raise RequestError('format must be "json" or a JSON Schema (an object)')
    names = {name: o.ollama for name, o in OPTIONS.items() if o.ollama is not None}
    opts = plan_of(options, names, base, schema, where="options.")
    think = body.get("think")  # (a switch, or how hard: low, medium, high)
    if think is None:
        return opts
    if not isinstance(think, (bool, str)):
        raise RequestError("think must be true, false, low, medium or high")
    return dataclasses.replace(opts, think=think is not False,
                               reasoning_effort=think if isinstance(think, str) else opts.reasoning_effort)


def plan_of(fields: Mapping[str, Any], names: Mapping[str, str], base: TurnOptions, schema: str | None = None,
            where: str = "") -> TurnOptions:
    """`base` with the options `fields` gives under `names` (option: its name there), each
    checked against its type and bounds, and the answer held to `schema` where there is one."""
    given: dict[str, Any] = {}
    for name, field in names.items():
        if fields.get(field) is not None:
            given[name] = _checked(where + field, OPTIONS[name], fields[field])
    if schema is not None:
        given["schema"] = schema
    sampling = {k: v for k, v in given.items() if k in SAMPLING}
    rest = {k: v for k, v in given.items() if k not in SAMPLING}
    return dataclasses.replace(base, sampling={**base.sampling, **sampling}, **rest)


def response_schema(form: Any) -> str | None:
    """The JSON Schema (its text) a request's `response_format` holds the answer to: `json_schema`'s
    schema, any JSON object for `json_object`; None for text."""
    if form is None:
        return None
    kind = form.get("type") if isinstance(form, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":  # (llama-server's takes a schema beside it, which holds the object to it)
        given = form.get("schema")
        if given is None:
            return '{"type": "object"}'
        if not isinstance(given, dict):
            raise RequestError("response_format.schema must be a JSON Schema (an object)")
        return json.dumps(given)
    if kind == "json_schema":
        given = form.get("json_schema")
        schema = given.get("schema") if isinstance(given, dict) else None
        if not isinstance(schema, dict):
            raise RequestError("response_format.json_schema.schema must be a JSON Schema (an object)")
        return json.dumps(schema)
    raise RequestError("response_format.type must be text, json_object or json_schema")


def _checked(field: str, option: Option, value: Any) -> Any:
    """A request's value of `option` (named `field` there), of its type and within its bounds."""
    if option.multiple:  # (stop: a text, or a list of texts)
        texts = [value] if isinstance(value, str) else value
        if not isinstance(texts, list) or not all(isinstance(t, str) and t for t in texts):
            raise RequestError(f"{field} must be a text or a list of texts that are not empty")
        if option.most is not None and len(texts) > option.most:
            raise RequestError(f"{field} holds {len(texts)} texts; at most {option.most}")
        longest = max(map(len, texts), default=0)
        if longest > MAX_STOP_CHARS:
            raise RequestError(f"{field} holds a text of {longest} characters; at most {MAX_STOP_CHARS}")
        return tuple(texts)
    kind = option.kind
    if kind is str:
        if not isinstance(value, str):
            raise RequestError(f"{field} must be a text, not {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or (isinstance(value, float) and not math.isfinite(value)) or (kind is int and value != int(value)):
        raise RequestError(f"{field} must be {'an integer' if kind is int else 'a finite number'}, not {value!r}")
    try:
        value = kind(value)
    except OverflowError:  # (an integer too large for a float)
        raise RequestError(f"{field} must be a finite number, not one of {len(str(value))} digits") from None
    refused = option.bounds.refusal(field, value) if option.bounds is not None else None
    if refused is not None:
        raise RequestError(refused)
    return value


def request_tools(body: Mapping[str, Any], opts: TurnOptions) -> tuple[tuple[Tool, ...], TurnOptions]:
    """The tools a request offers (OpenAI's shape, which Ollama's shares), each checked as
    `--tools` checks a file's, which the client runs; and the plan with its `tool_choice`
    ("auto", "none", "required", or `{"type": "function", "function": {"name": NAME}}`)."""
    from quipu.app.tool_files import check_tool_schemas, held_to_what_holds, tools_from_json
    from quipu.app.tools import Toolbox

    given, choice = body.get("tools"), body.get("tool_choice")
    if given in (None, []):
        if choice not in (None, "auto", "none"):
            raise RequestError("tool_choice: the request offers no tools to choose from")
        return (), opts
    if not isinstance(given, list):
        raise RequestError("tools must be a list of tools ({\"type\": \"function\", \"function\": ...})")
    if len(given) > MAX_TOOLS:
        raise RequestError(f"tools holds {len(given)} tools; at most {MAX_TOOLS} a request")
    if opts.schema is not None:
        raise RequestError("give tools or a response format, not both: a call is held to its tool's schema")
    try:
        box = Toolbox()
        box.add([held_to_what_holds(t) for t in tools_from_json("the request", given)])
        check_tool_schemas(box.tools.values())
    except UsageError as exc:
        raise RequestError(str(exc).replace("the request: ", "")) from None
    if isinstance(choice, dict):
        fn = choice.get("function")
        choice = fn.get("name") if isinstance(fn, dict) else None
        if choice not in box.tools:
            raise RequestError("tool_choice must name one of the request's tools "
                               "({\"type\": \"function\", \"function\": {\"name\": NAME}})")
    elif choice not in (None, "auto", "none", "required"):
        raise RequestError("tool_choice must be auto, none, required, or a tool by name")
    return tuple(box.tools.values()), dataclasses.replace(opts, tool_choice=choice)


def let_be(body: Mapping[str, Any], read: frozenset[str], skipped: Sequence[str]) -> tuple[str, ...]:
    """What a request of an agents' API gave that only tunes a hosted service (`ChatRequest.ignored`):
    its fields its reading does not read (`read`), and the kinds of tool it left out (`skipped`)."""
    return tuple(sorted(set(body) - read)) + tuple(f"tools: {kind}" for kind in dict.fromkeys(skipped))


def chat_messages(body: Mapping[str, Any]) -> tuple[list[Message], tuple[Attachment, ...]]:
    """The request's messages (`sessions.base.Message`), each field checked, and the images and
    recordings they hold (each where `tool_files.media_placeholder` stands in a message). A
    medium comes in the request (a data URL, or base64): the server fetches no link."""
    from quipu.app.tool_files import messages_of

    if "messages" not in body:
        raise RequestError("messages: a chat request needs its messages")
    given = body["messages"]
    if isinstance(given, list) and len(given) > MAX_MESSAGES:
        raise RequestError(f"messages holds {len(given)} messages; at most {MAX_MESSAGES} a request")
    for i, m in enumerate(given if isinstance(given, list) else ()):
        parts = m.get("content") if isinstance(m, dict) else None
        for j, part in enumerate(parts if isinstance(parts, list) else ()):
            url = part.get("image_url") if isinstance(part, dict) else None
            url = url.get("url") if isinstance(url, dict) else url
            if isinstance(url, str) and url.startswith(("http://", "https://")):
                raise RequestError(f"messages[{i}].content[{j}]: quipu serve takes an image as a data URL "
                                   "(data:image/png;base64,...), not a link for it to fetch")
    media: list[Attachment] = []
    try:
        messages = messages_of(given, Path("the request"), media, fetch=False)
    except UsageError as exc:
        raise RequestError(str(exc).replace("the request: ", "")) from None
    return messages, tuple(media)


def ollama_messages(given: Any) -> Any:
    """Ollama's messages in OpenAI's shape: a message's `images` (base64) as image parts of its
    content, before its text (as `quipu run -a` puts them), a tool's result naming its tool
    (`tool_name`) as `name`."""
    if not isinstance(given, list):
        return given
    out = []
    for m in given:
        if isinstance(m, dict) and m.get("role") == "tool":
            m = {**m, "name": m.get("name") or m.get("tool_name")}
        if isinstance(m, dict) and m.get("images"):
            images = m["images"] if isinstance(m["images"], list) else [m["images"]]
            text = m.get("content")
            m = {**m, "content": [{"type": "image_url", "image_url": {"url": image}} for image in images] +
                 ([{"type": "text", "text": text}] if isinstance(text, str) and text else [])}
        out.append(m)
    return out


@dataclass(frozen=True)
class ChatRequest(Request):
    """A request, checked: what it gives its turn (`app.served.Request`: its plan and its
    messages, or, a plain completion's, its prompt), and what the server does with it besides."""

    n: int = 1  # how many answers (`choices`)
    keep: Keep = None  # how long the model stays loaded after it (Ollama's keep_alive; None: the server's)
    model: str = ""  # the model it is for, by its name (`serve.Served.pick`)
    session: str | None = None  # the quipu session it is a turn of (`X-Quipu-Session`), checked
    follows: Following | None = None  # in that session, the kept response it goes on from
    unkept: bool = False  # a turn of that session, not kept (a response not to be stored)
    whole_read: bool = False  # that session's turn answered as a whole read of its conversation is
    gives_context: bool = False  # the reply gives the context's tokens after it (Ollama's /api/generate)
    ignored: tuple[str, ...] = ()  # what it gave that only tunes a hosted service: let be, said in the log


def keep_alive(value: Any, where: str = "keep_alive") -> Keep:
    """A keep-alive (Ollama's spelling: seconds as a number, or a duration such as "5m", "1h30m",
    "90s"; a negative one keeps the model loaded for good): seconds, or `FOREVER`."""
    if isinstance(value, bool):
        raise RequestError(f"{where} must be a number of seconds or a duration such as 5m, not {value!r}")
    if isinstance(value, str):
        text = value.strip()
        try:
            value = float(text)
        except ValueError:
            negative = text.startswith("-")
            spans = DURATION.findall(text.lstrip("-"))
            if not spans or "".join(n + u for n, u in spans) != text.lstrip("-"):
                raise RequestError(f"{where} must be a number of seconds or a duration such as 5m, 1h or 90s, not "
                                   f"{text[:40]!r}") from None
            value = sum(float(n) * UNITS[u] for n, u in spans) * (-1 if negative else 1)
    try:
        value = float(value) if isinstance(value, (int, float)) else math.nan
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise RequestError(f"{where} must be a number of seconds or a duration such as 5m")
    if value > MAX_KEEP:
        raise RequestError(f"{where} must be at most {MAX_KEEP / 86400:.0f} days (or -1: loaded for good)")
    return FOREVER if value < 0 else value


def request_keep(body: Mapping[str, Any]) -> Keep:
    """How long an Ollama-style request keeps its model loaded after it (`keep_alive`; None:
    the server's keep-alive)."""
    return keep_alive(body["keep_alive"]) if body.get("keep_alive") is not None else None


def embed_inputs(body: Mapping[str, Any], field: str = "input") -> list[str | list[int]]:
    """What an embedding request gives to embed (`input`): a text, a list of texts, a text's
    token ids, or a list of those; each one not empty."""
    given = body.get(field)

    def ids(value: Any) -> bool:
        return isinstance(value, list) and bool(value) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value)

    inputs = [given] if isinstance(given, str) or ids(given) else given
    if not isinstance(inputs, list) or not inputs or not all(isinstance(t, str) or ids(t) for t in inputs):
        raise RequestError(f"{field} must be a text, a list of texts, token ids ([12, 34]) or a list of those")
    if len(inputs) > MAX_INPUTS:
        raise RequestError(f"{field} holds {len(inputs)} inputs; at most {MAX_INPUTS} a request")
    empty = next((i for i, t in enumerate(inputs) if isinstance(t, str) and not t.strip()), None)
    if empty is not None:
        raise RequestError(f"{field}[{empty}] is empty: there is nothing in it to embed")
    return inputs


def chat_request(body: Mapping[str, Any], base: TurnOptions) -> ChatRequest:
    """What an OpenAI-style chat request asks (`/v1/chat/completions`)."""
    tools, opts = request_tools(body, chat_plan(body, base))
    asked = _asked(opts, *chat_messages(body), tools)
    top = body.get("top_logprobs")
    if body.get("logprobs") not in (None, False, True):
        raise RequestError("logprobs must be true or false")
    if top is not None and not body.get("logprobs"):
        raise RequestError("top_logprobs needs logprobs: true")
    return dataclasses.replace(asked, logprobs=_top(top, "top_logprobs") if body.get("logprobs") else None,
                               n=body.get("n") or 1)


def choices(asked: ChatRequest) -> list[ChatRequest]:
    """The answers a request asks for, one plan each: with a seed, the n-th's is the seed plus n
    (each answer as a request with that seed gives it); without, each draws its own."""
    seed = asked.opts.seed
    if asked.n == 1 or seed is None:
        return [asked] * asked.n
    return [dataclasses.replace(asked, opts=dataclasses.replace(asked.opts, sampling={
        **asked.opts.sampling, "seed": (seed + i) % (MAX_SEED + 1)})) for i in range(asked.n)]


def _top(value: Any, field: str) -> int:
    """How many likeliest tokens a request asks for beside each of its reply's (none: 0)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise RequestError(f"{field} must be a whole number from 0 to {MAX_TOP_LOGPROBS}")
    return value


def completion_request(body: Mapping[str, Any], base: TurnOptions) -> ChatRequest:
    """What an OpenAI-style completion request (`/v1/completions`) asks: its prompt continued as
    it is, without the chat template (`quipu run --raw`)."""
    for field in ("echo", "suffix"):
        if body.get(field):
            raise RequestError(f"{field}: quipu serve does not take it yet")
    if body.get("best_of", 1) != 1:
        raise RequestError("best_of: quipu serve gives one choice a request")
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise RequestError("prompt must be a text that is not empty (one prompt a request)")
    logprobs = body.get("logprobs")  # (here the count of the likeliest beside each token)
    plan = chat_plan({k: v for k, v in body.items() if k not in ("response_format", "logprobs")}, base)
    return ChatRequest(plan, [], prompt, logprobs=None if logprobs is None else _top(logprobs, "logprobs"),
                       n=body.get("n") or 1)


def ollama_request(body: Mapping[str, Any], base: TurnOptions, generate: bool = False) -> ChatRequest:
    """What an Ollama-style request asks (`/api/chat`, or `/api/generate`: a prompt and a system
    prompt), with how long the model stays loaded after it (`keep_alive`)."""
    if body.get("raw"):
        raise RequestError("raw: quipu serve does not take raw prompts yet (/v1/completions continues one)")
    if body.get("logprobs"):
        raise RequestError("logprobs: quipu serve gives them over the OpenAI API (/v1/chat/completions)")
    keep = request_keep(body)
    if generate:
        prompt, system = body.get("prompt"), body.get("system")
        if not isinstance(prompt, str) or not prompt or not isinstance(system, (str, type(None))):
            raise RequestError("a generate request needs its prompt (a text), and its system prompt is a text")
        body = {**body, "messages": ([{"role": "system", "content": system}] if system else []) +
                [{"role": "user", "content": prompt, "images": body.get("images")}]}
    body = {**body, "messages": ollama_messages(body.get("messages"))}
    tools, opts = request_tools(body, ollama_plan(body, base))
    context = body.get("context") if generate else None
    if context is not None and (not isinstance(context, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in context)):
        raise RequestError("context must be the token ids a reply before gave (a list of whole numbers)")
    return dataclasses.replace(_asked(opts, *chat_messages(body), tools), keep=keep, context=tuple(context or ()),
                               gives_context=generate)


def as_session_turn(asked: ChatRequest, name: str | None) -> ChatRequest:
    """`asked` as a turn of the quipu session `name` (a request's `X-Quipu-Session`; None: not one)."""
    if name is None:
        return asked
    from quipu.app.served import session_name

    if asked.prompt is not None:
        raise RequestError("X-Quipu-Session: a plain completion is no turn of a session (send a chat request)")
    if asked.n > 1:
        raise RequestError("X-Quipu-Session: a session's turn has one answer (n must be 1)")
    try:
        return dataclasses.replace(asked, session=session_name(name))
    except UsageError as exc:
        raise RequestError(f"X-Quipu-Session: {exc}") from None


def load_only(body: Mapping[str, Any], generate: bool) -> bool:
    """Whether an Ollama-style request asks nothing but to load its model (or, with `keep_alive`
    0, to unload it): no prompt, or no messages."""
    return not body.get("prompt") if generate else body.get("messages") in (None, [])


def _asked(opts: TurnOptions, messages: list[Message], media: tuple[Attachment, ...],
           tools: tuple[Tool, ...] = ()) -> ChatRequest:
    if opts.schema is not None:
        from quipu.app.turn_options import grammar_of

        grammar_of(opts)  # (a schema the engine cannot keep to is refused before anything is loaded)
    return ChatRequest(opts, reply_to_the_last(messages), tools=tools, media=media)


def reply_to_the_last(messages: list[Message]) -> list[Message]:
    """`messages` with the system messages they end with (a note an agent adds after its user's
    turn: Claude Code's) joined to the user's message before them, so that the reply is to the
    user's turn; after a tool's result, they are a message of the user's."""
    last = len(messages)
    while last and messages[last - 1].role == "system":
        last -= 1
    if last == len(messages):
        return messages
    if last == 0:
        raise RequestError("messages: the conversation is a system prompt alone; nothing to reply to")
    from quipu.sessions.template import SYSTEM_JOINER

    said = SYSTEM_JOINER.join(m.content for m in messages[last:])
    before = messages[last - 1]
    if before.role == "user":
        return [*messages[:last - 1], dataclasses.replace(before, content=before.content + SYSTEM_JOINER + said)]
    return [*messages[:last], Message("user", said)]
