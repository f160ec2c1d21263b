"""The constraint engine: llguidance, which computes the set of tokens a grammar allows next
(a bit mask over the vocabulary, in tens of microseconds) for JSON Schema, Lark, regular
expressions and GBNF (turned into Lark by llguidance's own converter).

The mask is applied to llama.cpp's logits in place, before its native sampler chain draws, so
sampling stays what it is without a grammar: the same chain, the same seeded draw, among the
allowed tokens. Imported only when a reply is constrained.

Compared with llama.cpp's own grammar sampler (what quipu used before): that sampler re-checks
candidates one by one against its stacks and, when the drawn token is rejected, the whole
vocabulary; llguidance walks the tokenizer's trie once per step with a lexer of derivatives and
an Earley parser, and covers JSON Schema far more faithfully (ranges, formats, patterns, $defs).
"""

from __future__ import annotations

import ctypes
import functools
import json
import re
from typing import TYPE_CHECKING, Sequence

import llguidance
import numpy as np
import numpy.typing as npt

from quipu.engine.grammar import Grammar, MAX_GRAMMAR_DEPTH, check_grammar_depth, grammar_depth, subschemas
from quipu.errors import EngineError, InvalidParameter

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

    from quipu.engine.model import LlamaModel

Mask = npt.NDArray[np.int32]  # one bit a token, llguidance's layout
Logits = npt.NDArray[np.float32]

# Between JSON's tokens: nothing, a space, or a new line and some indentation, as the model
# prefers; never a long run of blanks, which a small model can fall into and not leave.
WHITESPACE = r"[ ]?|\n(?:[ ]{0,32}|\t{0,8})"
JSON_OPTIONS: JsonCompileOptions = {"whitespace_pattern": WHITESPACE}
# Formats whose text has a natural bound that llguidance's own patterns leave open, held to it
# (a small model at a high temperature otherwise writes digits without end): the fraction of a
# second to nine digits, a nanosecond, the finest any clock keeps (`time`, `date-time`), and each
# number of a `duration` to nine digits; an `email` to 254 characters, a `hostname` to 253 (the
# limits of RFC 5321's path and of RFC 1035's names). Dates are held to the days their month has
# (February 29 in leap years only), which llguidance's pattern does not know, and to the years
# 0001-9999, and times to the seconds 00-59: stricter than RFC 3339 (year 0000, a leap second),
# as the validators most programs use are (Python's `datetime`). `uuid`, `ipv4` and `ipv6` are
# fixed groups in llguidance's patterns already. A hostname's last label begins with a letter, as
# RFC 1123 says the highest-level one is alphabetic (so that no hostname reads as an address).
_ZONE = r"(?:[zZ]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,9})?" + _ZONE
_YEAR = r"(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_MONTH_DAY = r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))"
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = f"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_N = "[0-9]{1,9}"
_DUR_TIME = f"T(?:{_N}H(?:{_N}M(?:{_N}S)?)?|{_N}M(?:{_N}S)?|{_N}S)"  # RFC 3339, appendix A
_DUR_DATE = f"(?:{_N}D|{_N}M(?:{_N}D)?|{_N}Y(?:{_N}M(?:{_N}D)?)?)(?:{_DUR_TIME})?"
_LABEL = "[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?"
BOUNDED_FORMATS = {"date": _DATE, "time": _TIME, "date-time": f"{_DATE}[tT]{_TIME}",
                   "duration": f"P(?:{_DUR_DATE}|{_DUR_TIME}|{_N}W)",
                   "hostname": f"(?:{_LABEL}\\.)*[a-zA-Z](?:[a-zA-Z0-9-]{{0,61}}[a-zA-Z0-9])?"}
# The longest text of each format held to a bound (a maxLength beside its pattern, or beside the
# schema's own pattern).
FORMAT_LENGTHS = {"date": 10, "time": 24, "date-time": 35, "duration": 62, "email": 254, "hostname": 253}


def bounded_formats(schema_text: str) -> str:
    """A JSON Schema's text with each format that has a natural bound held to it: the format's
    bounded pattern in its place (unless the schema gives a pattern of its own), and its longest
    length as a maxLength (a smaller one given kept)."""
    schema = json.loads(schema_text)
    changed = False
    for _, sub in subschemas(schema):
        fmt = sub.get("format")
        if not isinstance(fmt, str) or fmt not in FORMAT_LENGTHS:
            continue
        changed = True
        if fmt in BOUNDED_FORMATS and "pattern" not in sub:
            del sub["format"]
            sub["pattern"] = f"^{BOUNDED_FORMATS[fmt]}$"  # (a pattern matches anywhere in the text unless anchored)
        given = sub.get("maxLength")
        bound = FORMAT_LENGTHS[fmt]
        sub["maxLength"] = min(given, bound) if isinstance(given, int) and not isinstance(given, bool) else bound
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False) if changed else schema_text


# What one grammar may cost: llguidance's own limits, which end a step in an error, not a hang.
LIMITS = {"max_grammar_size": 500_000, "step_max_items": 50_000}


