"""Sampling parameters, validated where they are made.

Constraining what is generated, from the strictest to the freest:

- `SamplingParams(grammar=Grammar(kind, text))`: every reply keeps to the grammar, a JSON
  Schema (`quipu.engine.grammar.schema_grammar` checks one), GBNF, Lark or a regular
  expression, through the constraint engine (`quipu.engine.constraint`: llguidance's masks on
  llama.cpp's logits, before the native chain draws). The grammar starts over with each reply and is part of a snapshot: restoring a reply in progress
  replays its tokens into it, so a resumed reply continues exactly.
- `SamplingParams(logit_bias=((token, bias), ...))`: added to those tokens' logits
  (`-inf` bans a token), natively.
- `InferenceSession.token_filter`: a callable given the token history that returns the token
  ids allowed next (or None for all of them).
- `InferenceSession.logits_processors`: callables `processor(tokens, logits)` that change
  `logits` in place, a NumPy float32 view of llama.cpp's own logits (no copy), before
  sampling. To force a token: `logits[:] = -numpy.inf; logits[token] = 0`.

The filter and the processors are Python objects, so they are not saved with a session;
grammars and biases are.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from dataclasses import dataclass
from typing import Any

from quipu.engine.base import SamplerSettings
from quipu.engine.grammar import Grammar
from quipu.errors import InvalidParameter
from quipu.options import OPTIONS, SAMPLING



@dataclass(frozen=True)
class SamplingParams(SamplerSettings):
    """How the next token is chosen: the sampler chain's settings (and defaults), validated, as
    the backend's chain is built from them, plus the seed, which goes per draw (`draw_seed`).
    `seed=None` means a fresh random seed (see `resolved`)."""

    seed: int | None = None

    def __post_init__(self) -> None:
        # Each parameter's type and bounds, as the registry of options gives them.
        for name, kind in SAMPLING.items():
            value = getattr(self, name)
            if value is None and name == "seed":
                continue  # (drawn when the parameters are resolved)
            if kind is float and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                  or not math.isfinite(value)):
                raise InvalidParameter(f"{name.replace('_', '-')} must be a finite number, got {value}")
            if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
                raise InvalidParameter(f"{name.replace('_', '-')} must be a whole number, got {value}")
            bounds = OPTIONS[name].bounds
            refused = bounds.refusal(name.replace("_", "-"), value) if bounds is not None else None
            if refused is not None:
                raise InvalidParameter(refused)
        if not all(isinstance(t, int) and t >= 0 and isinstance(b, (int, float)) and b == b for t, b in self.logit_bias):
            raise InvalidParameter(f"logit-bias must be pairs of a token id and a number, got {self.logit_bias}")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise InvalidParameter(f"grammar must be a grammar, got {self.grammar}")

    @property
    def draw_base(self) -> int:
        """The seed draws are made from (a resolved set of parameters has one)."""
        if self.seed is None:
            raise ValueError("these sampling parameters have no seed yet (resolve them first)")
        return self.seed

    @property
    def constrained(self) -> bool:
        return self.grammar is not None or bool(self.logit_bias)

    def resolved(self) -> "SamplingParams":
        """These parameters with a concrete seed."""
        return self if self.seed is not None else self.replace(seed=secrets.randbelow(2**32))

    def replace(self, **changes: Any) -> "SamplingParams":
        """These parameters with `changes`; None leaves a value as it is (use `unconstrained`
        to drop a grammar)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def unconstrained(self) -> "SamplingParams":
        return dataclasses.replace(self, grammar=None, logit_bias=())

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = set(data) - set(fields)
        if unknown:
            raise InvalidParameter(f"unknown sampling parameters: {', '.join(sorted(unknown))}")
        data = dict(data)
        if "logit_bias" in data:  # JSON has lists where the parameters have tuples
            try:
                data["logit_bias"] = tuple((int(t), float(b)) for t, b in data["logit_bias"])
            except (TypeError, ValueError):
                raise InvalidParameter("logit-bias must be pairs of a token id and a number") from None
        grammar = data.get("grammar")
        if isinstance(grammar, str):  # saved before grammars had kinds: GBNF
            data["grammar"] = Grammar("gbnf", grammar)
        elif isinstance(grammar, dict):
            if set(grammar) != {"kind", "text"}:
                raise InvalidParameter("grammar must have a kind and a text")
            data["grammar"] = Grammar(**grammar)
        return cls(**data)


def draw_seed(seed: int, index: int) -> int:
    """The seed of the `index`-th random draw: splitmix64 of (seed, index), 32 bits."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    return z & 0xFFFFFFFF
