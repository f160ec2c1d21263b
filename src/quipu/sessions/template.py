"""The chat template: the model's own Jinja template, rendered in a sandbox."""

from __future__ import annotations

import contextvars

import functools
import json
import os
from datetime import datetime
import re
from typing import TYPE_CHECKING, Any, Callable, Sequence

from quipu.engine.base import MEDIA_MARK, Backend
from quipu.errors import TemplateError

if TYPE_CHECKING:
    import jinja2
    import jinja2.parser
    import jinja2.runtime

    from quipu.sessions.reasoning import ReasoningFormat

# Used when a GGUF has no chat template (as llama.cpp does).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TemplateRefused(TemplateError):
    """The template itself said no (its `raise_exception`), in its own words."""


# Where a template refuses a system message, it joins the first user message, as llama.cpp does.
SYSTEM_JOINER = "\n\n"


# The most a template may write beyond what its messages bring (a chat template is a few KB).
MAX_OUTPUT = 1 << 20
# The most numbers all of a render's `range`s may count, nested loops included: a loop that
# writes nothing is bounded by this, not by its output.
MAX_RANGE_ITEMS = 1_000_000
# The longest a render may take (a real template takes milliseconds; a loop over the characters
# of a long text, say, could take hours).
MAX_RENDER_S = 5.0
_RANGE_BUDGET: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("range_budget", default=None)


