"""Coding agents' requests on `quipu serve`, and on llama.cpp's llama-server given the same: Claude
Code's and Codex's first requests as they send them (tests/data/agents), then the same again, a
new conversation from the same prompt, and the first request after the server restarts: each
one's time to its first byte of reply (`message_start` / `response.created`, which quipu sends as
the prompt's reading begins) and to its first token of text, against the first request's; and
the bytes quipu's prompt cache writes and keeps over ten requests of two conversations that go on
from the same agent prompt.

    python -m bench.agents --model FILE [--ctx N] [--cut N] [--agent claude-code|codex]

A request's reply is bounded (8 tokens, greedy) and, on a small model (`--cut N`), its long texts
cut to N characters, so that the row runs in minutes; the agents' whole prompts are the default."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import HERE

DATA = HERE.parent / "tests" / "data" / "agents"


def recorded(name: str, cut: int | None) -> dict:
    def short(value):
        if isinstance(value, str) and cut is not None:
            return value[:cut]
        if isinstance(value, list):
            return [short(v) for v in value]
        if isinstance(value, dict):
            return {k: short(v) for k, v in value.items()}
        return value

    request = json.loads((DATA / f"{name}.json").read_text())
    body = short(request["body"])
    body.update({"max_tokens": 8} if "max_tokens" in body else {"max_output_tokens": 8})
    return {**request, "body": {**body, "temperature": 0}}


def timed(url: str, request: dict) -> dict:
    """One streamed request: seconds to its first byte, to its first text, and the prompt's
    tokens (those restored among them)."""
    import httpx

    started = time.perf_counter()
    first = text = None
    usage: dict = {}
    with httpx.Client(timeout=3600) as client, client.stream(
            "POST", url + request["path"], json=request["body"],
            headers={**request["headers"], "Authorization": "Bearer none"}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code} {response.read()[:300]!r}")
        for line in response.iter_lines():
            now = time.perf_counter()
            if first is None and line.strip():
                first = now - started
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            kind = event.get("type")
            if text is None and kind in ("content_block_delta", "response.output_text.delta"):
                text = now - started
            if kind == "message_start":
                usage = event["message"]["usage"]
            elif kind in ("response.completed", "response.incomplete"):
                u = event["response"]["usage"]
                usage = {"input_tokens": u["input_tokens"], "cached": u["input_tokens_details"]["cached_tokens"]}
    end = time.perf_counter() - started
    return {"first_byte": first, "first_text": text if text is not None else end, "usage": usage}


def start(cmd: list[str], url: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    import urllib.request

    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=sink, stdin=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(log.read_text(errors="replace")[-2000:])
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{cmd[0]} did not come up")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def other_conversation(request: dict) -> dict:
    """The same agent prompt, another first message (a new session)."""
    other = json.loads(json.dumps(request))
    messages = other["body"].get("messages") or other["body"]["input"]
    for m in messages:
        if m.get("role") == "user":
            content = m["content"]
            if isinstance(content, list):
                content[-1]["text"] = "Which files are here?"
            else:
                m["content"] = "Which files are here?"
            break
    return other


def sizes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.kv")) if folder.is_dir() else 0


def bench_cache_bytes(model: Path, ctx: int = 32768, cut: int | None = None, port: int = 8392, turns: int = 5
                      ) -> dict:
    """Codex's request as two conversations that each go on `turns` requests (a reply and a new
    message of some hundreds of tokens added each time, sent whole, as Codex sends them): the bytes
    each request writes to the prompt cache, and those it keeps in all."""
    import httpx

    asked = recorded("codex", cut)
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}, "QUIPU_HOME": str(home)}
        url = f"http://127.0.0.1:{port}"
        proc = start([sys.executable, "-m", "quipu", "serve", "-m", str(model), "--port", str(port), "--ctx", str(ctx)],
                     url, home / "serve.log", env)
        written, kept = [], []
        try:
            for first in (None, "Which files are here?"):
                body = json.loads(json.dumps(asked["body"]))
                body["stream"] = False
                if first is not None:
                    body = other_conversation({"body": body})["body"]
                for k in range(turns):
                    before = {p.name for p in (home / "cache" / "prompts").glob("*.kv")}
                    r = httpx.post(url + "/v1/responses", json=body, timeout=3600)
                    r.raise_for_status()
                    added = [p for p in (home / "cache" / "prompts").glob("*.kv") if p.name not in before]
                    written.append(sum(p.stat().st_size for p in added))
                    kept.append(sizes(home / "cache" / "prompts"))
                    # (a reply, then what an agent's next request adds: a tool's output some hundreds of tokens long)
                    said = r.json()["output"][-1].get("content", [{}])[0].get("text", "") or "Done."
                    listing = "\n".join(f"src/module_{k}_{i}.py: {i * 37 % 400} lines" for i in range(40))
                    body["input"] += [{"role": "assistant", "content": said},
                                      {"role": "user", "content": f"Step {k + 2}. The files:\n{listing}"}]
        finally:
            stop(proc)
    return {"written": written, "kept": kept}


def bench_agents(model: Path, ctx: int = 32768, cut: int | None = None, port: int = 8391,
                 agents: tuple[str, ...] = ("claude-code", "codex")) -> list[dict]:
    """The rows: for each agent, its requests' times (quipu, and llama-server where it is built),
    and the prompt cache's bytes."""
    from bench.llamacpp import program

    rows = []
    server = program("llama-server")
    for name in agents:
        asked = recorded(name, cut)
        other = other_conversation(asked)
        with tempfile.TemporaryDirectory() as tmp:
            home = Path(tmp)
            env = {**{k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}, "QUIPU_HOME": str(home)}
            url = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, "-m", "quipu", "serve", "-m", str(model), "--port", str(port), "--ctx", str(ctx)]
            proc = start(cmd, url, home / "serve.log", env)
            try:
                first, again, new = timed(url, asked), timed(url, asked), timed(url, other)
                written = sizes(home / "cache" / "prompts")
            finally:
                stop(proc)
            proc = start(cmd, url, home / "serve2.log", env)
            try:
                restarted = timed(url, asked)
            finally:
                stop(proc)
        row = {"what": f"{name}'s request ({first['usage'].get('input_tokens', 0):,} prompt tokens)",
               "quipu": ", ".join(f"{what} {r['first_text']:.2f} s ({r['first_text'] / first['first_text']:.3f}x)"
                                  for what, r in (("first", first), ("again", again), ("new session", new),
                                                  ("after a restart", restarted))),
               "first byte": f"{first['first_byte']:.2f} s", "cache bytes": written}
        if server is not None:
            lcmd = [str(server), "-m", str(model), "--port", str(port), "-c", str(ctx), "--cache-ram", "8192",
                    "-t", str(len(os.sched_getaffinity(0))), "--no-webui", "--jinja"]
            with tempfile.TemporaryDirectory() as tmp:
                proc = start(lcmd, url, Path(tmp) / "log")
                try:
                    lfirst, lagain, lnew = timed(url, asked), timed(url, asked), timed(url, other)
                finally:
                    stop(proc)
            row["llama.cpp"] = ", ".join(f"{what} {r['first_text']:.2f} s" for what, r in
                                         (("first", lfirst), ("again", lagain), ("new session", lnew)))
        rows.append(row)
    return rows


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--cut", type=int)
    ap.add_argument("--agent", action="append", choices=["claude-code", "codex"])
    ap.add_argument("--bytes", action="store_true", help="the prompt cache's bytes over ten requests instead")
    args = ap.parse_args()
    if args.bytes:
        print(json.dumps(bench_cache_bytes(args.model, args.ctx, args.cut)))
        raise SystemExit(0)
    for row in bench_agents(args.model, args.ctx, args.cut, agents=tuple(args.agent or ("claude-code", "codex"))):  # (single runs: a first request is minutes on a CPU)
        print(json.dumps(row))
