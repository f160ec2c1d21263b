"""The chat template: the model's own Jinja template, rendered in a sandbox."""

from __future__ import annotations

from datetime import datetime
from typing import Sequence

from quipu.engine.base import Backend
from quipu.errors import TemplateError

# Used when a GGUF has no chat template (as llama.cpp does).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplate:
    """A Jinja chat template, run sandboxed: a template from a downloaded file must not run code."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        from jinja2 import TemplateError as JinjaError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.source = source or CHATML_TEMPLATE
        self.is_fallback = source is None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(self.source)
        except JinjaError as exc:
            raise TemplateError(f"the model's chat template is broken: {exc}") from exc
        self._bos, self._eos = bos_token, eos_token

    @classmethod
    def of(cls, backend: Backend) -> "ChatTemplate":
        """The template a backend's model ships (ChatML when it has none)."""
        return cls(backend.chat_template(), backend.special_token_text("bos"), backend.special_token_text("eos"))

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> str:
        from jinja2 import TemplateError as JinjaError

        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos,
                eos_token=self._eos,
            )
        except (JinjaError, TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError) as exc:
            raise TemplateError(f"the model's chat template failed: {exc}") from exc


def _raise_exception(message: str) -> None:
    raise TemplateError(f"the model's chat template refused the conversation: {message}")
