"""The protocols the session layer drives: `Backend`, a loaded model with one local context
(llama.cpp's, `llama.py`), and `TokenServer`, a model on llama.cpp's llama-server driven by token
arrays (`llama_server.py`). A server spoken to through the OpenAI chat API is `chat_api.py`'s
`ChatApiModel`, which takes messages, not tokens."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, Sequence, TypeVar

from quipu.engine.grammar import Grammar
from quipu.engine.text import Spellings
from quipu.errors import CapabilityError, UsageError
KV_TYPES = ("f16", "q8_0")
FLASH_ATTN = ("auto", "on", "off")
# A medium (an image, a recording) in a token history: placeholder ids no vocabulary has, a run of
# them for its positions (`engine/media.py`), and its marker in a rendering.
MEDIA_BASE = 1 << 30
MEDIA_SPAN = 1 << 16
MEDIA_MARK = re.compile("\ue002(\\d+)\ue003")


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

# A context's size when none is asked for: the model's training context, at most this, as in
# llama.cpp's own programs. Each token of context is cache memory (23 KB on SmolLM2-135M, 128 KB
# on Llama 3 8B at f16), allocated and cleared before the first token.
DEFAULT_CTX_CAP = 4096
# `--ctx auto`: the longest context, up to the model's training length, that memory takes with the
# layers asked for (on the GPU, all of them where that is asked or fits); never below DEFAULT_CTX_CAP.
CTX_AUTO = -1
# The bounds llama.cpp holds without asserting: a context of a few cells cannot hold the two
# sequences quipu keeps in it (and a chat template's turn is longer), positions are 32-bit signed,
# and ggml starts at most GGML_MAX_N_THREADS threads (more crash it).
MIN_CTX = 16
MAX_CTX = 2**31 - 256
MAX_THREADS = 512


def check_context_bounds(n_ctx: int | None, n_threads: int | None, where: str = "--ctx") -> None:
    """Refuses, in one line, a context size or thread count llama.cpp would abort or crash on
    (whatever gave it: a flag, the config, the environment, a session)."""
    if n_ctx is not None and n_ctx != CTX_AUTO and not MIN_CTX <= n_ctx <= MAX_CTX:
        raise UsageError(f"{where} must be {'at least ' + str(MIN_CTX) if n_ctx < MIN_CTX else 'at most ' + str(MAX_CTX)} "
                         f"tokens, got {n_ctx}")
    if n_threads is not None and not 1 <= n_threads <= MAX_THREADS:
        raise UsageError(f"--threads must be {'more than 0' if n_threads < 1 else f'at most {MAX_THREADS}'} "
                         f"(llama.cpp's limit), got {n_threads}")


def parse_ctx(text: str | int, where: str = "--ctx") -> int:
    """A context size: a number of tokens more than 0, or auto (CTX_AUTO)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    elif isinstance(text, str) and text.strip().lower() == "auto":
        return CTX_AUTO
    elif isinstance(text, str) and text.strip().isascii() and text.strip().isdigit() and len(text.strip()) < 20:
        value = int(text)
    else:
        raise UsageError(f"{where} takes a number of tokens or auto, not '{text}'")
    if value <= 0:
        raise UsageError(f"{where} must be more than 0, got {value}")
    check_context_bounds(value, None, where)
    return value


def available_cpus() -> int:
    """The CPUs this process may run on (affinity), not the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class ContextSettings:
    """What the context (and so the state bytes) depends on, plus the thread count."""

    n_ctx: int = 0  # 0: the model's training context, capped at DEFAULT_CTX_CAP; CTX_AUTO: as memory allows
    # Tokens a prefill step takes (llama.cpp's n_batch and n_ubatch): on two cores as fast as 512
    # (faster on Gemma 3), and a prompt cache entry is restored to a multiple of it (`step_start`).
    n_batch: int = 256
    n_threads: int = 0  # 0: available_cpus()
    kv_type: str = "f16"
    n_seq: int = 1  # sequences decoded side by side (a batch); n_ctx is shared out among them
    flash_attn: str = "auto"  # auto (llama.cpp's choice), on or off
    # Set by the backend, not asked for: whether its cache stores V transposed (as llama.cpp
    # does for attention without flash attention); None where it is not known.
    v_trans: bool | None = None
    # A sliding-window model's window cache as big as the context (llama.cpp's swa_full), not a
    # ring of the window and a step (its programs' default, and quipu's).
    swa_full: bool = False
    # Set by the backend of a sliding-window model: "ring" for the window and a step, laid out as
    # an uninterrupted read leaves it (ring.py); "every cell" for a cache of every position, whose
    # state holds each cell where it lies (a state that held only the window's cells, as before,
    # restored them elsewhere: not bit for bit). None: a plain cache.
    window_cells: str | None = None

    def state_key(self) -> dict[str, Any]:
        """The settings a snapshot's state bytes are only valid under, and their layout."""
        key = {"n_ctx": self.n_ctx, "n_batch": self.n_batch, "kv_type": self.kv_type, "v_trans": self.v_trans}
        if self.window_cells is not None:
            key["window_cells"] = self.window_cells
        if self.swa_full and self.window_cells is not None:
            key["swa_full"] = True  # (asked for, and so kept by a session; an older quipu's "every cell" was not)
        return key


