"""`quipu run`: one prompt, one reply, streamed; clean enough for pipelines."""

from __future__ import annotations

import json

from quipu.cli import spec
from quipu.cli.terminal import PrefillProgress, StopOnCtrlC, Terminal
from quipu.errors import BadInput, ExitCode, UsageError

MAX_STDIN_BYTES = 64 * 1024 * 1024

HELP = "Answer one prompt, given as an argument and/or on standard input."

# The parameters of `quipu run`, in order: Typer builds the command from this table, and
# `spec.parse` reads a plain command line from it without Typer.
PARAMS: dict[str, spec.Opt | spec.Arg] = {
    "prompt": spec.Arg("The prompt. Piped stdin comes before it, then a blank line."),
    "model": spec.MODEL,
    "system": spec.SYSTEM,
    "raw": spec.flag("--raw", help="Plain completion, without the chat template."),
    "max_tokens": spec.MAX_TOKENS,
    "temperature": spec.TEMPERATURE,
    "top_k": spec.TOP_K,
    "top_p": spec.TOP_P,
    "min_p": spec.MIN_P,
    "repeat_penalty": spec.REPEAT_PENALTY,
    "seed": spec.SEED,
    "stop": spec.STOP,
    "ctx": spec.CTX,
    "threads": spec.THREADS,
    "kv_type": spec.KV_TYPE,
    "session": spec.SESSION,
    "continue_reply": spec.flag("--continue", help="With --session and no prompt: keep generating the last reply."),
    "chat_template": spec.CHAT_TEMPLATE,
    "think": spec.THINK,
    "schema": spec.SCHEMA,
    "grammar": spec.GRAMMAR,
    "logit_bias": spec.LOGIT_BIAS,
    "no_cache": spec.flag("--no-cache", help="Neither use nor fill the prompt cache for this run."),
    "show": spec.flag("--show-prompt", help="Print the exact context that would be fed (with --json: its token "
                                            "ids, and how many a session reuses), and generate nothing."),
    "as_json": spec.flag("--json", help="Print one JSON object instead of streaming."),
    "stats": spec.flag("--stats", help="Print timings and token counts on stderr."),
    "verbose": spec.VERBOSE,
    "url": spec.URL,
    "batch": spec.opt("--batch", help="Answer every row of this file side by side (JSON lines, or one prompt per "
                                      "line; - for stdin); prints one JSON line per row, in input order."),
    "parallel": spec.opt("--parallel", type=int, help="With --batch: rows decoded side by side (default: 4 per "
                                                      "CPU, from 4 to 16)."),
}


def register(app) -> None:
    from quipu.cli.options import signature

    def command(context, **given) -> int:
        return run(context.obj, **given)

    command.__signature__ = signature(PARAMS)
    app.command("run", help=HELP, no_args_is_help=False)(command)


def run_plain(given: dict) -> int:
    """`quipu run` without Typer, on what `spec.parse` read from a plain command line."""
    from quipu.app.environment import Environment

    return run(Environment.load(), **given)