class ChatTemplate:
    """A Jinja chat template, rendered as Hugging Face transformers renders one (the sandbox,
    `trim_blocks`, `lstrip_blocks`, loop controls, the `generation` block, `raise_exception`,
    `strftime_now`, a `tojson` that keeps non-ASCII text), with the messages' real text. Run
    sandboxed: a template from a downloaded file must not run code."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        self.source = source or CHATML_TEMPLATE
        self.is_fallback = source is None
        self._template = _compiled(self.source)
        self._bos, self._eos = bos_token, eos_token
        self.folds_system = False  # set once a render had to join the system prompt to a user message

    @classmethod
    def of(cls, backend: Backend, source: str | None = None) -> "ChatTemplate":
        """`source`, else the template a backend's model ships (ChatML when it has none)."""
        return cls(source or backend.vocab.chat_template(), backend.vocab.special_token_text("bos"),
                   backend.vocab.special_token_text("eos"))

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool, **variables: Any) -> str:
        """The template's text for `messages`. A template that refuses a system message gets it
        joined to the first user message instead (`folds_system` then says so). A medium in a
        message's text (its marker, `engine.base.MEDIA_MARK`) goes where the template puts an
        image of the message's content parts, where it has a place for one (`image_placeholder`)."""
        messages = list(messages)
        if self.image_placeholder and any(MEDIA_MARK.search(str(m.get("content") or "")) for m in messages):
            placed = self._render_media(messages, add_generation_prompt, variables)
            if placed is not None:
                return placed
        return self._render_text(messages, add_generation_prompt, variables)

    def _render_media(self, messages: list[Any], add_generation_prompt: bool, variables: dict[str, Any]) -> str | None:
        """The messages with media as content parts (`{"type": "image"}` between text parts, as
        transformers passes them), each template's placeholder for one then the medium's marker;
        None where the template does not place each of them once (the markers stay in the text)."""
        marks: list[str] = []

        def parts(content: str) -> list[dict[str, str]]:
            out, at = [], 0
            for found in MEDIA_MARK.finditer(content):
                if found.start() > at:
                    out.append({"type": "text", "text": content[at:found.start()]})
                out.append({"type": "image"})
                marks.append(found.group(0))
                at = found.end()
            if at < len(content):
                out.append({"type": "text", "text": content[at:]})
            return out

        given = [{**m, "content": parts(m["content"])} if isinstance(m.get("content"), str)
                 and MEDIA_MARK.search(m["content"]) else m for m in messages]
        try:
            text = self._render_text(given, add_generation_prompt, variables)
        except (TemplateError, TypeError):  # (a system prompt folded into parts, say)
            return None
        placeholder = self.image_placeholder
        assert placeholder is not None
        if text.count(placeholder) != len(marks):
            return None
        for mark in marks:
            text = text.replace(placeholder, mark, 1)
        return text

    @functools.cached_property
    def image_placeholder(self) -> str | None:
        """What the template writes for an image part of a message's content (Gemma 3's
        `<start_of_image>`, Qwen-VL's `<|vision_start|><|image_pad|><|vision_end|>`), found by
        rendering a message with one and without; None for a template without a place for one
        (one that reads `content` as text alone, or writes nothing for an image)."""
        said = "\ue010"
        try:
            plain = self._render([{"role": "user", "content": said}], True, {})
            as_parts = self._render([{"role": "user", "content": [{"type": "text", "text": said}]}], True, {})
            with_image = self._render([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": said}]}],
                                      True, {})
        except TemplateError:
            return None
        if as_parts != plain or said not in with_image:
            return None
        head = len(os.path.commonprefix([as_parts, with_image]))
        tail = len(os.path.commonprefix([as_parts[head:][::-1], with_image[head:][::-1]]))
        placeholder = with_image[head:len(with_image) - tail]
        return placeholder if placeholder.strip() and said not in placeholder else None

    def _render_text(self, messages: list[Any], add_generation_prompt: bool, variables: dict[str, Any]) -> str:
        if any(m.get("tool_calls") for m in messages) and self.string_arguments:
            messages = [_arguments_as_json(m) for m in messages]
        if self.folds_system:
            messages = fold_system(fold_late_system(messages))
        try:
            return self._render(messages, add_generation_prompt, variables)
        except TemplateRefused:
            folded = fold_system(fold_late_system(messages))
            if folded is messages:
                raise
            text = self._render(folded, add_generation_prompt, variables)
            self.folds_system = True
            return text

    @functools.cached_property
    def string_arguments(self) -> bool:
        """Whether the template takes a call's arguments as a JSON string, not an object (as
        Functionary v3.2's does): found by rendering a call both ways, as llama.cpp does."""
        def call(arguments: Any) -> list[dict[str, Any]]:
            return [{"role": "user", "content": "u"}, {"role": "assistant", "content": "", "tool_calls": [
                {"id": "000000001", "type": "function", "function": {"name": "f", "arguments": arguments}}]}]
        try:
            self._render(call({"a": 1}), False, {})
            return False
        except TemplateError:
            pass
        try:
            self._render(call('{"a": 1}'), False, {})
            return True
        except TemplateError:
            return False

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, variables: dict[str, Any]) -> str:
        from jinja2 import TemplateError as JinjaError

        # The output is bounded as it is made: a template (from a downloaded file, a session) must
        # not be able to fill the memory; what messages bring is allowed for.
        limit = MAX_OUTPUT + 4 * sum(len(str(m.get("content", ""))) for m in messages)
        pieces: list[str] = []
        size = 0
        budget = _RANGE_BUDGET.set([MAX_RANGE_ITEMS])
        clock = _Deadline(MAX_RENDER_S)
        try:
            for piece in self._template.generate(**variables, messages=messages,
                                                 add_generation_prompt=add_generation_prompt,
                                                 bos_token=self._bos, eos_token=self._eos):
                size += len(piece)
                if size > limit:
                    raise TemplateError(f"the chat template's output is longer than {limit:,} characters")
                pieces.append(piece)
        except (TemplateRefused, TemplateError):
            raise
        except (JinjaError, TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError,
                ArithmeticError, MemoryError) as exc:
            raise TemplateError(f"the chat template failed: {exc}") from exc
        finally:
            clock.cancel()
            _RANGE_BUDGET.reset(budget)
        return "".join(pieces)

    @functools.cached_property
    def reasoning(self) -> "ReasoningFormat | None":
        """How a reply under this template writes its reasoning (None: in no way quipu knows)."""
        from quipu.sessions.reasoning_found import find_format

        return find_format(self.source, self.render)

    def features(self) -> dict[str, bool]:
        """What the template does, as far as its text tells: a system role, thinking (and a switch
        for it), tools."""
        src = self.source
        try:
            self._render([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], True, {})
            system = True
        except TemplateError:
            system = False
        return {
            "system_role": system,
            "thinking": self.reasoning is not None,
            "thinking_switch": "enable_thinking" in src,
            "tools": "tools" in src,
        }


