"""`quipu run --batch`: a file of prompts answered side by side, each row with its own seed.

Input is JSON lines, each `{"prompt": ...}` or `{"messages": [...]}` with optional fields
(ROW_FIELDS), or plain text with one prompt per line; the first line that is not blank tells
which. Every row is answered as a lone `quipu run` with the same options would answer it, and
results come back in input order: a row is handed on as soon as every row before it is done.
A row that cannot be run (a bad field, too long for its share of the context) is an error
row, and the others go on.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

from quipu.app.user_files import lone_surrogate
from quipu.app.answer import Answer
from quipu.app.local import LocalHost, LocalKeeper, model_fingerprint
from quipu.app.turn import Ask, Turn
from quipu.app.environment import Environment
from quipu.app.turn_options import (
    TurnOptions,
    chat_template_source,
    check_positive,
    context_settings,
    load_backend,
    offload,
    logit_biases,
    max_tokens,
    sampling_params,
    stop_strings,
    system_prompt,
    template_variables,
)
from quipu.app.modes import BATCH, asked_of, check_options
from quipu.app.placing import placement_notices, placement_of, sequences_capped
from quipu.engine.settings import CTX_AUTO, DEFAULT_CTX_CAP, ContextSettings, available_cpus
from quipu.errors import BadInput, QuipuError, UsageError
from quipu.options import OPTIONS, ROW, SAMPLING
from quipu.sessions.batch import BatchRow, BatchSession
from quipu.sessions.base import LOCAL, SILENT
from quipu.sessions.conversation import Conversation, Message, TurnSettings
from quipu.sessions.reasoning import Thinking
from quipu.sessions.reasoning_sink import ReasoningSink
from quipu.sessions.inference import InferenceSession, Stats
from quipu.sessions.params import SamplingParams

if TYPE_CHECKING:
    from quipu.engine.base import Backend
    from quipu.engine.grammar import Grammar
    from quipu.sessions.base import Generation

# What a JSON row may hold besides its prompt (or messages): its id, and options (`quipu.options.ROW`).
ROW_FIELDS = ROW | {"id"}
ROLES = ("system", "user", "assistant")
CTX_STEP = 256  # a row's share of the context is rounded up to this
MAX_PARALLEL = 256  # llama.cpp's most sequences in one context


def default_parallel() -> int:
    """Sequences decoded side by side when --parallel is not given: on a CPU, steps of a few
    sequences per core cost little more than steps of one; past that the cores are the limit."""
    return min(16, max(4, 4 * available_cpus()))


@dataclass(frozen=True)
class RowInput:
    """One row as read: what it asks, or why it cannot be run."""

    index: int
    id: Any = None
    prompt: str | None = None
    messages: list[Message] | None = None
    system: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class RowOutcome:
    index: int
    id: Any
    result: Answer | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        head = {"index": self.index} if self.id is None else {"id": self.id, "index": self.index}
        if self.error is not None:
            return {**head, "error": self.error}
        assert self.result is not None  # (an outcome has its result or its error)
        return {**head, **self.result.to_json()}


def read_rows(text: str, fill: Callable[[str], str] = lambda text: text) -> list[RowInput]:
    """Rows from the input: JSON lines when the first line that is not blank is a JSON object,
    otherwise one prompt per line. Blank lines are no rows. `fill`: a role's prompt around each
    row's (a messages row's last, the user's)."""
    lines = [line for line in input_lines(text) if line.strip()]
    if not lines:
        raise BadInput("the batch has no rows")
    if not _json_object(lines[0]):
        return [RowInput(i, prompt=fill(line)) for i, line in enumerate(lines)]
    rows = [_json_row(i, line) for i, line in enumerate(lines)]
    return [replace(row, prompt=fill(row.prompt)) if row.prompt is not None else
            replace(row, messages=[*row.messages[:-1], replace(row.messages[-1], content=fill(row.messages[-1].content))])
            if row.messages else row for row in rows]