def saved_state_key(saved: dict[str, Any]) -> dict[str, Any]:
    """A state key as a snapshot's metadata holds it, with the layout of one written before the
    layout was recorded: quipu then turned flash attention off for an f16 cache (V transposed)
    and on for a quantized one."""
    return saved if "v_trans" in saved else {**saved, "v_trans": saved.get("kv_type") == "f16"}


def remembered_flash_attn(saved: dict[str, Any]) -> str:
    """The flash attention a session goes on with, from its saved state key: off where its cache
    was laid out without it (V transposed, so that the state is restored as it is), else
    llama.cpp's choice."""
    return "off" if saved_state_key(saved).get("v_trans") is True else "auto"


def layout_differs(saved: dict[str, Any], context: ContextSettings) -> str | None:
    """Why state bytes saved under `saved` (a state key) cannot be restored into a context with
    `context`'s layout, or None when they can be."""
    if context.window_cells is not None and saved.get("window_cells") is None:
        return "the saved context state holds only its sliding window's cells, which do not restore bit for bit"
    if saved.get("window_cells") != context.window_cells:
        return ("the saved context state was made with a sliding-window cache of every position (--swa-full), "
                "this context keeps a ring of the window" if saved.get("window_cells") == "every cell" else
                "the saved context state was made with a ring of the sliding window, this context keeps every "
                "position (--swa-full)")
    was = saved_state_key(saved).get("v_trans")
    if was == context.v_trans:
        return None

    def said(v_trans: bool | None) -> str:
        if v_trans is None:
            return "in a layout not known"
        return "without flash attention (V transposed)" if v_trans else "for flash attention (V not transposed)"

    return f"the saved context state was laid out {said(was)}, this context {said(context.v_trans)}"


AUTO, ALL = "auto", "all"


@dataclass(frozen=True)
class Offload:
    """Where the user asked a model to run: how many layers on the GPU (a count, `auto`: as many
    as fit, `all`), at most how many bytes of a device's memory, and on which devices (None:
    every GPU; none: the CPU alone)."""

    layers: int | str = AUTO
    memory: int | None = None
    devices: tuple[str, ...] | None = None
    fit_ctx: int = 0  # the context, in cells, the fit leaves room for (0: the first one opened on the model)


def parse_layers(text: str | int, where: str = "--gpu-layers") -> int | str:
    """N, auto or all, checked."""
    value = str(text).strip().lower()
    if value in (AUTO, ALL):
        return value
    if value.isascii() and value.isdigit() and len(value) < 7:
        return int(value)
    raise UsageError(f"{where} takes a number of layers, auto or all, not '{text}'")


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_size(text: str | int, where: str = "--gpu-memory") -> int:
    """A size in bytes: 512M, 6G, 6.5GiB, 1500000000 (K, M, G, T in powers of 1024)."""
    found = re.fullmatch(r"\s*([0-9]{1,15}(?:\.[0-9]{1,6})?)\s*([A-Za-z]{0,3})\s*", str(text))
    unit = found.group(2).lower() if found else ""
    if not found or unit not in _UNITS or float(found.group(1)) <= 0:
        raise UsageError(f"{where} takes a size, as 512M, 6G or 6.5GiB, not '{text}'")
    return int(float(found.group(1)) * _UNITS[unit])


