"""The prompt cache, as a local session uses it: a new prompt restores the longest beginning it
shares with earlier ones (`cache_lookup`), and its state with its answer's is kept after the
answer is out (`cache_save`). The entries themselves are `store/cache.py`'s; an image in a prompt is keyed by
its SHA-256 (`canonical`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from quipu.app.environment import Environment
from quipu.engine.base import MEDIA_BASE, MEDIA_SPAN, MemoryPart
from quipu.engine.kvstate import cells_from, joined
from quipu.errors import EngineError, SnapshotError
from quipu.sessions.inference import InferenceSession
from quipu.store.cache import MAX_CHAIN, MIN_TOKENS, CacheEntries, Parent


@dataclass
class CacheUse:
    cache: CacheEntries
    key: dict[str, Any]
    tokens: list[int]  # as the cache keeps them (`canonical`)
    reused: int
    made_by: Callable[[Path], str]  # a projector's fingerprint (`cache_digests`)
    held: int = 0  # how much of the prompt the cache held (reused: to where a prefill step starts)
    written: int = 0  # how many of the prompt's tokens the state written to the cache holds anew (`cache_save`)


def cache_key(session: InferenceSession, model_fp: str) -> dict[str, Any]:
    """What a cache entry's state bytes are valid under: the model (`model_fp`, its fingerprint),
    the native build, the context."""
    backend = session.backend
    # ("steps": a prompt's reading ends a step at each of its marks, where a later prompt may part
    # from it: entries read otherwise are not read on from as a whole read is now)
    return {"fingerprint": model_fp, "build": backend.build, "context": backend.context.state_key(),
            "steps": "marks"}


def open_cache(env: Environment, no_cache: bool) -> CacheEntries | None:
    """The prompt cache a run uses (None with --no-cache)."""
    return None if no_cache else CacheEntries(env.dirs.prompt_cache, env.cache_max_bytes)


# A medium's positions in a cache entry: its SHA-256 and its place in its run (`canonical`).
CANON_BASE = 1 << 40


def cache_digests(session: InferenceSession, made_by: Callable[[Path], str]) -> list[str]:
    """What names each medium of the context in the cache: its SHA-256 with the projector's
    fingerprint (`made_by` its file's), since what an image becomes is the projector's doing."""
    import hashlib

    backend = session.backend
    digests = backend.media.media_digests()
    if not digests or backend.media.projector_path is None:
        return digests
    projector = made_by(backend.media.projector_path)
    return [hashlib.sha256(f"{d}:{projector}".encode()).hexdigest() for d in digests]


def canonical(tokens: Sequence[int], digests: Sequence[str]) -> list[int]:
    """Tokens as the cache keeps them: a medium's placeholders (which name it by its place in
    this context, `engine/media.py`) as ids made of its SHA-256, the same in every process."""
    out = []
    for t in tokens:
        if t >= MEDIA_BASE:
            k, i = divmod(t - MEDIA_BASE, MEDIA_SPAN)
            t = CANON_BASE + int(digests[k], 16) * MEDIA_SPAN + i
        out.append(t)
    return out


def local(tokens: Sequence[int], digests: Sequence[str]) -> list[int]:
    """A cache entry's tokens as this context names them (`canonical` undone); a medium this
    context does not hold, which can only be past what is kept of the entry, as 0."""
    places = {int(d, 16): k for k, d in enumerate(digests)}
    out = []
    for t in tokens:
        if t >= CANON_BASE:
            digest, i = divmod(t - CANON_BASE, MEDIA_SPAN)
            t = MEDIA_BASE + places[digest] * MEDIA_SPAN + i if digest in places else 0
        out.append(t)
    return out


def whole_media(tokens: Sequence[int], keep: int) -> int:
    """`keep`, moved back to where a medium's run starts when it falls inside one: a medium is
    read in whole."""
    while 0 < keep < len(tokens) and tokens[keep] >= CANON_BASE and (tokens[keep] - CANON_BASE) % MEDIA_SPAN:
        keep -= 1
    return keep


def cache_lookup(session: InferenceSession, tokens: list[int], model_fp: str, cache: CacheEntries,
                 made_by: Callable[[Path], str]) -> CacheUse:
    """Restores the longest cached beginning of `tokens` into the session, if any."""
    key = cache_key(session, model_fp)
    digests = cache_digests(session, made_by)
    tokens = canonical(tokens, digests)
    hit = cache.lookup(key, tokens)
    reused = 0
    keep = whole_media(tokens, restore_to(session, hit.reuse, hit.stops is not None, len(tokens))) if hit else 0
    if hit is not None and keep > 0:
        try:
            state = hit.state
            for start, piece in hit.pieces:  # (an entry that goes on from others: their cells, then its own)
                state = joined(state, start, piece)
            reused = session.restore_prefix(state, local(hit.tokens, digests), keep, hit.stops or ())
        except (EngineError, SnapshotError) as exc:
            cache.drop(hit.path, str(exc))
    return CacheUse(cache, key, tokens, reused, made_by, hit.reuse if hit is not None else 0)


def cached_count(session: InferenceSession, tokens: list[int], model_fp: str, cache: CacheEntries,
                 made_by: Callable[[Path], str]) -> int:
    """How many of `tokens` a run would restore from the prompt cache (`--show-prompt`)."""
    tokens = canonical(tokens, cache_digests(session, made_by))
    found, stopped = cache.peek(cache_key(session, model_fp), tokens)
    return whole_media(tokens, restore_to(session, found, stopped, len(tokens))) if found else 0


def restore_to(session: InferenceSession, reuse: int, stopped: bool, n_tokens: int) -> int:
    """How much of a prompt of `n_tokens` an entry sharing `reuse` of it restores: the last token
    is read again, for its logits; the rest from where a step of the prefill starts, so that the
    tokens read compute as they would in a run without the cache. An entry that says where its
    state may be cut back to (`stopped`) gave one already."""
    return reuse if stopped else session.backend.memory.step_start(min(reuse, n_tokens - 1))


def cache_save(session: InferenceSession, use: CacheUse) -> None:
    """Keeps the state of the prompt and its answer (a follow-up to it, `run -F`, then reads only
    its new message), unless the cache had nearly all of it already: questions after one long
    beginning, with short answers, share one entry."""
    prompt = use.tokens
    held = session.n_decoded  # (all but the answer's last token)
    if held < len(prompt) or held - max(use.reused, use.held) < MIN_TOKENS \
            or session.backend.memory.step_start(held - 1) == 0:  # (a context no restore could use)
        return
    tokens = canonical(session.tokens[:held], cache_digests(session, use.made_by))
    if tokens[:len(prompt)] != prompt:  # (the context went back inside the prompt: a tool loop's turns)
        return
    memory = session.backend.memory
    try:
        state, stops = memory.snapshot_bytes(), memory.restore_points()
        parent, start, piece = piece_of(use.cache, use.key, tokens, state, memory)
        if use.cache.save(use.key, tokens, piece if piece is not None else state, stops, parent, start) is not None:
            use.written = max(0, len(prompt) - max(start, use.reused))
    except (EngineError, OSError):
        pass  # a cache never fails a run


def piece_of(cache: CacheEntries, key: dict[str, Any], tokens: list[int], state: bytes | memoryview,
             memory: MemoryPart) -> tuple[Parent | None, int, bytes | None]:
    """Where a new entry of `tokens` (its context's state `state`) may go on from an earlier one:
    the entry sharing its longest beginning, the position from which the new one holds its own
    cells (where a step of a whole read starts, at or before what they share, so that the cells
    before it are the ones a whole read makes, whichever run made them), and those cells; (None,
    0, None) where the entry is kept whole: nothing shared to go on from, a memory whose state
    is not one plain cache (a sliding window's, a recurrent model's), media in it, a chain long
    enough."""
    if any(t >= CANON_BASE for t in tokens):  # (a medium's cells: their positions are not the tokens')
        return None, 0, None
    parent = cache.parent_for(key, tokens)
    if parent is None or parent.depth >= MAX_CHAIN - 1:
        return None, 0, None
    start = memory.step_start(min(parent.shared, len(tokens) - 1))
    if parent.stops is not None:
        start = max([s for s in parent.stops if s <= start] + [0])
    if start < MIN_TOKENS:
        return None, 0, None
    piece = cells_from(state, start)
    return (parent, start, piece) if piece is not None else (None, 0, None)


class PromptCache:
    """The prompt cache as one session uses it (`cache` None: --no-cache; `fingerprint`: the
    model's, which keys its entries; `made_by`: a projector file's fingerprint; `verbose`: what
    went wrong with an entry is said)."""

    def __init__(self, cache: CacheEntries | None, fingerprint: str, made_by: Callable[[Path], str], *,
                 verbose: bool = False):
        self.cache = cache
        self.model_fingerprint = fingerprint
        self.made_by = made_by
        self.verbose = verbose

    def warm(self, session: InferenceSession, tokens: Callable[[], list[int]]) -> CacheUse | None:
        """A new context's first prompt begins, perhaps, as earlier runs' did (a long system
        prompt): the cached beginning is restored, and the turn reads only the rest. Where the
        context still holds an earlier prompt on it (a server's last request), the beginning it
        shares with that is kept instead, where it is the longer: memory, then disk."""
        if session.n_decoded:
            return None
        if not session.holds_earlier:
            return cache_lookup(session, tokens(), self.model_fingerprint, self.cache, self.made_by) if self.cache else None
        wanted = tokens()
        on_disk = cached_count(session, wanted, self.model_fingerprint, self.cache, self.made_by) if self.cache else 0
        kept = session.take_held(wanted, at_least=on_disk)
        if self.cache is None:
            return None
        if not kept:
            return cache_lookup(session, wanted, self.model_fingerprint, self.cache, self.made_by)
        key = cache_key(session, self.model_fingerprint)
        return CacheUse(self.cache, key, canonical(wanted, cache_digests(session, self.made_by)), kept,
                        self.made_by, kept)

    def remember(self, session: InferenceSession, use: CacheUse | None) -> list[str]:
        """After a one-shot answer is out: the prompt's state joins the cache."""
        if use is None:
            return []
        cache_save(session, use)
        if not self.verbose:
            return []  # a damaged entry is dropped quietly, said when asked
        return use.cache.notes + ([f"prompt cache: the context {session.went_back}"] if session.went_back else [])

    def cached(self, session: InferenceSession, tokens: list[int]) -> int:
        """How many of `tokens` the prompt cache would restore (`--show-prompt`)."""
        if self.cache is None:
            return 0
        return cached_count(session, tokens, self.model_fingerprint, self.cache, self.made_by)
