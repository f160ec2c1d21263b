"""`quipu run`: one prompt, one reply, streamed; clean enough for pipelines."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from quipu.cli.terminal import PrefillProgress, StopOnCtrlC, Terminal
from quipu.errors import BadInput, ExitCode

MAX_STDIN_BYTES = 64 * 1024 * 1024


def register(app: typer.Typer) -> None:
    app.command(
        "run",
        help="Answer one prompt, given as an argument and/or on standard input.",
        no_args_is_help=False,
    )(run)


def run(
    prompt: Optional[str] = typer.Argument(None, help="The prompt. Piped stdin is appended after a blank line."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="A .gguf file or a known model name."),
    system: Optional[str] = typer.Option(None, "--system", "-s", help="System prompt."),
    raw: bool = typer.Option(False, "--raw", help="Plain completion, without the chat template."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", "-n", help="Most tokens to generate [512]."),
    temperature: Optional[float] = typer.Option(None, "--temperature", "-t", help="0 is greedy [0.8]."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Keep the k likeliest tokens; 0 is off [40]."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Nucleus sampling, in (0, 1] [0.95]."),
    min_p: Optional[float] = typer.Option(None, "--min-p", help="Drop tokens below this share of the top one [0.05]."),
    repeat_penalty: Optional[float] = typer.Option(None, "--repeat-penalty", help="1 is off [1.1]."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed [random, reported by --json]."),
    stop: List[str] = typer.Option([], "--stop", help="Stop at this text (repeatable); it is not printed."),
    ctx: Optional[int] = typer.Option(None, "--ctx", help="Context size in tokens [the model's, at most 8192]."),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads [the CPUs this process may use]."),
    kv_type: Optional[str] = typer.Option(None, "--kv-type", help="KV cache type: f16 or q8_0 (half-size snapshots)."),
    session: Optional[str] = typer.Option(None, "--session", "-S", help="Continue or create this named session."),
    continue_reply: bool = typer.Option(False, "--continue", help="With --session and no prompt: keep generating the last reply."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming."),
    stats: bool = typer.Option(False, "--stats", help="Print timings and token counts on stderr."),
    verbose: bool = typer.Option(False, "--verbose", help="Show llama.cpp's own log on stderr."),
) -> int:
    from quipu.sessions.runner import Environment, TurnOptions, run_turn

    term = Terminal.detect()
    text = gather_prompt(prompt, term, allow_empty=continue_reply)
    opts = TurnOptions(
        model=model, system=system, raw=raw, temperature=temperature, top_k=top_k, top_p=top_p,
        min_p=min_p, repeat_penalty=repeat_penalty, seed=seed, max_tokens=max_tokens, stop=tuple(stop),
        ctx=ctx, threads=threads, kv_type=kv_type, session=session, continue_reply=continue_reply,
        verbose=verbose,
    )
    env = Environment.load()
    progress = PrefillProgress(term)
    wrote = []

    def on_text(piece: str) -> None:
        if not as_json:
            term.stdout.write(piece)
            term.stdout.flush()
            wrote.append(piece[-1:])

    try:
        with StopOnCtrlC() as stopper:
            result = run_turn(text, opts, env, on_text=on_text, on_progress=progress, should_stop=stopper)
    finally:
        progress.close()
    for notice in result.notices:
        term.warn(notice)
    if as_json:
        term.stdout.write(json.dumps(result.to_json(), ensure_ascii=False) + "\n")
    elif wrote and wrote[-1] != "\n" or not wrote:
        term.stdout.write("\n")
    term.stdout.flush()
    if stats:
        term.stderr.write(stats_line(result) + "\n")
    return ExitCode.INTERRUPTED if result.finish_reason == "interrupted" else ExitCode.OK


def stats_line(result) -> str:
    s = result.stats
    return (
        f"{s.prompt_tokens} prompt tokens ({s.cached_tokens} cached), {s.completion_tokens} generated, "
        f"finish {result.finish_reason}; load {s.load_s:.2f}s, restore {s.restore_s:.2f}s, "
        f"prefill {s.prefill_s:.2f}s ({s.prefill_tok_s:.0f} tok/s), decode {s.decode_s:.2f}s "
        f"({s.decode_tok_s:.1f} tok/s), first token {s.ttft_s:.2f}s; seed {result.seed}"
    )


def gather_prompt(prompt: str | None, term: Terminal, *, allow_empty: bool = False) -> str | None:
    """The argument, then a blank line, then piped stdin; binary stdin is refused."""
    piped = None
    if not term.stdin_tty and term.stdin is not None:
        try:
            data = term.stdin.buffer.read(MAX_STDIN_BYTES + 1)
        except (OSError, ValueError, AttributeError):
            data = b""
        if len(data) > MAX_STDIN_BYTES:
            raise BadInput(f"standard input is larger than {MAX_STDIN_BYTES // (1024 * 1024)} MB")
        if b"\x00" in data:
            raise BadInput("standard input is binary data, not text")
        try:
            piped = data.decode("utf-8")
        except UnicodeDecodeError:
            piped = data.decode("utf-8", errors="replace")
            term.warn("standard input is not valid UTF-8; undecodable bytes were replaced")
        piped = piped.rstrip("\n") or None
    parts = [p for p in (prompt, piped) if p]
    if not parts:
        if allow_empty:
            return None
        raise BadInput("no prompt: give one as an argument or pipe it on standard input")
    return "\n\n".join(parts)
