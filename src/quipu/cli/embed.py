"""`quipu embed`: one JSON object per line for each text."""

from __future__ import annotations

import json
from typing import Annotated, List, Optional

import typer

from quipu.cli import options as opt, spec
from quipu.cli.terminal import Terminal


def register(app: typer.Typer) -> None:
    app.command("embed", help="Embeddings of each TEXT, or of each line of standard input, as JSON lines.")(embed)


def embed(
    context: typer.Context,
    texts: List[str] = typer.Argument(None, help="Texts to embed (default: each line of standard input)."),
    model: Annotated[Optional[str], opt.typer_option(spec.OPTS["model"])] = None,
    pooling: str = typer.Option("mean", "--pooling", help="mean, last or cls."),
    normalize: bool = typer.Option(False, "--normalize", help="Scale each vector to length 1."),
    threads: Annotated[Optional[int], opt.typer_option(spec.OPTS["threads"])] = None,
    gpu_layers: Annotated[Optional[str], opt.typer_option(spec.OPTS["gpu_layers"])] = None,
    gpu_memory: Annotated[Optional[str], opt.typer_option(spec.OPTS["gpu_memory"])] = None,
    device: Annotated[Optional[str], opt.typer_option(spec.OPTS["device"])] = None,
    verbose: Annotated[bool, opt.typer_option(spec.OPTS["verbose"])] = False,
    url: Annotated[Optional[str], opt.typer_option(spec.OPTS["url"])] = None,
) -> None:
    from quipu.cli.terminal import gather_prompt
    from quipu.app.embed import embed_texts

    term = Terminal.detect()
    if not texts:
        piped = gather_prompt(None, term, allow_empty=True)
        from quipu.app.batch import input_lines

        texts = [line for line in input_lines(piped or "") if line.strip()]
    env = context.obj
    opts = spec.turn_options({"model": model, "threads": threads, "verbose": verbose, "url": url,
                              "gpu_layers": gpu_layers, "gpu_memory": gpu_memory, "device": device}, env)
    for row in embed_texts(texts, opts, env, pooling=pooling, normalize=normalize, on_notice=term.warn):
        vector = ",".join(f"{x:.8g}" for x in row["embedding"])
        head = json.dumps({"index": row["index"], "text": row["text"]}, ensure_ascii=False)[:-1]
        term.out(f'{head}, "embedding": [{vector}]}}\n')
