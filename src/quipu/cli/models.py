"""`quipu models list|info|add`: the GGUF models quipu can use, read without loading them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from quipu.cli.completion import complete_short_names

from quipu.app.attachments import SENSE_WORDS
from quipu.cli.spec import complete_model
from quipu.cli.terminal import human_size
from quipu.cli.terminal import Terminal
from quipu.errors import UsageError
from quipu.shown import shown

if TYPE_CHECKING:
    from quipu.app.environment import Environment

app = typer.Typer(rich_markup_mode=None, help="Find and inspect models.", no_args_is_help=True)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="models")



@app.command("list", short_help="The models found on this machine")
def list_(context: typer.Context, as_json: bool = typer.Option(False, "--json", help="One JSON array."),
          url: Optional[str] = typer.Option(None, "--url", help="List the models of this server instead.")) -> None:
    """Models found: the bundled one, quipu's folder, the Hugging Face cache, LM Studio, Ollama
    (or a server's, with --url or QUIPU_URL)."""

    from quipu.models import describe, discover

    env = context.obj
    term = Terminal.detect()
    from quipu.app.choose import server_of

    server = server_of(url, None, env)
    if server is not None:
        from quipu.app.chat_api import list_remote_models

        served = list_remote_models(server)
        if as_json:
            term.out(json.dumps(served, indent=1) + "\n")
        else:
            for m in served:
                term.out(f"{shown(str(m['name']))}\n")  # (a server's names, escaped)
        return
    rows = [describe(e) for e in discover(env.dirs.models, env.environ, env.config.models)]
    from quipu.app.hub import pulled_paths

    pulled = pulled_paths(env.dirs)
    for row in rows:
        if row.get("path") in pulled:
            row["source"] = "huggingface (pulled by quipu)"
    if as_json:
        term.out(json.dumps(rows, indent=1) + "\n")
        return
    term.table(("name", "size", "quant", "arch", "params", "context", "kind", "takes", "from"),
               ((r["name"], "", "", "", "", "", "", "", f"{r['source']} (unreadable: {r['error']})") if "error" in r else
                (r["name"], human_size(r["size_bytes"]), r["quantization"], r["architecture"], r["parameters"],
                 str(r["context_length"] or "?"), "base" if r["base"] else "chat",
                 ", ".join(["text", *(SENSE_WORDS[m] for m in r["media"])]), r["source"]) for r in rows))


@app.command(short_help="A model's architecture, size, quantization and template")
def info(
    context: typer.Context,
    model: Optional[str] = typer.Argument(None, help="A name from `quipu models list` or a .gguf path (default: the default model).",
                                          autocompletion=complete_model),
    template: bool = typer.Option(False, "--template", help="Show what the chat template does, and its start."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object."),
) -> None:
    """Architecture, size, quantization, context length, chat template and special tokens."""
    from quipu.models import model_info

    env = context.obj
    name, path = env.resolve_model(model, requested_from="")
    data = model_info(name, path)
    if template:
        from quipu.app.templates import template_features

        data["template_features"] = template_features(data["chat_template"])
    term = Terminal.detect()
    if as_json:
        data["repository_template"] = repository_template(env, path, data["chat_template"])
        term.out(json.dumps(data, indent=1) + "\n")
        return
    lines = [
        f"name            {data['name']}",
        f"file            {data['path']}",
        f"size            {human_size(data['size_bytes'])}",
        f"architecture    {data['architecture']}",
        f"parameters      {data['parameters']}",
        f"quantization    {data['quantization']}",
        f"context length  {data['context_length']}",
        f"chat template   {'yes' if data['chat_template'] else 'no (ChatML is used)'}",
        "special tokens  " + ", ".join(f"{k}={v!r}" for k, v in data["special_tokens"].items()),
        "media           " + (f"{' and '.join(SENSE_WORDS[m] for m in data['media'])}, through {data['projector']}"
                              if data["media"] else "none (no mmproj*.gguf beside it; --mmproj FILE gives one)"),
    ]
    newer = repository_template(env, path, data["chat_template"])
    if newer:
        lines.append(f"repository      has a newer chat template than the file's: {newer} "
                     f"(use it with --chat-template {newer})")
    if template:
        lines += ["", *describe_template(data["template_features"])]
    if template and data["chat_template"]:
        head = data["chat_template"].splitlines()[:12]
        lines += ["", *head]
    term.out("\n".join(shown(line) for line in lines) + "\n")  # (a file's metadata, escaped)


@app.command()
def add(
    context: typer.Context,
    path: Path = typer.Argument(..., help="A .gguf file to use by name."),
    name: Optional[str] = typer.Option(None, "--name", help="The name to use (default: the file's name)."),
) -> None:
    """Link a GGUF file into quipu's models folder, so `--model NAME` finds it."""
    from quipu.models import add_model

    entry = add_model(path, context.obj.dirs.models, name)
    Terminal.detect().err(f"added '{entry.name}' -> {path}\n")


@app.command()
def pull(context: typer.Context,
         model: Optional[str] = typer.Argument(None, help="A short name (gemma3:1b; see --list), or OWNER/REPO or "
                                                         "OWNER/REPO:QUANT (Q4_K_M, Q8_0, IQ4_XS, ...) on the "
                                                         "Hugging Face Hub.", autocompletion=complete_short_names),
         list_names: bool = typer.Option(False, "--list", help="List the short names quipu knows, with sizes.")) -> None:
    """Download a GGUF model from the Hugging Face Hub into its cache (resumes; checks its checksum)."""
    from quipu.app.hub import hf_name
    from quipu.cli.pull import pull as pull_model

    term = Terminal.detect()
    if list_names:
        from quipu.app.known_models import KNOWN

        width = max(map(len, KNOWN))
        refs = {name: f"{known.repo}:{known.quant}" for name, known in KNOWN.items()}
        wide = max(map(len, refs.values()))
        for name, known in KNOWN.items():
            term.out(f"{name:<{width}}  {'about ' + human_size(known.size):>14}  {refs[name]:<{wide}}  "
                              f"{known.about}\n")
        return
    if model is None:
        raise UsageError("name a model to pull (a short name, or OWNER/REPO), or give --list")
    model_ = pull_model(model, context.obj, term)
    term.err(shown(f"pulled {model_.repo} {model_.quant} ({human_size(model_.size)}): use it as "
                            f"-m hf:{model_.ref} or -m {hf_name(model_)}") + "\n")  # (the Hub's names: outside text)


@app.command()
def search(context: typer.Context, text: str = typer.Argument(..., help="What to look for: gemma, qwen3 4b, llama."),
           limit: int = typer.Option(20, "--limit", help="The most repositories to show (1 to 100)."),
           as_json: bool = typer.Option(False, "--json", help="One JSON array.")) -> None:
    """The Hub's GGUF repositories matching TEXT, most downloaded first, with what a pull of each fetches."""
    from quipu.app.hub_search import search as search_hub

    term = Terminal.detect()
    found = search_hub(text, limit)
    if as_json:
        term.out(json.dumps([f.to_json() for f in found], indent=1) + "\n")
        return
    if not found:
        term.err(f"no GGUF repository on the Hub matches '{shown(text)}'\n")
        return
    width = max(len(shown(f.repo)) for f in found)
    for f in found:  # (what the Hub says: outside text)
        pulls = f"{f.quant}: {', '.join(f.files)}" if f.quant else "no GGUF file to pull"
        others = f" (also {len(f.others)} more)" if f.others else ""
        term.out(f"{shown(f.repo):<{width}}  {f.downloads:>10,}  {shown(pulls)}{others}\n")


@app.command()
def rm(context: typer.Context,
       model: str = typer.Argument(..., help="A model quipu pulled: OWNER/REPO:QUANT, hf:..., or its listed name; "
                                           "or a name `quipu models add` gave.")) -> None:
    """Remove a model quipu pulled from the Hugging Face cache (never a file quipu did not download),
    or the name `quipu models add` gave a file (the file stays)."""
    from quipu.app.hub import remove
    from quipu.models import remove_added

    named = remove_added(model, context.obj.dirs.models)
    if named is not None:
        Terminal.detect().err(f"removed the name '{model}' (the file {named} stays)\n")
        return
    removed = remove(model, context.obj.dirs)
    Terminal.detect().err(f"removed {removed.repo} {removed.quant} from the Hugging Face cache\n")


def repository_template(env: Environment, path: Path, own: str | None) -> str | None:
    """The chat template file the model's repository ships, when it differs from the GGUF's own."""
    from quipu.app.templates import repository_template as find

    return find(env, path, own)


def describe_template(features: dict[str, Any]) -> list[str]:
    """Lines saying what to expect of a chat template."""
    if "error" in features:
        return [f"template        cannot be used: {features['error']}"]

    def yes(on: object) -> str:
        return "yes" if on else "no"

    return [
        "template        " + ("ChatML (the model has none)" if features["fallback"] else "the model's own"),
        "system role     " + ("yes" if features["system_role"] else "no: a system prompt joins the first user message"),
        "thinking        " + yes(features["thinking"])
        + (" (--think/--no-think switch it)" if features["thinking_switch"] else ""),
        "tools           " + yes(features["tools"]) + (
            "" if not features["tools"] else " (calls as JSON the model is asked to write)"
            if features["tool_format"] == "generic" else f" (calls as {features['tool_format']} write them)"),
    ]
