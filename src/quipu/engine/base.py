"""What the session layer drives: `Backend`, the protocol of a loaded model with one local
context (llama.cpp's, `llama.py`), with its sampling part (`Sampler`) and the settings of a
sampler chain; what a server's reply is made of (`Completion`). A model on llama.cpp's
llama-server driven by token arrays is `llama_server.py`'s `LlamaServerModel`; one spoken to
through the OpenAI chat API is `chat_api.py`'s `ChatApiModel`, which takes messages, not tokens."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, Sequence, TypeVar

from quipu.engine.checkpoints import Checkpoint
from quipu.engine.grammar import Grammar
from quipu.engine.kvstate import Piece
from quipu.engine.settings import ContextSettings, Placement
from quipu.engine.text import Spellings
from quipu.errors import CapabilityError
# A medium (an image, a recording) in a token history: placeholder ids no vocabulary has, a run of
# them for its positions (`engine/media.py`), and its marker in a rendering.
MEDIA_BASE = 1 << 30
MEDIA_SPAN = 1 << 16
MEDIA_MARK = re.compile("\ue002(\\d+)\ue003")

# A reply's length where none is set: it ends by itself, or where the context does (the most a C
# int holds, llama.cpp's count of tokens; a chat API is sent none).
UNTIL_IT_ENDS = 2**31 - 1


def media_mark(k: int) -> str:
    return f"\ue002{k}\ue003"


# Every marker quipu writes into a text of its own (a medium's, a messages file's medium until it
# is ready, a control token's spelling kept apart): private-use characters around a number.
_MARKER_SHAPED = re.compile("[\ue000\ue002\ue004][0-9a-f:]{1,40}[\ue001\ue003\ue005]")


def defuse(text: str) -> str:
    """Text from outside (a prompt, a file, a tool's result, a messages file) with anything shaped
    like one of quipu's markers broken (its first character made U+FFFD), so that no text can be
    taken for a medium; all else is left as it is."""
    return _MARKER_SHAPED.sub(lambda m: "\ufffd" + m.group()[1:], text)


ProgressFn = Callable[[int, int], "bool | None"]

T = TypeVar("T")


def waited(work: Callable[[], T], stopped: Callable[[], bool], said: str, timeout: float | None = None) -> T:
    """`work()`'s result, done in a thread of its own while this one waits: `stopped` (Ctrl-C,
    SIGTERM) is asked as it waits (an `Interrupted` saying `said`), and past `timeout` seconds a
    TimeoutError; either way the work is left to end with the process (or with what its caller
    closes under it). What the work raises is raised here."""
    import threading
    import time

    from quipu.errors import Interrupted

    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(work())
        except BaseException as exc:  # (handed to the waiter)
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    deadline = time.monotonic() + timeout if timeout is not None else None
    while worker.is_alive():
        worker.join(0.05)
        if worker.is_alive() and stopped():
            raise Interrupted(said)
        if worker.is_alive() and deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(said)
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    done: T = outcome[0]
    return done


# The samplers of the chain, in the order it applies them (`engine/sampler.py`), as llama.cpp
# names them (llama-server's `samplers`; logit biases and a grammar go first, as its common
# sampler applies them).
CHAIN = ("penalties", "top_k", "top_p", "min_p", "temperature")


@dataclass(frozen=True)
class SamplerSettings:
    """A native sampler chain: logit biases, penalties, then top-k, top-p, min-p, temperature, a
    seeded draw; and a grammar (a JSON Schema, GBNF, Lark or a regular expression) that every
    token of a reply must keep to."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.1
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    grammar: Grammar | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()


# processor(tokens, logits): changes `logits` (a NumPy view of the model's, no copy) in place.
LogitsProcessor = Callable[[Sequence[int], "object"], None]
# token_filter(tokens) -> the token ids allowed next (None: all of them).
TokenFilter = Callable[[Sequence[int]], "Iterable[int] | None"]


class Sink(Protocol):
    """Where a reply's text goes as it comes, and whether to stop (the session layer's ReplySink)."""

    def text(self, piece: str) -> None: ...
    def control(self, spelling: str) -> None: ...
    def stopped(self) -> bool: ...