def input_lines(text: str) -> list[str]:
    """The lines of an input file or stdin: split where `\n` ends one (a `\r` before it dropped),
    not at the other characters `str.splitlines` takes for an end (U+2028, U+0085, a form feed...),
    which JSON strings and a user's text hold within a line."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def _json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except (ValueError, RecursionError):
        return False


def _json_row(index: int, line: str) -> RowInput:
    try:
        data = json.loads(line)
    except ValueError as exc:
        return RowInput(index, error=f"not a JSON object: {exc}")
    except RecursionError:
        return RowInput(index, error="its JSON nests deeper than quipu reads")
    if not isinstance(data, dict):
        return RowInput(index, error="not a JSON object")
    if lone_surrogate(data):
        return RowInput(index, error="it holds a lone surrogate (\\ud800-\\udfff), which is no text")
    unknown = sorted(set(data) - ROW_FIELDS - {"prompt", "messages"})
    prompt, messages, error = None, None, None
    if unknown:
        error = f"unknown field '{unknown[0]}' (known: prompt, messages, {', '.join(sorted(ROW_FIELDS))})"
    elif ("prompt" in data) == ("messages" in data):
        error = "give either prompt or messages"
    elif "prompt" in data and not (isinstance(data["prompt"], str) and data["prompt"].strip()):
        error = "prompt must be a text that is not empty"
    elif "messages" in data:
        messages, error = _messages(data["messages"])
    else:
        prompt = data["prompt"]
    if error is None and "system" in data and not isinstance(data["system"], str):
        error = "system must be a text"
    return RowInput(index, data.get("id"), prompt, messages, data.get("system"),
                    {k: data[k] for k in ROW_FIELDS - {"id", "system"} if k in data}, error)


def _messages(value: Any) -> tuple[list[Message] | None, str | None]:
    if not isinstance(value, list) or not value:
        return None, "messages must be a list of {role, content}"
    out = []
    for m in value:
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            return None, f"each message needs a role ({', '.join(ROLES)}) and a text content"
        out.append(Message(m["role"], m["content"]))
    if out[-1].role != "user":
        return None, "the last message must be the user's"
    return out, None


def row_schema(value: Any) -> Grammar:
    """A row's `schema` field (a JSON Schema object, or its text), checked as --schema is."""
    from quipu.engine.constraint import compile_grammar
    from quipu.engine.grammar import schema_grammar

    if isinstance(value, str):
        grammar = schema_grammar(value)
    elif isinstance(value, dict):
        grammar = schema_grammar(json.dumps(value))
    else:
        raise UsageError("schema must be a JSON Schema (an object, or its text)")
    compile_grammar(grammar)
    return grammar


def row_params(base: SamplingParams, fields: dict[str, Any], seed: int | None) -> tuple[SamplingParams, int | None, tuple[Any, ...]]:
    """A row's sampling parameters, reply length and stop strings, from its fields over the
    command line's (InvalidParameter or UsageError when a field is wrong)."""
    changes = {}
    for key, kind in SAMPLING.items():
        if key in fields:
            value = fields[key]
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                    or (kind is int and value != int(value))):
                raise UsageError(f"{key} must be {'an integer' if kind is int else 'a finite number'}, not {value!r}")
            changes[key] = kind(value)
    if "seed" in fields:
        if isinstance(fields["seed"], bool) or not isinstance(fields["seed"], int):
            raise UsageError("seed must be an integer")
        changes["seed"] = fields["seed"]
    elif seed is not None:
        changes["seed"] = seed
    if "schema" in fields:
        changes["grammar"] = row_schema(fields["schema"])
    params = base.replace(**changes).resolved()
    limit = fields.get("max_tokens")
    bounds = OPTIONS["max_tokens"].bounds
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or (bounds is not None and not bounds.holds(limit))):
        raise UsageError(f"max_tokens must be an integer {bounds.rule.removeprefix('must be ') if bounds else ''}")
    stop = fields.get("stop", ())
    if isinstance(stop, str):
        stop = (stop,)
    if not (isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop)):
        raise UsageError("stop must be a text or a list of texts")
    return params, limit, tuple(stop)



