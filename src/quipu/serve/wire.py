"""The wire: the bodies of `quipu serve`'s replies, in the shapes the OpenAI API and Ollama's give
them: an answer whole or a piece of it, its usage, an error (the one place a failure is given its
status: a client's error a 4xx, 500 for quipu's own), embeddings, and the models (listed, shown,
loaded)."""

from __future__ import annotations

import base64
import json
import math
import struct
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from quipu.app.answer import Answer
from quipu.serve.plan import RequestError
from quipu.app.turns import SessionConflict
from quipu.errors import ContextOverflow, QuipuError, SessionLocked, UsageError
from quipu.sessions.template import TemplateRefused

if TYPE_CHECKING:
    from quipu.app.served import Loaded
    from quipu.sessions.params import SamplingParams

FINISH = {"stop": "stop", "length": "length", "context_full": "length", "interrupted": "stop",
          "tool_calls": "tool_calls"}


def chat_completion(answers: Sequence[Answer], ident: str, created: int) -> dict[str, Any]:
    """The OpenAI chat completion of a request's answers (its `choices`), whole."""
    def choice(index: int, answer: Answer) -> dict[str, Any]:
        calls = openai_calls(answer)
        message: dict[str, Any] = {"role": "assistant", "content": answer.text or (None if calls else "")}
        if answer.reasoning:
            message["reasoning_content"] = answer.reasoning
        if calls:
            message["tool_calls"] = calls
        return {"index": index, "message": message, "finish_reason": FINISH.get(answer.finish_reason, "stop"),
                "logprobs": chat_logprobs(answer)}

    first = answers[0]
    return {"id": ident, "object": "chat.completion", "created": created, "model": first.model,
            "choices": [choice(i, a) for i, a in enumerate(answers)], "usage": usage(answers),
            "system_fingerprint": first.fingerprint}


def chat_logprobs(answer: Answer) -> dict[str, Any] | None:
    """A chat choice's `logprobs`: each drawn token's, where the request asked for them."""
    return None if answer.logprobs is None else {"content": answer.logprobs}