@functools.lru_cache(maxsize=64)
def compile_grammar(grammar: Grammar) -> str:
    """llguidance's form of `grammar`, checked: an invalid grammar is one line naming its place."""
    try:
        return _compiled(grammar)
    except ValueError as exc:  # (what llguidance's converters raise on a text they cannot read)
        if grammar.kind == "json_schema" and ("Infinity" in grammar.text or "NaN" in grammar.text):
            raise InvalidParameter(f"the {grammar.what} is invalid: it holds a number JSON cannot write "
                                   "(Infinity or NaN)") from None
        raise InvalidParameter(f"the {grammar.what} is invalid: {one_line(str(exc))}") from None


def _compiled(grammar: Grammar) -> str:
    if grammar.kind == "json_schema":
        source = llguidance.LLMatcher.grammar_from_json_schema(bounded_formats(grammar.text), defaults=JSON_OPTIONS)
    elif grammar.kind == "regex":
        source = llguidance.LLMatcher.grammar_from_regex(grammar.text)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, None, limits=_limits())
        if failed:  # (said of the grammar llguidance wraps it in: where it stands there means nothing here)
            said = one_line(messages[0] if messages else "")
            raise InvalidParameter(f"the regular expression is invalid: {said.split('(in regex): ')[-1]}")
    elif grammar.kind == "lark":
        if grammar_depth(grammar.text) > MAX_GRAMMAR_DEPTH:
            raise InvalidParameter(f"the grammar is invalid: its groups nest deeper than {MAX_GRAMMAR_DEPTH} levels")
        source = llguidance.LLMatcher.grammar_from_lark(grammar.text)
    else:
        source = llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(grammar.text))
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, None, limits=_limits())
    if failed:
        where = _failing_place(grammar.text) if grammar.kind == "json_schema" else ""
        raise InvalidParameter(f"the {grammar.what} is invalid{where}: {one_line(messages[0] if messages else '')}")
    return source


def _failing_place(text: str) -> str:
    """' at /place' for the first pattern or format of a schema that llguidance cannot read
    alone ('' when none is: the failure is the schema's as a whole)."""
    for where, sub in subschemas(json.loads(text)):
        for key in ("pattern", "format"):
            if isinstance(sub.get(key), str):
                alone = llguidance.LLMatcher.grammar_from_json_schema({"type": "string", key: sub[key]})
                if llguidance.LLMatcher.validate_grammar_with_warnings(alone)[0]:
                    return f" ({key} at {where})"
    return ""


def gbnf_to_lark(gbnf: str) -> str:
    """GBNF as Lark, by llguidance's converter; its errors name the line."""
    from llguidance.gbnf_to_lark import any_to_lark

    check_grammar_depth(gbnf)
    try:
        return any_to_lark(gbnf)
    except RecursionError:
        raise InvalidParameter("the GBNF grammar is invalid: it nests too deep") from None
    except Exception as exc:  # the converter raises plain exceptions for what it cannot read
        raise InvalidParameter(f"the GBNF grammar is invalid: {one_line(str(exc))}") from None