def run_batch(text: str, opts: TurnOptions, env: Environment, *, parallel: int | None = None,
              on_row: Callable[[RowOutcome], None], on_progress: Callable[[int, int, int], None] | None = None,
              should_stop: Callable[[], bool] | None = None, on_notice: Callable[[str], None] | None = None,
              fill: Callable[[str], str] = lambda text: text) -> int:
    """Answers every row of `text`; `on_row` gets the outcomes in input order, each as soon as
    it and every row before it are done; `on_notice` what to say of where the model runs (fewer
    layers fit on the GPU); `fill`, a role's prompt around each row's. Returns how many rows
    were written."""
    check_options(asked_of(opts.given), BATCH, LOCAL)  # (never dropped silently: a batch with tools would answer in plain text)
    check_positive("--parallel", parallel)
    if parallel is not None and parallel > MAX_PARALLEL:
        raise UsageError(f"--parallel must be at most {MAX_PARALLEL} (llama.cpp's limit of sequences), got {parallel}")
    rows = read_rows(text, fill)
    base = sampling_params(opts, env)
    limit = max_tokens(opts, env)
    settings = context_settings(opts, env)
    if settings.n_ctx == CTX_AUTO:
        raise UsageError("--ctx auto sizes one conversation's context; a batch shares its context among its rows: "
                         "give --ctx N, each row's share")
    # (the model is placed for the most the batch's context may take: each row's share, side by side)
    where = replace(offload(opts, env), fit_ctx=(settings.n_ctx or DEFAULT_CTX_CAP)
                    * min(parallel or default_parallel(), max(1, len(rows))))
    model_name, model_path = env.resolve_model(opts.model)
    source = chat_template_source(opts)
    started = time.perf_counter()
    tokenizer = load_backend(model_path, ContextSettings(n_ctx=CTX_STEP, n_batch=CTX_STEP, n_threads=settings.n_threads,
                                                           kv_type=settings.kv_type,
                                                           flash_attn=settings.flash_attn), opts.verbose, where)
    load_s = time.perf_counter() - started
    for notice in placement_notices(tokenizer, ctx_given=opts.ctx is not None, verbose=opts.verbose):
        if on_notice is not None:
            on_notice(notice)
    try:
        if opts.logit_bias:
            base = base.replace(logit_bias=logit_biases(tokenizer.vocab, opts.logit_bias))
        keeper = LocalHost.keeper(model_name, model_path, model_fingerprint(model_path, env), opts, env, None)
        plans = [_plan(row, base, opts, env, tokenizer, keeper, source, limit) for row in rows]
        runnable = [p for p in plans if p.error is None]
        n_ctx_train = tokenizer.n_ctx_train or settings.n_ctx or 4096
        # (a row whose reply is not bounded has a share of the usual context at most)
        need = max((len(p.ready.tokens) + min(p.ready.max_tokens, DEFAULT_CTX_CAP) for p in runnable), default=CTX_STEP)
        share = settings.n_ctx or min(n_ctx_train, -(-need // CTX_STEP) * CTX_STEP)
        plans = [replace(p, error=f"the prompt is {len(p.ready.tokens)} tokens, and each row's share of the "
                                  f"context is {share}; shorten it, or give a larger --ctx")
                 if p.error is None and len(p.ready.tokens) >= share else p for p in plans]
        runnable = [p for p in plans if p.error is None]
        n_seq, capped = sequences_capped(model_path, max(1, min(parallel or default_parallel(), len(runnable))))
        if capped is not None and parallel and on_notice is not None:  # (a default bounded: nothing to say)
            on_notice(capped)
        writer = InOrder(on_row)
        for p in plans:
            if p.error is not None:
                writer.done(RowOutcome(p.input.index, p.input.id, error=p.error))
        if not runnable:
            return writer.written
        batch_backend = load_backend(tokenizer.model, ContextSettings(
            n_ctx=share, n_batch=settings.n_batch, n_threads=settings.n_threads, kv_type=settings.kv_type,
            n_seq=n_seq, flash_attn=settings.flash_attn, swa_full=settings.swa_full), opts.verbose)
    except BaseException:
        tokenizer.close()
        raise
    tokenizer.close()
    placed = placement_of(batch_backend)
    generated = [0]
    try:
        batch = BatchSession(batch_backend)

        def on_token(i: int, token: int, text: str) -> None:
            stream = runnable[i].stream
            assert stream is not None
            stream.text(text)
            if token >= 0 and batch_backend.vocab.is_control(token):  # (markup the text does not show)
                stream.control(batch_backend.vocab.token_text(token).decode("utf-8", "replace"))

        def on_done(i: int, gen: Generation, stats: Stats) -> None:
            plan = runnable[i]
            assert plan.stream is not None and plan.row is not None and plan.turn is not None
            stats = replace(stats, load_s=load_s, placement=placed)
            reasoning, answer = plan.stream.finish()
            result = plan.turn.finished(replace(gen, answer=answer, reasoning=reasoning.strip()),
                                        params=plan.row.params, stats=stats)
            generated[0] += stats.completion_tokens
            row = plan.input
            asked = row.prompt if row.prompt is not None else next(
                (m.content for m in reversed(row.messages or []) if m.role == "user"), "")
            system = row.system if row.system is not None else system_prompt(opts, env)
            _, unlogged = log_answer(env, opts.logged, "batch", asked, result, system=system, log=book,
                                  unkept=len(row.messages or []) > 1)
            if unlogged:
                result.notices.append(unlogged)
            writer.done(RowOutcome(plan.input.index, plan.input.id, result=result))
            if on_progress is not None:
                on_progress(writer.finished, len(plans), generated[0])

        from quipu.app.answer_log import log_answer, open_log

        book = open_log(env)  # (one for the batch's rows)
        try:
            batch.run([p.ready for p in runnable], on_token, on_done, should_stop)
        finally:
            book.close()
    finally:
        batch_backend.close()
    return writer.written


@dataclass(frozen=True)
class _Plan:
    input: RowInput
    row: BatchRow | None = None
    stream: ReasoningSink | None = None
    turn: Turn | None = None
    error: str | None = None

    @property
    def ready(self) -> BatchRow:
        """The row to run (a plan without an error has one)."""
        assert self.row is not None, self.error
        return self.row


def _plan(row: RowInput, base: SamplingParams, opts: TurnOptions, env: Environment, tokenizer: Backend,
          keeper: LocalKeeper, source: str | None, limit: int) -> _Plan:
    """A row's turn (`turn.Turn`), stopped before the model runs: its prompt's tokens, as a lone
    `quipu run` would read them; the rows then decode side by side."""
    if row.error is not None:
        return _Plan(row, error=row.error)
    try:
        params, row_limit, stop = row_params(base, row.fields, opts.seed)
        session = InferenceSession(tokenizer, SamplingParams())
        if opts.raw:
            if row.messages is not None:
                raise UsageError("messages need the chat template; --raw takes prompts")
            turn, ask, thinking = Turn(session, keeper, None, opts.tool_options), Ask("raw", row.prompt or ""), Thinking()
        else:
            asked = row.messages if row.messages is not None else [Message("user", row.prompt or "")]
            # (the row's messages' own system prompt goes before the row's and the options')
            system = None if asked[0].role == "system" else row.system if row.system is not None else \
                system_prompt(opts, env)
            conv = Conversation.start(session, system, template=source, messages=asked,
                                      settings=TurnSettings().but(variables=template_variables(opts)))
            conv.set_reasoning(effort=opts.reasoning_effort)
            turn, ask = Turn(session, keeper, conv, opts.tool_options), Ask("answer")
            fmt = conv.reasoning
            thinking = Thinking(fmt, fmt is not None and fmt.starts_inside(conv.render(conv.messages, True).text))
        tokens = turn.tokens(ask)
    except QuipuError as exc:
        return _Plan(row, error=str(exc))
    return _Plan(row, BatchRow(tokens, params, row_limit or limit, stop_strings(opts, env) + stop),
                 ReasoningSink(SILENT, lambda: thinking), turn=turn)


class InOrder:
    """Hands outcomes on in input order: each as soon as it and every one before it are done."""

    def __init__(self, on_row: Callable[[RowOutcome], None]):
        self._held: dict[int, RowOutcome] = {}
        self._next = 0
        self._on_row = on_row
        self.finished = 0
        self.written = 0

    def done(self, outcome: RowOutcome) -> None:
        self._held[outcome.index] = outcome
        self.finished += 1
        while self._next in self._held:
            self._on_row(self._held.pop(self._next))
            self._next += 1
            self.written += 1
