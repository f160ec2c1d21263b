"""`quipu doctor`: what quipu finds on this machine, and where a model would run."""

from __future__ import annotations

import json
from typing import Annotated, Any, Optional

import typer

from quipu.cli import options as opt, spec
from quipu.cli.terminal import Terminal, human_size as size
from quipu.shown import shown


def register(app: typer.Typer) -> None:
    app.command("doctor", short_help="What quipu finds here: versions, backends, devices, files", help="What quipu finds here: versions, llama.cpp's backends, the devices and their "
                               "memory, where files are kept, how to get a GPU build; with -m, where a model would "
                               "run and what it would take.")(doctor)


def doctor(
    context: typer.Context,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Say where this model would run and what it "
                                                 "would take (a .gguf file or a known model name).",
                                                 autocompletion=spec.complete_model, metavar="MODEL")] = None,
    ctx: Annotated[Optional[str], opt.typer_option(spec.OPTS["ctx"])] = None,
    kv_type: Annotated[Optional[str], opt.typer_option(spec.OPTS["kv_type"])] = None,
    gpu_layers: Annotated[Optional[str], opt.typer_option(spec.OPTS["gpu_layers"])] = None,
    gpu_memory: Annotated[Optional[str], opt.typer_option(spec.OPTS["gpu_memory"])] = None,
    device: Annotated[Optional[str], opt.typer_option(spec.OPTS["device"])] = None,
    swa_full: Annotated[bool, opt.typer_option(spec.OPTS["swa_full"])] = False,
    as_json: bool = typer.Option(False, "--json", help="One JSON object."),
) -> None:
    from quipu.app.doctor import report

    env = context.obj
    asked = {"model": model, "ctx": ctx, "kv_type": kv_type, "gpu_layers": gpu_layers, "gpu_memory": gpu_memory,
             "device": device, "swa_full": swa_full or None}
    about_model = any(v is not None for v in asked.values())
    found = report(env, spec.turn_options(asked, env) if about_model else None)
    term = Terminal.detect()
    if as_json:
        term.out(json.dumps(found, indent=1, ensure_ascii=False) + "\n")
    else:
        # (a model's name and path, a folder, a driver's description: outside text, escaped)
        term.out("".join(f"{shown(line)}\n" for line in lines(found)))


def threads_line(threads: dict[str, Any]) -> str:
    """The threads quipu computes with on the CPU, and what the machine's load makes of them now."""
    busy = threads["running_elsewhere"]
    load = "" if busy is None else \
        f"; {busy} thread{'s' if busy != 1 else ''} of other programs running now: it would start with {threads['now']}"
    return (f"threads: up to {threads['most']} (one a physical core of {threads['cpus']} CPUs), following the "
            f"machine's load unless --threads fixes them{load}")


def lines(found: dict[str, Any]) -> list[str]:
    """The report as a person reads it."""
    v = found["versions"]
    out = [f"quipu {v['quipu']}, llama-cpp-python {v['llama_cpp_python']}, llama.cpp {v['llama_cpp']}, "
           f"Python {v['python']}",
           f"backends: {', '.join(found['backends'])}",
           f"CPU features: {' '.join(found['cpu_features']) or 'none listed'}",
           threads_line(found["threads"]),
           "devices:"]
    for d in found["devices"]:
        memory = f"{size(d['free_bytes'])} free of {size(d['total_bytes'])}" if d["total_bytes"] else "memory not said"
        out.append(f"  {d['name']:<10} {d['kind']:<5} {d['description']} ({memory})")
    if "install_gpu_build" in found:
        out.append("GPU: none; this llama.cpp is built for the CPU alone. To build it for your GPU:")
        for row in found["install_gpu_build"]:
            out.append(f"  {row['backend']} ({row['for']}):")
            out.append(f"    {row['command']}")
    elif "problem" in found:
        out.append(f"GPU: {found['problem']}")
    else:
        gpus = [d["name"] for d in found["devices"] if d["kind"] in ("gpu", "igpu")]
        out.append(f"GPU: {', '.join(found['gpu_backends'])} ({', '.join(gpus)})")
    out.append("files:")
    for key in ("sessions", "models", "config", "cache"):
        out.append(f"  {key:<9} {found['dirs'][key]}")
    model = found.get("model")
    if model is not None:
        out.append(f"model: {model['name']} ({model['path']})")
        if "refused" in model:
            out.append(f"  would be refused: {model['refused']}")
            return out
        placement = model["placement"]
        out.append(f"  a context of {model['ctx']} tokens, on {placement['summary']}")
        out.append(f"  {'device':<10} {'layers':>7} {'weights':>10} {'KV cache':>10} {'compute':>10} {'free':>10}")
        for share in placement["memory"]:
            free = size(share["free_bytes"]) if share["total_bytes"] else "-"
            out.append(f"  {share['device']:<10} {share['layers']:>7} {size(share['model_bytes']):>10} "
                       f"{size(share['context_bytes']):>10} {size(share['compute_bytes']):>10} {free:>10}")
        window = model.get("window_cache")
        if window:
            kept = (f"a ring of {window['cells']:,} cells each, {size(window['bytes'])} in all (every position, "
                    f"--swa-full: {size(window['every_position_bytes'])})" if window["bytes"] < window["every_position_bytes"]
                    else f"every position, {size(window['bytes'])} in all")
            out.append(f"  a sliding window of {window['window']:,} tokens in {window['window_layers']} of its "
                       f"{window['layers']} blocks: {kept}")
        state = model.get("recurrent_state")
        if state:
            out.append(f"  a recurrent state in {state['layers']} of its {state['blocks']} blocks: {size(state['bytes'])}, "
                       f"kept at up to {state['checkpoints']} checkpoints in memory ({size(state['checkpoint_bytes'])} "
                       f"at most), which rewinds go back to, and {state['saved']} with a saved session "
                       f"({size(state['saved_bytes'])})")
        if model.get("note"):
            out.append(f"  {model['note']}")
        if not model["host_fits"]:
            out.append("  the part on the CPU needs more memory than is free")
        elif placement["devices"]:
            out.append("  fits: every layer on the GPU" if model["all_on_gpu"] else "  fits, partly on the GPU")
        else:
            out.append("  fits in memory")
    return out
