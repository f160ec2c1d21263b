"""Options shared by `quipu run` and `quipu chat`: defined once, used by both."""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer


def _complete_models(incomplete: str) -> list[str]:
    from quipu.cli.completion import complete_models

    return complete_models(incomplete)


def _complete_sessions(incomplete: str) -> list[str]:
    from quipu.cli.completion import complete_sessions

    return complete_sessions(incomplete)


Model = Annotated[Optional[str], typer.Option("--model", "-m", help="A .gguf file or a known model name.",
                                              autocompletion=_complete_models)]
Session = Annotated[Optional[str], typer.Option("--session", "-S", help="Continue or create this named session.",
                                                autocompletion=_complete_sessions)]
System = Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt.")]
MaxTokens = Annotated[Optional[int], typer.Option("--max-tokens", "-n", help="Most tokens to generate per reply (default: 512).")]
Temperature = Annotated[Optional[float], typer.Option("--temperature", "-t", help="0 is greedy (default: 0.8).")]
TopK = Annotated[Optional[int], typer.Option("--top-k", help="Keep the k likeliest tokens; 0 is off (default: 40).")]
TopP = Annotated[Optional[float], typer.Option("--top-p", help="Nucleus sampling, in (0, 1] (default: 0.95).")]
MinP = Annotated[Optional[float], typer.Option("--min-p", help="Drop tokens below this share of the top one (default: 0.05).")]
RepeatPenalty = Annotated[Optional[float], typer.Option("--repeat-penalty", help="1 is off (default: 1.1).")]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Random seed (default: random; --json reports it).")]
Stop = Annotated[List[str], typer.Option("--stop", help="Stop at this text (repeatable); it is not printed.")]
Ctx = Annotated[Optional[int], typer.Option("--ctx", help="Context size in tokens (default: the model's, at most 8192).")]
Threads = Annotated[Optional[int], typer.Option("--threads", help="CPU threads (default: the CPUs this process may use).")]
KvType = Annotated[Optional[str], typer.Option("--kv-type", help="KV cache type: f16, or q8_0 for half-size snapshots.")]
Verbose = Annotated[bool, typer.Option("--verbose", help="Show llama.cpp's own log on stderr.")]
ChatTemplate = Annotated[Optional[str], typer.Option(
    "--chat-template", help="A Jinja chat template file to use in place of the model's (a session remembers it).")]
Schema = Annotated[Optional[str], typer.Option(
    "--schema", help="Answer as JSON that validates against this JSON Schema (inline, or @file.json; off drops "
                     "a session's).")]
Grammar = Annotated[Optional[str], typer.Option(
    "--grammar", help="Answer as this GBNF grammar file allows (llama.cpp's format; off drops a session's).")]
LogitBias = Annotated[List[str], typer.Option(
    "--logit-bias", help="TOKEN=BIAS added to a token's logit, TOKEN an id or a one-token text; -inf bans it "
                         "(repeatable).")]
Think = Annotated[Optional[bool], typer.Option(
    "--think/--no-think", help="Turn a thinking model's reasoning on or off, where its template has the switch.")]


def turn_options(**given):
    """A TurnOptions from the command's parameters (names as above, snake_case)."""
    from quipu.app.environment import TurnOptions

    given["stop"] = tuple(given.get("stop") or ())
    given["logit_bias"] = tuple(given.get("logit_bias") or ())
    return TurnOptions(**given)