def one_line(message: str) -> str:
    """llguidance's message on one line: its first line (with 'line N' for its `L(C):` places)
    and the line that says what is wrong, where the first only says where."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    first = lines[0] if lines else "llguidance cannot read it"
    first = re.sub(r"^(?:at )?(\d+)\((\d+)\):\s*", lambda m: f"line {m.group(1)}, column {m.group(2)}: ", first)
    first = re.sub(r" at (\d+)\((\d+)\)", lambda m: f" at line {m.group(1)}, column {m.group(2)}", first)
    said = next((line for line in lines[1:] if line.startswith("error:")), None)
    if said:
        first = f"{first.rstrip(':')}: {said[len('error:'):].strip()}"
    return first[:300]


def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(max_grammar_size=LIMITS["max_grammar_size"],
                                     step_max_items=LIMITS["step_max_items"], verbose_errors=False)


def tokenizer(model: "LlamaModel") -> "llguidance.LLTokenizer":
    """llguidance's view of a loaded model's vocabulary (kept by the model: building it reads
    every token once)."""
    made: llguidance.LLTokenizer = model.guidance(_tokenizer)
    return made


def _tokenizer(model: "LlamaModel") -> "llguidance.LLTokenizer":
    """Control tokens are marked as special, so that no grammar spells them; every
    end-of-generation token ends a reply the grammar has completed."""
    from quipu.engine.native import lc

    vocab = model.vocab
    buf = ctypes.create_string_buffer(1024)
    pieces: list[bytes] = []
    special = lc.LLAMA_TOKEN_ATTR_CONTROL
    attrs = model.token_attrs()
    for token in range(model.n_vocab):
        n = lc.llama_token_to_piece(vocab, token, buf, len(buf), 0, True)
        if n < 0:
            big = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(vocab, token, big, len(big), 0, True)
            piece = big.raw[:n]
        else:
            piece = buf.raw[:n]
        attr = attrs[token]
        if attr & special or (attr & lc.LLAMA_TOKEN_ATTR_USER_DEFINED and piece.startswith(b"<")
                              and piece.endswith(b">")):
            piece = b"\xff" + piece
        pieces.append(piece)
    ends = [t for t in range(model.n_vocab) if lc.llama_vocab_is_eog(vocab, t)]
    if not ends:
        ends = [max(0, lc.llama_vocab_eos(vocab))]
    # (llguidance's stub lacks `from_llamacpp`; its own llamacpp module ignores that too)
    made: llguidance.LLTokenizer = llguidance.LLTokenizer.from_llamacpp(  # type: ignore[attr-defined]
        tokens=pieces, vocab_ptr=vocab, tokenize_fptr=ctypes.cast(lc._lib.llama_tokenize, ctypes.c_void_p).value,
        eos_token=ends, slices=None)
    return made


class Matcher:
    """One reply's place in a grammar: the tokens it allows next, and the tokens it accepted."""

    def __init__(self, model: LlamaModel, grammar: Grammar, compiled: str | None = None):
        self.n_vocab = model.n_vocab
        self._matcher = llguidance.LLMatcher(tokenizer(model), compiled or compile_grammar(grammar), log_level=0,
                                             limits=_limits())
        if self._matcher.is_error():
            raise InvalidParameter(f"the {grammar.what} is invalid: {one_line(self._matcher.get_error())}")
        # (llguidance's reset after the grammar ended at an end-of-generation token starts from
        # the wrong place: a new reply starts from a copy of the matcher as it was made)
        self._start = self._matcher.deep_copy()
        self._what = grammar.what
        self._taken = 0  # tokens of this reply the matcher has taken
        self.mask = np.empty(((self.n_vocab + 31) // 32,), dtype=np.int32)

    def fill(self, mask: Mask | None = None) -> None:
        """Computes the allowed tokens into `mask` (this matcher's own by default)."""
        target = self.mask if mask is None else mask
        self._matcher.unsafe_compute_mask_ptr(target.ctypes.data, target.size * 4)
        if self._matcher.is_error() and self._taken == 0:
            # (no reply at all keeps to it: the grammar's fault, not the engine's)
            raise InvalidParameter(f"the {self._what} allows no reply: {one_line(self._matcher.get_error())}")
        self._check()


    def allowed(self) -> npt.NDArray[np.bool_]:
        """The mask as one boolean a token."""
        return mask_bits(self.mask, self.n_vocab)

    def apply(self, logits: Logits) -> None:
        """Computes the mask and rules out, in `logits` (in place), every token it does not allow."""
        self.fill()
        apply_mask(logits, self.mask, self.n_vocab)

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            self._check()
            raise EngineError(f"the grammar does not allow token {token} here")
        self._taken += 1

    def replay(self, tokens: Sequence[int]) -> None:
        """Starts over and accepts `tokens`; refuses (InvalidParameter) tokens the grammar does not allow."""
        self._matcher = self._start.deep_copy()
        self._taken = len(tokens)
        if tokens and self._matcher.validate_tokens(list(tokens)) != len(tokens):
            raise InvalidParameter("the reply so far does not keep to the grammar; generate it anew instead")
        if tokens:
            self._matcher.consume_tokens(list(tokens))
        self._check()

    def _check(self) -> None:
        if self._matcher.is_error():
            raise EngineError(f"the grammar engine stopped: {one_line(self._matcher.get_error())}")

    @property
    def inner(self) -> llguidance.LLMatcher:
        return self._matcher


def mask_bits(mask: Mask, n_vocab: int) -> npt.NDArray[np.bool_]:
    """A bit mask (one bit a token, llguidance's layout) as one boolean a token."""
    return np.unpackbits(mask.view(np.uint8), bitorder="little", count=n_vocab).view(bool)


def apply_mask(logits: Logits, mask: Mask, n_vocab: int) -> None:
    """-inf in `logits` wherever the bit mask is 0."""
    np.copyto(logits, -np.inf, where=~mask_bits(mask, n_vocab))


class MaskBatch:
    """The masks of several matchers computed together (llguidance's executor, on threads),
    for the rows of a batch in one decoding step."""

    def __init__(self, n_vocab: int, rows: int):
        self.n_vocab = n_vocab
        self.masks = np.empty((rows, (n_vocab + 31) // 32), dtype=np.int32)
        self._executor = llguidance.LLExecutor()

    def fill(self, matchers: Sequence[tuple[Matcher, int]]) -> None:
        if not matchers:
            return
        self._executor.unsafe_compute_mask_ptr([(m.inner, i) for m, i in matchers], self.masks.ctypes.data,
                                               self.masks.shape[1] * 4, self.masks.shape[0])
        for matcher, _ in matchers:
            matcher._check()

    def apply(self, logits: Logits, row: int) -> None:
        apply_mask(logits, self.masks[row], self.n_vocab)


def describe(grammar: Grammar) -> str:
    """What `--verbose` says constrains a reply."""
    return f"llguidance {llguidance.__version__} enforces the {grammar.what}"
