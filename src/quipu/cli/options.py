"""The options of `spec.py` as Typer parameters: the aliases `chat` and `embed` annotate with,
and whole signatures for commands declared as a table (`run`)."""

from __future__ import annotations

import inspect
from typing import Annotated, List, Optional

import typer

from quipu.cli import spec


def annotated(option: spec.Opt | spec.Arg):
    """`Annotated[type, typer.Option(...)]` for an option (or the argument) declared in spec.py."""
    if isinstance(option, spec.Arg):
        return Annotated[Optional[str], typer.Argument(help=option.help)]
    kind = List[option.type] if option.multiple else option.type
    if not option.multiple and option.default is None:
        kind = Optional[kind]
    return Annotated[kind, typer.Option(*option.decls, help=option.help, autocompletion=option.complete)]


def signature(params: dict[str, spec.Opt | spec.Arg]) -> inspect.Signature:
    """A command's signature for Typer: the context, then the declared parameters in order."""
    context = inspect.Parameter("context", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
    return inspect.Signature([context] + [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotated(option),
                          default=None if isinstance(option, spec.Arg) else option.default)
        for name, option in params.items()
    ])


Model = annotated(spec.MODEL)
Session = annotated(spec.SESSION)
System = annotated(spec.SYSTEM)
MaxTokens = annotated(spec.MAX_TOKENS)
Temperature = annotated(spec.TEMPERATURE)
TopK = annotated(spec.TOP_K)
TopP = annotated(spec.TOP_P)
MinP = annotated(spec.MIN_P)
RepeatPenalty = annotated(spec.REPEAT_PENALTY)
Seed = annotated(spec.SEED)
Stop = annotated(spec.STOP)
Ctx = annotated(spec.CTX)
Threads = annotated(spec.THREADS)
KvType = annotated(spec.KV_TYPE)
Verbose = annotated(spec.VERBOSE)
ChatTemplate = annotated(spec.CHAT_TEMPLATE)
Schema = annotated(spec.SCHEMA)
Grammar = annotated(spec.GRAMMAR)
LogitBias = annotated(spec.LOGIT_BIAS)
Think = annotated(spec.THINK)
Url = annotated(spec.URL)