class Sampler(Protocol):
    """A context's sampling: the chain its settings make, and the grammar a reply keeps to."""

    def set_settings(self, settings: SamplerSettings) -> None:
        """A new chain of `settings` (a bad grammar refused before anything changes)."""

    def reset(self, window: Sequence[int]) -> None:
        """Resets sampler state and replays `window` into the penalty history."""

    def accept(self, tokens: Sequence[int]) -> None: ...
    def sample(self, draw_seed: int, history: Sequence[int] = (), processors: Sequence[LogitsProcessor] = (),
               token_filter: TokenFilter | None = None) -> int:
        """Samples from the last logits with a draw seeded by `draw_seed`; accepts the token. The
        processors and the filter (given the token history) shape the logits first."""

    def set_constraint(self, grammar: "Grammar | None") -> None:
        """From the next token on, the reply keeps to `grammar` (None: the settings' own again)."""

    def constraint_reset(self, reply: Sequence[int]) -> None:
        """Starts the grammar over and replays `reply`, the tokens generated so far in this reply."""


class VocabularyPart(Protocol):
    """A model's vocabulary as a context's history spells it (a medium's tokens as its mark)."""

    @property
    def n_vocab(self) -> int: ...
    def media_tokens(self, k: int) -> list[int]:
        """The tokens of the k-th medium the context holds (`media.py`); LookupError for none."""

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]: ...
    def token_bytes(self, token: int) -> bytes: ...
    def token_text(self, token: int) -> bytes:
        """The token as a chat template spells it (control tokens written out, unlike token_bytes)."""

    def is_control(self, token: int) -> bool: ...
    def control_spellings(self, texts: Sequence[str]) -> list[str]:
        """The spellings of control tokens that `texts` hold, longest first."""

    def controls(self) -> Spellings:
        """Every control token's text, to find in a text."""

    def special_tokens(self) -> dict[str, int]:
        """{text: id} of the tokens a grammar writes as themselves, never spelled out."""

    def is_eog(self, token: int) -> bool: ...
    def max_token_bytes(self) -> int: ...
    def bos_token(self) -> int | None: ...
    def chat_template(self) -> str | None: ...
    def special_token_text(self, which: str) -> str: ...


class MediaPart(Protocol):
    """The images and recordings a context takes through a projector (`media.py`)."""

    def open_projector(self, path: Path) -> None:
        """Loads a projector (an mmproj GGUF) for this context's model."""

    def media_mark(self, data: bytes) -> str:
        """A medium's marker in a rendering, the medium made ready (a UsageError without a projector)."""

    @property
    def senses(self) -> frozenset[str]:
        """What the context takes besides text ("image", "audio")."""

    @property
    def projector_path(self) -> Path | None:
        """The projector this context loaded (None: none)."""

    def media_digests(self) -> list[str]:
        """The SHA-256 of each medium the context holds, in the order it took them."""

    def drop_media_after(self, n: int) -> list[str]:
        """Forgets the media the context took after its first `n`; their SHA-256s."""

    def place_media(self, tokens: Sequence[int]) -> None:
        """The token history a restored context holds, so that its media's positions are known
        (on an M-RoPE model a medium takes fewer positions than cells)."""