def run(env, *, prompt, model, system, raw, max_tokens, temperature, top_k, top_p, min_p, repeat_penalty, seed,
        stop, ctx, threads, kv_type, session, continue_reply, chat_template, think, schema, grammar, logit_bias,
        no_cache, show, as_json, stats, verbose, url, batch, parallel) -> int:
    from quipu.app.turns import run_turn

    term = Terminal.detect()
    if batch is None and parallel is not None:
        raise UsageError("--parallel goes with --batch")
    text = gather_prompt(prompt, term, allow_empty=continue_reply) if batch is None else None
    opts = spec.turn_options(
        model=model, system=system, raw=raw, temperature=temperature, top_k=top_k, top_p=top_p,
        min_p=min_p, repeat_penalty=repeat_penalty, seed=seed, max_tokens=max_tokens, stop=stop,
        ctx=ctx, threads=threads, kv_type=kv_type, session=session, continue_reply=continue_reply,
        verbose=verbose, chat_template=chat_template, think=think,
        schema=schema, grammar=grammar, logit_bias=logit_bias, no_cache=no_cache,
    )
    remote = env.remote(url, opts.model)
    if batch is not None:
        from quipu.cli.batch import run_batch_file

        if prompt is not None or show or continue_reply:
            raise UsageError("--batch reads its prompts from the file; give no prompt, --show-prompt or --continue")
        if remote is not None:
            raise UsageError("--batch runs on a local model; it cannot be used with a server (--url, QUIPU_URL)")
        return run_batch_file(batch, opts, env, term, parallel)
    if show:
        return show_prompt(text, opts, env, term, as_json, remote)
    progress = PrefillProgress(term)
    wrote = []
    thought = []

    def on_text(piece: str) -> None:
        if not as_json:
            if thought and not wrote:
                term.stderr.write("\n")  # the reasoning ends its line before the answer starts
                term.stderr.flush()
            term.stdout.write(piece)
            term.stdout.flush()
            wrote.append(piece[-1:])

    def on_reasoning(piece: str) -> None:
        # Reasoning is for a person watching: stderr, dimmed, and only on a terminal; pipes get the answer.
        if not as_json and term.stderr_tty:
            term.stderr.write(term.dim(piece))
            term.stderr.flush()
            thought.append(piece)

    def finish(result) -> None:
        """The answer's end: out, and the pipe let go, before anything else is written to disk."""
        progress.close()
        if as_json:
            term.stdout.write(json.dumps(result.to_json(), ensure_ascii=False) + "\n")
        elif wrote and wrote[-1] != "\n" or not wrote:
            term.stdout.write("\n")
        term.stdout.flush()
        term.release_stdout()

    try:
        with StopOnCtrlC() as stopper:
            if remote is not None:
                from quipu.app.remote import run_remote_turn

                result = run_remote_turn(text, opts, env, remote, on_text=on_text, on_reasoning=on_reasoning,
                                         should_stop=stopper, on_result=finish)
            else:
                result = run_turn(text, opts, env, on_text=on_text, on_reasoning=on_reasoning, on_progress=progress,
                                  should_stop=stopper, on_result=finish)
    finally:
        progress.close()
    for notice in result.notices:
        term.warn(notice)
    if result.finish_reason == "length" and (schema not in (None, "off") or grammar not in (None, "off")):
        term.warn("the reply was cut by --max-tokens, so it is incomplete and will not parse; raise -n")
    if stats:
        term.stderr.write(stats_line(result) + "\n")
    interrupted = result.finish_reason == "interrupted" or stopper.requested
    return ExitCode.INTERRUPTED if interrupted else ExitCode.OK


def show_prompt(text, opts, env, term: Terminal, as_json: bool, remote=None) -> int:
    """`--show-prompt`: the context as text (or JSON with its tokens), nothing generated."""
    if remote is not None:
        from quipu.app.remote import show_remote_prompt

        view = show_remote_prompt(text, opts, env, remote)
    else:
        from quipu.app.turns import show_prompt as view_prompt

        view = view_prompt(text, opts, env)
    if as_json:
        term.stdout.write(json.dumps(view.to_json(), ensure_ascii=False) + "\n")
    else:
        term.stdout.write(view.text if view.text.endswith("\n") else view.text + "\n")
        if view.session is not None:
            term.stderr.write(f"{len(view.tokens)} tokens, {view.reused} of them already in session '{view.session}'\n")
        elif remote is not None:
            term.stderr.write(f"{len(view.tokens)} tokens\n")
        else:
            term.stderr.write(f"{len(view.tokens)} tokens, {view.reused} of them in the prompt cache\n")
    term.stdout.flush()
    return ExitCode.OK


def stats_line(result) -> str:
    s = result.stats
    return (
        f"{s.prompt_tokens} prompt tokens ({s.cached_tokens} cached), {s.completion_tokens} generated, "
        f"finish {result.finish_reason}; load {s.load_s:.2f}s, restore {s.restore_s:.2f}s, "
        f"prefill {s.prefill_s:.2f}s ({s.prefill_tok_s:.0f} tok/s), decode {s.decode_s:.2f}s "
        f"({s.decode_tok_s:.1f} tok/s), first token {s.ttft_s:.2f}s; seed {result.seed}"
    )


def gather_prompt(prompt: str | None, term: Terminal, *, allow_empty: bool = False) -> str | None:
    """Piped stdin, then a blank line, then the argument; binary stdin is refused."""
    piped = read_stdin(term)
    piped = piped.rstrip("\n") or None if piped is not None else None
    # The piped text first: questions about one document then share it as a cached beginning.
    parts = [p for p in (piped, prompt) if p]
    if not parts:
        if allow_empty:
            return None
        raise BadInput("no prompt: give one as an argument or pipe it on standard input")
    return "\n\n".join(parts)


def read_stdin(term: Terminal) -> str | None:
    """Piped standard input as text (None on a terminal): binary data is refused, and bytes
    that are not UTF-8 are replaced, with a warning."""
    if term.stdin_tty or term.stdin is None:
        return None
    try:
        data = term.stdin.buffer.read(MAX_STDIN_BYTES + 1)
    except (OSError, ValueError, AttributeError):
        data = b""
    if len(data) > MAX_STDIN_BYTES:
        raise BadInput(f"standard input is larger than {MAX_STDIN_BYTES // (1024 * 1024)} MB")
    if b"\x00" in data:
        raise BadInput("standard input is binary data, not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        term.warn("standard input is not valid UTF-8; undecodable bytes were replaced")
        return data.decode("utf-8", errors="replace")