def text_logprobs(entries: Sequence[dict[str, Any]] | None) -> dict[str, Any] | None:
    """A completion choice's `logprobs` (of its drawn tokens' `entries`), in the older API's
    shape: the tokens, their log probabilities, the likeliest beside each, and where each begins
    in the text."""
    if entries is None:
        return None
    offsets, at = [], 0
    for entry in entries:
        offsets.append(at)
        at += len(entry["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def waiting_calls(answer: Answer) -> list[Any]:
    """The calls a reply ended with, which the client runs (`app.tools.CallRecord`s)."""
    if answer.finish_reason != "tool_calls":
        return []
    return [c for c in answer.tool_calls if c.result is None and c.error is None]


def openai_calls(answer: Answer, streamed: bool = False) -> list[dict[str, Any]]:
    """The calls a reply ended with, in OpenAI's shape (the arguments a JSON text; `streamed`:
    as a stream's delta, each with its index)."""
    return [{**({"index": i} if streamed else {}), "id": call.id or f"call_{i}", "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
            for i, call in enumerate(waiting_calls(answer))]


def text_completion(answers: Sequence[Answer], ident: str, created: int) -> dict[str, Any]:
    """The OpenAI completion of a plain prompt's answers, whole."""
    return {"id": ident, "object": "text_completion", "created": created, "model": answers[0].model,
            "choices": [{"index": i, "text": a.text, "logprobs": text_logprobs(a.logprobs),
                         "finish_reason": FINISH.get(a.finish_reason, "stop")} for i, a in enumerate(answers)],
            "usage": usage(answers)}


def usage(answers: Sequence[Answer]) -> dict[str, Any]:
    """The usage a request's answers report: the prompt's tokens (the first answer's; those
    restored rather than read among them), and every answer's."""
    s = answers[0].stats
    completion = sum(a.stats.completion_tokens for a in answers)
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": completion,
            "total_tokens": s.prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": s.cached_tokens}}


ROOM = 1024  # tokens a context fitted to a prompt keeps for its reply, at the least (`error_body`)


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The status and OpenAI-shaped body of a failure (one line, never a traceback)."""
    if isinstance(exc, ContextOverflow):  # (llama-server's type and figures, OpenAI's code)
        size = f"more than {exc.prompt_tokens:,}" if exc.at_least else f"{exc.prompt_tokens:,}"
        fits = 1 << max(12, (exc.prompt_tokens + ROOM).bit_length())
        said = (f"the prompt is {size} tokens but the server's context holds {exc.n_ctx:,}: start quipu serve with "
                f"--ctx {fits} (or more), or send a shorter conversation")
        return 400, {"error": {"message": said, "type": "exceed_context_size_error", "param": "messages",
                               "code": "context_length_exceeded", "n_prompt_tokens": exc.prompt_tokens,
                               "n_ctx": exc.n_ctx}}
    if isinstance(exc, RequestError):
        status, kind = exc.status, exc.kind
    elif isinstance(exc, (SessionConflict, SessionLocked)):
        status, kind = 409, "conflict"  # (the session's turn is another's, or the messages are not its own)
    elif isinstance(exc, (UsageError, TemplateRefused)):  # (the template refused the request's messages)
        status, kind = 400, "invalid_request_error"
    elif isinstance(exc, QuipuError):
        status, kind = 500, "server_error"
    else:
        status, kind = 500, "server_error"
        exc = QuipuError(f"the server failed: {type(exc).__name__}")
    return status, {"error": {"message": str(exc), "type": kind, "param": None, "code": None}}


def ollama_error(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The status and Ollama-shaped body of a failure."""
    status, shaped = error_body(exc)
    return status, {"error": shaped["error"]["message"]}


def ollama_reply(answer: Answer, created: str) -> dict[str, Any]:
    """The last line of an Ollama-style reply (the whole reply, where it is not streamed, with
    `text`): why it ended, and its figures (`prompt_eval_count`: the prompt's tokens read, not
    restored)."""
    s = answer.stats
    return {"model": answer.model, "created_at": created, "done": True,
            **({"context": answer.context} if answer.context is not None else {}),
            "done_reason": "length" if FINISH.get(answer.finish_reason) == "length" else "stop",
            "total_duration": int((s.load_s + s.restore_s + s.prefill_s + s.decode_s) * 1e9),
            "load_duration": int(s.load_s * 1e9), "prompt_eval_count": s.prompt_tokens - s.cached_tokens,
            "prompt_eval_duration": int(s.prefill_s * 1e9), "eval_count": s.completion_tokens,
            "eval_duration": int(s.decode_s * 1e9)}


def ollama_piece(model: str, created: str, text: str, reasoning: str = "", *, generate: bool,
                 calls: Sequence[Any] = ()) -> dict[str, Any]:
    """A line of an Ollama-style reply: a piece of its text (or of its reasoning), or the calls
    it ended with (`app.tools.CallRecord`s), which the client runs."""
    if generate:
        return {"model": model, "created_at": created, "response": text,
                **({"thinking": reasoning} if reasoning else {}), "done": False}
    message = {"role": "assistant", "content": text, **({"thinking": reasoning} if reasoning else {}),
               **({"tool_calls": [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls]}
                  if calls else {})}
    return {"model": model, "created_at": created, "message": message, "done": False}


# ---- embeddings ------------------------------------------------------------------------------

def unit(vector: Sequence[float]) -> list[float]:
    """`vector` scaled to length 1 (as the OpenAI API and Ollama's give embeddings)."""
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


def openai_embeddings(model: str, vectors: Sequence[Sequence[float]], tokens: int, form: Any) -> dict[str, Any]:
    """`/v1/embeddings`' reply: each vector as numbers, or (`form` "base64", what the `openai`
    client asks for) as its little-endian 32-bit floats in base64."""
    if form not in (None, "float", "base64"):
        raise RequestError("encoding_format must be float or base64")

    def spelled(vector: Sequence[float]) -> Any:
        if form != "base64":
            return list(vector)
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")

    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": spelled(unit(v))} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def ollama_embeddings(model: str, vectors: Sequence[Sequence[float]], tokens: int, load_s: float,
                      took_s: float) -> dict[str, Any]:
    """`/api/embed`'s reply."""
    return {"model": model, "embeddings": [unit(v) for v in vectors], "total_duration": int(took_s * 1e9),
            "load_duration": int(load_s * 1e9), "prompt_eval_count": tokens}


# ---- models ----------------------------------------------------------------------------------

def _when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat()


def openai_models(models: dict[str, Path]) -> dict[str, Any]:
    """`/v1/models`: every model a request may name, the default first."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": int(_mtime(path)),
                                        "owned_by": "quipu"} for name, path in models.items()]}


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def details(path: Path) -> dict[str, Any]:
    """What Ollama's replies say of a model (`details`), from its file's header."""
    from quipu.gguf import GGUFError, human_params, read_gguf

    try:
        info = read_gguf(path)
    except (GGUFError, OSError):
        return {"format": "gguf"}
    return {"parent_model": "", "format": "gguf", "family": info.architecture, "families": [info.architecture],
            "parameter_size": human_params(info.n_params), "quantization_level": info.quantization}


def ollama_tags(models: dict[str, Path], digest: Callable[[Path], str]) -> dict[str, Any]:
    """`/api/tags`: every model a request may name, each with its file's digest (`digest`)."""
    rows = []
    for name, path in models.items():
        try:
            size = path.stat().st_size
        except OSError:
            size = 0
        rows.append({"name": name, "model": name, "modified_at": _when(_mtime(path)), "size": size,
                     "digest": digest(path), "details": details(path)})
    return {"models": rows}


def parameters(params: SamplingParams, stop: Sequence[str], n_ctx: int | None) -> list[tuple[str, Any]]:
    """The server's sampling settings, by Ollama's names, as `/api/show` gives them."""
    from quipu.options import OPTIONS

    found = [(o.ollama, getattr(params, name)) for name, o in OPTIONS.items()
             if o.ollama is not None and o.sampling and getattr(params, name, None) is not None]
    return [*found, *(("num_ctx", n_ctx) for _ in [n_ctx] if n_ctx), *(("stop", s) for s in stop)]


def ollama_show(name: str, path: Path, settings: Sequence[tuple[str, Any]] = ()) -> dict[str, Any]:
    """`/api/show`: a model's details, its chat template, what it can do and its header's facts
    (not the tokenizer's tables), read from its file without loading it; the server's settings
    (`settings`: Ollama's name, value) as its parameters and a Modelfile that says the same."""
    from quipu.gguf import ArrayInfo, GGUFError, read_gguf
    from quipu.models import media_of

    try:
        info = read_gguf(path)
    except (GGUFError, OSError) as exc:
        raise QuipuError(f"{name} cannot be read: {exc}") from None
    template = info.chat_template or ""
    capabilities = ["completion"] + (["tools"] if "tools" in template else []) \
        + (["thinking"] if "think" in template else []) + (["vision"] if "image" in media_of(path)[1] else [])
    facts = {k: v for k, v in info.metadata.items()
             if not isinstance(v, ArrayInfo) and not k.startswith("tokenizer.") and not isinstance(v, bytes)}
    said = [f"{key} {json.dumps(value) if isinstance(value, str) else value}" for key, value in settings]
    modelfile = "\n".join([f"# quipu serve's model {name}", f"FROM {path}", *(f"PARAMETER {line}" for line in said),
                           *([f'TEMPLATE """{template}"""'] if template else [])]) + "\n"
    return {"modelfile": modelfile, "parameters": "\n".join(said), "template": template, "license": str(facts.get("general.license", "")),
            "details": details(path), "model_info": facts, "capabilities": capabilities,
            "modified_at": _when(_mtime(path))}


def ollama_ps(loaded: Loaded | None, digest: Callable[[Path], str]) -> dict[str, Any]:
    """`/api/ps`: the model loaded now, if any, and until when."""
    if loaded is None:
        return {"models": []}
    path = loaded.path
    try:
        size = path.stat().st_size
    except OSError:
        size = 0
    on_gpu = loaded.backend.placement.gpu_layers > 0
    expires = loaded.expires
    return {"models": [{"name": loaded.name, "model": loaded.name, "size": size, "digest": digest(path),
                        "details": details(path),
                        "expires_at": "9999-12-31T00:00:00Z" if expires is None else _when(expires),
                        "size_vram": size if on_gpu else 0, "context_length": loaded.backend.n_ctx}]}