class MemoryPart(Protocol):
    """What a context holds of its history: how it goes back, its state as bytes and in pieces."""

    def step_start(self, n: int) -> int:
        """The last position at or before `n` at which `prefill` starts a batch whatever
        position it was given, or a mark of what the context holds: a context cut to it and
        read on holds what one read whole (with the same marks) does."""

    def truncate(self, n_keep: int) -> None:
        """Forgets every position from `n_keep` on. A memory that cannot go back so far goes back
        to its nearest checkpoint before, or to nothing: `positions()` then says where it is, and
        `last_rewind` says so in words."""

    def rewinds_to(self, n_keep: int) -> int:
        """How many positions `truncate(n_keep)` would keep."""

    def restore_points(self) -> list[int] | None:
        """Where a restore of this context's snapshot can be cut back to, and read on from as a
        whole read does (None: anywhere)."""

    def holds_steps(self, points: Sequence[int]) -> None:
        """The context (restored from a snapshot) holds what was read with steps ending at
        `points` (its `restore_points` then): `step_start` may return them."""

    @property
    def recurrent(self) -> bool:
        """Whether the memory holds a state that cannot go back a token (a hybrid or recurrent
        model's): its rewinds return to checkpoints, taken where a prefill's marks say."""

    @property
    def last_rewind(self) -> str | None:
        """How the last `truncate` went back, where it could not go back exactly (None: it did)."""

    def positions(self) -> int:
        """How many positions the context holds."""

    def snapshot_bytes(self) -> bytes | memoryview: ...
    def restore_bytes(self, data: bytes | memoryview) -> None: ...
    def partial_state(self, since: int | None = None) -> str | None:
        """Why the cells' state cannot be saved and restored in pieces (None: it can); with
        `since`, why not the piece of the cells from there on."""
    def state_since(self, start: int, end: int | None = None) -> bytes | memoryview:
        """The state of the cells at positions `start` on (to `end`, where the state can be
        taken as of there: a recurrent state's checkpoint); a recurrent memory's attention cells
        alone, its recurrent state kept apart (`recurrent_at`)."""
    def recurrent_at(self, n: int) -> Checkpoint:
        """The recurrent state after the first `n` tokens (its own, or its checkpoint there), to
        keep apart from the cells; EngineError for a memory without one."""
    def check_piece(self, piece: bytes | memoryview, start: int, cells: int) -> Piece:
        """What a piece of `state_since(start)` holds, checked to be `cells` cells from `start` on
        in the layout quipu reads (kvstate.py); SnapshotError where it is not."""
    def restore_pieces(self, base: bytes | memoryview, pieces: Sequence[tuple[int, bytes | memoryview]],
                       recurrent: Sequence[Checkpoint] = ()) -> None:
        """Restores a state saved whole, then pieces of it saved by `state_since`, in order; a
        recurrent memory's, then its state `recurrent[-1]` (the cells past it dropped), the
        others as checkpoints."""
    def shift_refused(self) -> str | None:
        """Why positions cannot be dropped from the middle with those after them moved down (None: they can)."""
    def shift_out(self, start: int, end: int) -> None:
        """Drops positions [start, end) and moves those after them down by end - start."""


class Backend(Protocol):
    """One loaded model with one local context, and its parts: the vocabulary, the media, the
    memory and the sampling, each an object the caller holds."""

    name: str
    build: str  # the native build; state bytes are only valid under the same one
    supports_embeddings: bool
    n_ctx: int
    n_ctx_train: int
    n_vocab: int
    context: ContextSettings
    placement: Placement  # where its layers run
    model_path: Path  # the model's file

    @property
    def vocab(self) -> VocabularyPart: ...
    @property
    def media(self) -> MediaPart: ...
    @property
    def memory(self) -> MemoryPart: ...
    @property
    def sampling(self) -> Sampler:
        """The context's sampling, a part of its own."""

    def prefill(self, tokens: Sequence[int], start: int, on_progress: ProgressFn | None = None,
                marks: Sequence[int] = ()) -> None:
        """Decodes `tokens` at positions start.., in batches; logits are kept for the last one.
        `marks`: counts of the history's tokens where a later prompt may part from this one, at
        which a step ends (`memory.step_start` may return them) and a memory that cannot go back
        a token (`memory.recurrent`) keeps a checkpoint."""

    def decode_one(self, token: int, pos: int) -> None: ...
    def reopen(self, context: ContextSettings | None = None) -> "Backend":
        """A new, independent context on the same loaded model: with the same settings, or
        `context`'s."""

    def embed(self, texts: Sequence[str | Sequence[int]], pooling: str = "mean") -> list[list[float]]:
        """One pooled vector per text, computed in batches; refuses (CapabilityError) where the
        backend or model cannot embed, never returns empty vectors."""
    def close(self) -> None: ...


def refuse_embeddings(name: str) -> CapabilityError:
    return CapabilityError(f"the {name} backend cannot compute embeddings with this model")


@dataclass(frozen=True)
class CallConstraint:
    """A grammar a server holds a reply to (GBNF, its `root` beginning with what it awaits):
    from the start, or, `lazy`, from where the reply first matches `trigger` (a regular
    expression matching the whole reply so far, whose first group is where the grammar begins)."""

    gbnf: str
    lazy: bool = False
    trigger: str = ""


@dataclass(frozen=True)
class Completion:
    """What one request generated: token ids in order (an end-of-generation token included),
    the text shown, why it ended, and the server's figures (llama-server's, driven by tokens)."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    exact: bool = True  # False: some ids could not be recovered (see the module's notes)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    first_token_s: float = 0.0
