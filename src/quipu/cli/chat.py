"""`quipu chat`: the interactive chat; every finished turn is saved."""

from __future__ import annotations


import typer

from quipu.cli import options as opt, spec
from quipu.cli.terminal import PrefillProgress, Terminal
from quipu.errors import UsageError


def register(app: typer.Typer) -> None:
    app.command("chat", help="Chat in the terminal. Every turn is saved; --resume picks up where you left off.")(chat)


def chat(
    context: typer.Context,
    session: opt.Session = None,
    resume: bool = typer.Option(False, "--resume", "-r", help="Resume the most recently used session."),
    markdown: bool = typer.Option(False, "--markdown", help="Render replies as Markdown as they stream."),
    model: opt.Model = None,
    system: opt.System = None,
    max_tokens: opt.MaxTokens = None,
    temperature: opt.Temperature = None,
    top_k: opt.TopK = None,
    top_p: opt.TopP = None,
    min_p: opt.MinP = None,
    repeat_penalty: opt.RepeatPenalty = None,
    seed: opt.Seed = None,
    stop: opt.Stop = [],
    ctx: opt.Ctx = None,
    threads: opt.Threads = None,
    kv_type: opt.KvType = None,
    chat_template: opt.ChatTemplate = None,
    think: opt.Think = None,
    schema: opt.Schema = None,
    grammar: opt.Grammar = None,
    logit_bias: opt.LogitBias = [],
    hide_thinking: bool = typer.Option(False, "--hide-thinking", help="Do not show a thinking model's reasoning "
                                       "(/think shows it again)."),
    verbose: opt.Verbose = False,
    url: opt.Url = None,
) -> int:
    from quipu.cli.repl import Repl
    from quipu.app.chat import ChatSession

    if session is not None and resume:
        raise UsageError("give either --session NAME or --resume, not both")
    opts = spec.turn_options(
        model=model, system=system, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repeat_penalty=repeat_penalty, seed=seed, max_tokens=max_tokens, stop=stop, ctx=ctx,
        threads=threads, kv_type=kv_type, verbose=verbose, chat_template=chat_template, think=think,
        schema=schema, grammar=grammar, logit_bias=logit_bias,
    )
    term = Terminal.detect()
    env = context.obj
    remote = env.remote(url, opts.model)
    progress = PrefillProgress(term, "restoring the conversation")
    try:
        if remote is not None:
            from quipu.app.remote import RemoteChatSession

            session_ = RemoteChatSession.open(env, opts, remote, name=session, resume_latest=resume)
        else:
            session_ = ChatSession.open(env, opts, name=session, resume_latest=resume, on_progress=progress)
    finally:
        progress.close()
    try:
        return Repl(session_, term, env, markdown=markdown, show_thinking=not hide_thinking).run()
    finally:
        session_.close()
