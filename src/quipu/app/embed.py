"""`quipu embed`: pooled embeddings of texts, through the backend's embedding capability."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

from quipu.engine.settings import ContextSettings
from quipu.errors import BadInput, CapabilityError
from quipu.app.environment import Environment
from quipu.app.placing import placement_notices
from quipu.app.turn_options import TurnOptions, load_backend, offload

if TYPE_CHECKING:
    from quipu.engine.http import ServerSettings



def embed_texts(texts: Sequence[str], opts: TurnOptions, env: Environment, *, pooling: str = "mean",
                normalize: bool = False, on_notice: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """[{"index", "text", "embedding"}] for each text, in order; on the server the options name, if any.
    `on_notice` hears what to say of where a local model runs (fewer layers fit on the GPU)."""
    if not texts:
        raise BadInput("nothing to embed: give texts as arguments or one per line on standard input")
    empty = [i for i, text in enumerate(texts) if not text.strip()]
    if empty:
        raise BadInput(f"text {empty[0] + 1} is empty: there is nothing in it to embed")
    if opts.server is not None:
        vectors = _embed_remote(list(texts), opts, opts.server, pooling)
    else:
        vectors = _embed_local(list(texts), opts, env, pooling, on_notice)
    out = []
    for i, (text, vec) in enumerate(zip(texts, vectors, strict=False)):
        if normalize:
            norm = math.sqrt(sum(x * x for x in vec)) or 1.0
            vec = [x / norm for x in vec]
        out.append({"index": i, "text": text, "embedding": vec})
    return out


def _embed_local(texts: list[str], opts: TurnOptions, env: Environment, pooling: str,
                 on_notice: Callable[[str], None] | None) -> list[list[float]]:
    _, path = env.resolve_model(opts.model)
    # The generation context is not used here: keep it small.
    backend = load_backend(path, ContextSettings(n_ctx=256, n_threads=opts.threads or 0), opts.verbose,
                           offload(opts, env))
    try:
        for notice in placement_notices(backend, ctx_given=opts.ctx is not None, verbose=opts.verbose):
            if on_notice is not None:
                on_notice(notice)
        if not backend.supports_embeddings:
            raise CapabilityError(f"the {backend.name} backend cannot compute embeddings")
        return backend.embed(texts, pooling)
    finally:
        backend.close()


def _embed_remote(texts: list[str], opts: TurnOptions, settings: ServerSettings, pooling: str) -> list[list[float]]:
    from quipu.engine.chat_api import ChatApiModel

    if pooling != "mean" or opts.threads is not None:
        raise CapabilityError("--pooling and --threads cannot be used with a server: it pools as it was started")
    with ChatApiModel(settings) as remote:
        return remote.embed(texts)
