"""The reference a chat template is rendered against: as Hugging Face transformers renders chat
templates (`transformers.utils.chat_template_utils._compile_jinja_template`), written here
apart from quipu's own code, then the whole text tokenized once with special tokens parsed
(what llama.cpp's server does)."""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


class AssistantTracker(Extension):
    """transformers' `{% generation %}` block: marks the assistant's text, renders it as it is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

    @jinja2.pass_eval_context
    def _generation_support(self, context, caller):
        return caller()


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_reference(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[AssistantTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_reference(source: str, messages: list[dict], *, add_generation_prompt: bool, bos_token: str = "",
                     eos_token: str = "", **extra) -> str:
    return compile_reference(source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            bos_token=bos_token, eos_token=eos_token, **extra)


def reference_tokens(backend, text: str) -> list[int]:
    """The rendered text tokenized once, special tokens parsed; the model's BOS where it wants one
    and the template did not write it."""
    tokens = backend.vocab.tokenize(text, add_special=False, parse_special=True)
    bos = backend.vocab.bos_token()
    if bos is not None and (not tokens or tokens[0] != bos):
        tokens.insert(0, bos)
    return tokens