def human_bytes(n: int) -> str:
    """1.5 GiB, 340.2 MiB, 12 B."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def off_device(asked: Sequence[str]) -> bool:
    """Whether --device asks for the CPU alone (none, or cpu)."""
    return [a.strip().lower() for a in asked] in (["none"], ["cpu"])


@dataclass(frozen=True)
class Share:
    """What one device holds: layers, and bytes of weights (model), cache (context) and compute."""

    device: str
    layers: int = 0
    model: int = 0
    context: int = 0
    compute: int = 0
    free: int = 0
    total: int = 0

    @property
    def needs(self) -> int:
        return self.model + self.context + self.compute

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "layers": self.layers, "model_bytes": self.model, "context_bytes": self.context,
                "compute_bytes": self.compute, "free_bytes": self.free, "total_bytes": self.total}


@dataclass(frozen=True)
class Placement:
    """Where a model runs: `gpu_layers` of its `n_layers` on `devices` (none: the CPU alone), by
    `backend`; what each device takes (`shares`, the host's last), and the line to say when fewer
    layers than asked went to the device."""

    backend: str = "CPU"
    devices: tuple[str, ...] = ()
    gpu_layers: int = 0
    n_layers: int = 0
    shares: tuple[Share, ...] = ()
    note: str | None = None
    n_ctx: int = 0  # the context it was fitted for (0: not measured)
    handles: tuple[int, ...] = field(default=(), compare=False)  # the ggml devices, in order
    split: tuple[float, ...] | None = field(default=None, compare=False)  # each device's share of the layers

    @property
    def on_device(self) -> bool:
        return self.gpu_layers > 0 and bool(self.devices)

    def summary(self) -> str:
        """'31/31 layers on Vulkan0', '12/31 layers on CUDA0, the rest on the CPU', 'the CPU'."""
        if not self.on_device:
            return "the CPU"
        where = ", ".join(self.devices)
        rest = "" if self.gpu_layers >= self.n_layers else ", the rest on the CPU"
        return f"{self.gpu_layers}/{self.n_layers} layers on {where}{rest}"

    def key(self) -> dict[str, Any]:
        """What a snapshot records of where it was made: the backend, devices and layers."""
        return {"backend": self.backend, "devices": list(self.devices), "gpu_layers": self.gpu_layers}

    def to_dict(self) -> dict[str, Any]:
        return {**self.key(), "layers": self.n_layers, "memory": [s.to_dict() for s in self.shares]}


CPU = Placement()


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


class Backend(Protocol):
    """One loaded model with one local context."""

    name: str
    build: str  # the native build; state bytes are only valid under the same one
    supports_embeddings: bool
    n_ctx: int
    n_ctx_train: int
    n_vocab: int
    context: ContextSettings
    placement: Placement  # where its layers run

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
    def media_tokens(self, k: int) -> list[int]:
        """The tokens of the k-th medium this context holds (`media.py`); LookupError for none."""

    def open_projector(self, path: Path) -> None:
        """Loads a projector (an mmproj GGUF) for this context's model (`media.py`)."""

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

    def prefill(self, tokens: Sequence[int], start: int, on_progress: ProgressFn | None = None) -> None:
        """Decodes `tokens` at positions start.., in batches; logits are kept for the last one."""

    def step_start(self, n: int) -> int:
        """The last position at or before `n` at which `prefill` starts a batch whatever
        position it was given: a context cut to it and read on holds what one read whole does."""

    def decode_one(self, token: int, pos: int) -> None: ...
    def truncate(self, n_keep: int) -> None:
        """Forgets every position from `n_keep` on."""

    def positions(self) -> int:
        """How many positions the context holds."""

    def reopen(self) -> "Backend":
        """A new, independent context with the same settings on the same loaded model."""

    def set_sampler(self, settings: SamplerSettings) -> None: ...
    def sampler_reset(self, window: Sequence[int]) -> None:
        """Resets sampler state and replays `window` into the penalty history."""

    def sampler_accept(self, tokens: Sequence[int]) -> None: ...
    def sample(self, draw_seed: int, history: Sequence[int] = (), processors: Sequence[LogitsProcessor] = (),
               token_filter: TokenFilter | None = None) -> int:
        """Samples from the last logits with a draw seeded by `draw_seed`; accepts the token. The
        processors and the filter (given the token history) shape the logits first."""

    def set_constraint(self, grammar: "Grammar | None") -> None:
        """From the next token on, the reply keeps to `grammar` (None: the settings' own again)."""

    def constraint_reset(self, reply: Sequence[int]) -> None:
        """Starts the grammar over and replays `reply`, the tokens generated so far in this reply."""

    def snapshot_bytes(self) -> bytes | memoryview: ...
    def restore_bytes(self, data: bytes | memoryview) -> None: ...

    # ---- the state in pieces, and the cells moved (where the cache allows it) -------------------
    def partial_state(self, since: int | None = None) -> str | None:
        """Why the cells' state cannot be saved and restored in pieces (None: it can); with
        `since`, why not the piece of the cells from there on."""
    def state_since(self, start: int) -> memoryview:
        """The state of the cells at positions `start` on."""
    def piece_window(self) -> int | None:
        """How many of a piece's cells its window cache holds (a ring keeps only its window's:
        kvstate.check_piece); None: all of them."""
    def restore_pieces(self, base: bytes | memoryview, pieces: Sequence[tuple[int, bytes | memoryview]]) -> None:
        """Restores a state saved whole, then pieces of it saved by `state_since`, in order."""
    @property
    def n_layer(self) -> int:
        """The model's layers (a state piece's layout has one record a layer)."""
    def shift_refused(self) -> str | None:
        """Why positions cannot be dropped from the middle with those after them moved down (None: they can)."""
    def shift_out(self, start: int, end: int) -> None:
        """Drops positions [start, end) and moves those after them down by end - start."""

    def embed(self, texts: Sequence[str], pooling: str = "mean") -> list[list[float]]:
        """One pooled vector per text, computed in batches; refuses (CapabilityError) where the
        backend or model cannot embed, never returns empty vectors."""
    def close(self) -> None: ...


class RowChain(Protocol):
    """One batch row's sampler chain."""

    def accept(self, tokens: Sequence[int]) -> None: ...
    def free(self) -> None: ...


class RowMatcher(Protocol):
    """One batch row's place in its grammar."""

    def accept(self, token: int) -> None: ...


class BatchBackend(Backend, Protocol):
    """A context of several sequences, decoded side by side (a batch's rows)."""

    n_ctx_seq: int

    def decode_batch(self, items: Sequence[tuple[int, int, int, bool]]) -> None:
        """Decodes (token, position, sequence, wants logits) items in one step."""
    def seq_keep(self, seq: int, n_keep: int) -> None: ...
    def seq_copy(self, src: int, dst: int) -> None: ...
    def row_sampler(self, settings: SamplerSettings) -> RowChain: ...
    def row_matcher(self, settings: SamplerSettings) -> RowMatcher | None: ...
    def sample_rows(self, rows: Sequence[tuple[RowChain, RowMatcher | None, int, int]]) -> list[int]:
        """One token for each (chain, matcher, draw seed, batch index) of a step."""


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


@dataclass
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


class TokenServer(Protocol):
    """A model on a server that is driven by tokens (llama.cpp's llama-server): the context is
    the token array each request sends, and the server keeps what it can of it in a slot."""

    name: str
    n_ctx: int

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]: ...
    def detokenize(self, tokens: Sequence[int]) -> str:
        """The tokens' text, control tokens written out."""

    def spell(self, token: int) -> str: ...
    def bos_token(self) -> int | None: ...
    def chat_template(self) -> str | None: ...
    def special_token_text(self, which: str) -> str: ...
    def media_tokens(self, k: int) -> list[int]:
        """LookupError: media reach llama-server otherwise than by tokens."""

    def control_spellings(self, texts: Sequence[str]) -> list[str]:
        """The control tokens `texts` spell, which a user's text must keep as text."""

    def special_token(self, text: str) -> int | None:
        """The id of the one special token `text` spells (None: it spells none)."""

    def complete(self, prompt: Sequence[int | str], sampler: SamplerSettings, seed: int, max_tokens: int,
                 stop: Sequence[str] = (), slot: int = -1, sink: Sink | None = None,
                 constraint: CallConstraint | None = None) -> Completion:
        """Streams what follows `prompt` (token ids, then maybe text the server tokenizes with
        special tokens parsed) into `sink` (its `text(piece)` and `stopped()`), under `constraint`
        where there is one (a tool call's grammar, from its trigger on): a `Completion`
        (the generated token ids, the text shown, why it ended, the prompt's token count, the
        server's figures). A failure mid-reply raises an error whose `partial` is the completion
        so far."""