def _arguments_as_json(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose calls' arguments are JSON text, as `tojson` writes them."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = dict(call.get("function") or {})
        if not isinstance(function.get("arguments"), str):
            function["arguments"] = json.dumps(function.get("arguments"), ensure_ascii=False)
        calls.append({**call, "function": function})
    return {**message, "tool_calls": calls}


def fold_system(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The system message joined to the first user message; `messages` itself when there is none."""
    if len(messages) < 2 or messages[0]["role"] != "system" or messages[1]["role"] != "user":
        return messages
    joined = {"role": "user", "content": messages[0]["content"] + SYSTEM_JOINER + messages[1]["content"]}
    return [joined, *messages[2:]]


def fold_late_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each system message after the conversation's start (an agent's note) joined to the user's
    message after it, else to the one before it; `messages` itself when there is none to join."""
    start = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    late = [i for i in range(start, len(messages)) if messages[i]["role"] == "system"
            and isinstance(messages[i].get("content"), str)]
    if not late:
        return messages
    out = [dict(m) for m in messages]
    for i in late:
        after = next((j for j in range(i + 1, len(out)) if out[j]["role"] == "user"), None)
        at = after if after is not None else next((j for j in range(i - 1, -1, -1) if out[j]["role"] == "user"), None)
        if at is None or not isinstance(out[at].get("content"), str):
            continue
        note = out[i]["content"]
        out[at]["content"] = note + SYSTEM_JOINER + out[at]["content"] if at > i else \
            out[at]["content"] + SYSTEM_JOINER + note
        out[i] = {}
    return [m for m in out if m]


class _Deadline:
    """Ends a render that runs past its time: a timer signal (SIGALRM) raises in the render's
    Python code. Only in the main thread, where a signal can be had; a timer already set (by
    whoever embeds quipu) is left alone."""

    def __init__(self, seconds: float):
        import signal
        import threading

        self._signal = None
        if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
            return
        if signal.getitimer(signal.ITIMER_REAL)[0] > 0:
            return
        self._signal = signal
        self._previous = signal.signal(signal.SIGALRM, self._expired)
        signal.setitimer(signal.ITIMER_REAL, seconds)

    @staticmethod
    def _expired(signum: int, frame: object) -> None:
        raise TemplateError(f"the chat template took longer than {MAX_RENDER_S:g} s to render")

    def cancel(self) -> None:
        if self._signal is not None:
            self._signal.setitimer(self._signal.ITIMER_REAL, 0)
            self._signal.signal(self._signal.SIGALRM, self._previous)
            self._signal = None


# A format's width or precision past what a template could need (a field of a million characters).
_WIDE = re.compile(r"%[-#0 +]*(?:\d{7,}|\d*\.\d{7,})|\{[^{}]*:[^{}]*\d{7,}[^{}]*\}")


def _check_step(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuses a call that would make a value past MAX_OUTPUT in one step, which no deadline
    can interrupt (Python's own string code): a count or width that large (`center`, `ljust`,
    `indent`, a format's `*`), a format string that asks for one, a replacement that multiplies
    a text past it. `obj`: what is called (a filter by its name, `%` for the operator)."""
    values = (*args, *kwargs.values())
    if any(isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_OUTPUT for v in values):
        raise TemplateError(f"the chat template asks for a count or size past {MAX_OUTPUT:,} in one step")
    bound = getattr(obj, "__wrapped__", obj)  # (the sandbox wraps `str.format`)
    name = getattr(bound, "__name__", obj)
    texts = [v for v in (getattr(bound, "__self__", None), *values) if isinstance(v, str)]
    if name in ("format", "format_map", "%") and texts and _WIDE.search(texts[0]):  # (the format string alone)
        raise TemplateError(f"the chat template formats a field wider than {MAX_OUTPUT:,} characters")
    if name == "replace" and len(texts) >= 3:
        text, old, new = texts[0], texts[1], texts[2]
        grows = (text.count(old) if old else len(text) + 1) * max(0, len(new) - len(old))
        if len(text) + grows > MAX_OUTPUT + len(text):
            raise TemplateError(f"the chat template makes a value longer than {MAX_OUTPUT:,}")


def _checked_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """A filter that checks its arguments as a call does (`_check_step`), marked as `f` is."""
    def checked(*args: Any, **kwargs: Any) -> Any:
        given = [a for a in args if isinstance(a, (str, int))]  # (a context or environment passed first is not)
        if given and isinstance(given[0], int):
            given = given[1:]  # (the value filtered: a number of its own, not a count to make)
        _check_step(name, tuple(given), kwargs)
        return f(*args, **kwargs)

    return functools.update_wrapper(checked, f)


def _budgeted_range(*args: int) -> range:
    """`range`, drawing on the render's budget of numbers (the sandbox bounds each range alone)."""
    from jinja2.sandbox import safe_range

    numbers: range = safe_range(*args)
    left = _RANGE_BUDGET.get()  # (None outside a render of ours)
    if left is None:
        return numbers
    left[0] -= len(numbers)
    if left[0] < 0:
        raise TemplateError(f"the chat template's loops count more than {MAX_RANGE_ITEMS:,} numbers")
    return numbers


def _raise_exception(message: str) -> None:
    raise TemplateRefused(f"the chat template refused the conversation: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compiled(source: str) -> jinja2.Template:
    """A template's source compiled, once a process (a chat opens one a session)."""
    from jinja2 import TemplateError as JinjaError

    try:
        return _environment().from_string(source)
    except JinjaError as exc:
        raise TemplateError(f"the chat template is broken: {exc}") from exc


@functools.lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    """One sandboxed Jinja environment for every template (Jinja is imported only when needed)."""
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers marks the assistant's text with it)."""

        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_as_is"), [], [], body).set_lineno(lineno)

        def _as_is(self, caller: Callable[[], str]) -> str:
            return caller()

    class Bounded(ImmutableSandboxedEnvironment):
        """The sandbox, with `*`, `**` and `%` kept from making values no template needs, and every
        call (a function, a method, `format`) checked for what would make one in a single step."""

        intercepted_binops = frozenset(["*", "**", "%"])

        def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > MAX_OUTPUT:
                        raise TemplateError(f"the chat template makes a value longer than {MAX_OUTPUT:,}")
            if operator == "**" and isinstance(right, int) and abs(right) > 64 and isinstance(left, int) and abs(left) > 1:
                raise TemplateError("the chat template raises a number to a power too large")
            if operator == "%" and isinstance(left, str):
                _check_step("%", (left, *(right if isinstance(right, tuple) else (right,))), {})
            return super().call_binop(context, operator, left, right)

        def call(self, context: jinja2.runtime.Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:  # (positional: a template's own keywords pass through)
            _check_step(obj, args, kwargs)
            return super().call(context, obj, *args, **kwargs)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    # Filters are called without `call`, and those with constant arguments while the template
    # compiles (Jinja folds them): each checked as a call is.
    for name, f in list(env.filters.items()):
        env.filters[name] = _checked_filter(name, f)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["range"] = _budgeted_range
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
