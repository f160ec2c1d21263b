"""`quipu launch AGENT`: a coding agent (Claude Code, Codex, opencode) run on a local model through
`quipu serve`, as `ollama launch` does: the server started (or one already answering on the port
used), the agent pointed at it for this run alone (its environment and command-line overrides:
nothing of the user's own configuration is written), its model names all answered by the local
model, what would make it read its prompt again turned off, and the server stopped once the agent
exits."""

from __future__ import annotations

import json
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from quipu.errors import QuipuError, UsageError

if TYPE_CHECKING:
    from quipu.app.environment import Environment

AGENT_CTX = 65536  # tokens of context an agent's server is given where the model and memory allow
AGENT_PARALLEL = 2  # its conversations answered at once: the agent's turn, and a side request (a title)
KEY = "quipu"  # the key an agent sends a server that wants none
UP_S = 600.0  # how long a server that is starting may take to load its model


@dataclass(frozen=True)
class Agent:
    """An agent quipu launches: its program, how it is installed, and how it is pointed at a server."""

    name: str
    program: str
    install: str
    point: Callable[[str, str, "int | None"], "Pointed"]  # (the server's address, the model's name, its context)


@dataclass(frozen=True)
class Pointed:
    """How an agent is pointed at a server: its environment, and arguments before the user's."""

    environ: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()


def _claude(url: str, model: str, n_ctx: int | None) -> Pointed:
    # Every model name Claude Code may ask for is the local model's; its attribution line (which
    # changes between its versions) is left out; nothing goes to Anthropic's own services; the
    # context it compacts its conversation to is the server's.
    window = {"CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(n_ctx)} if n_ctx else {}
    return Pointed({**window, "ANTHROPIC_BASE_URL": url, "ANTHROPIC_AUTH_TOKEN": KEY, "ANTHROPIC_API_KEY": "",
                    "ANTHROPIC_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model,
                    "ANTHROPIC_DEFAULT_OPUS_MODEL": model, "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
                    "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, "CLAUDE_CODE_SUBAGENT_MODEL": model,
                    "CLAUDE_CODE_ATTRIBUTION_HEADER": "0", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                    "API_TIMEOUT_MS": str(int(UP_S * 1000) * 6)})


def _codex(url: str, model: str, n_ctx: int | None) -> Pointed:
    # A provider of quipu's speaking the Responses API, given as Codex's own `-c` overrides (the
    # user's ~/.codex/config.toml is read as it is, and not written).
    provider = f'{{ name = "quipu", base_url = {json.dumps(url + "/v1")}, wire_api = "responses" }}'
    window = ("-c", f"model_context_window={n_ctx}") if n_ctx else ()
    return Pointed({}, ("-c", f"model_providers.quipu={provider}", "-c", "model_provider=quipu",
                        "-c", f"model={json.dumps(model)}", *window))


def _opencode(url: str, model: str, n_ctx: int | None) -> Pointed:
    # A provider of quipu's through the chat API, given as opencode's inline config (`OPENCODE_CONFIG_CONTENT`),
    # which goes over the user's own for this run alone.
    config = {"$schema": "https://opencode.ai/config.json", "model": f"quipu/{model}", "small_model": f"quipu/{model}",
              "provider": {"quipu": {"npm": "@ai-sdk/openai-compatible", "name": "quipu",
                                     "options": {"baseURL": url + "/v1", "apiKey": KEY},
                                     "models": {model: {"name": model, **({"limit": {"context": n_ctx,
                                                                                     "output": n_ctx // 4}}
                                                                          if n_ctx else {})}}}}}
    return Pointed({"OPENCODE_CONFIG_CONTENT": json.dumps(config)})


AGENTS = {a.name: a for a in (
    Agent("claude", "claude", "npm install -g @anthropic-ai/claude-code", _claude),
    Agent("codex", "codex", "npm install -g @openai/codex", _codex),
    Agent("opencode", "opencode", "npm install -g opencode-ai", _opencode),
)}


def agent_of(name: str) -> Agent:
    """The agent `name` names, refused in one line where quipu launches no such agent."""
    if name not in AGENTS:
        raise UsageError(f"quipu launches {', '.join(AGENTS)}, not {name!r}")
    return AGENTS[name]


def program(agent: Agent, environ: Mapping[str, str]) -> str:
    """The agent's program on the PATH, or a one-line error saying how to install it."""
    found = shutil.which(agent.program, path=environ.get("PATH"))
    if found is None:
        raise QuipuError(f"{agent.program} is not installed (or not on the PATH): {agent.install}")
    return found


def server_url(port: int) -> str:
    """The address an agent is given for the server on `port` (Anthropic's clients add /v1 themselves)."""
    return f"http://127.0.0.1:{port}"


def quipu_answers(port: int) -> bool | None:
    """Whether a quipu server answers on `port` of this machine: True; another program: False;
    none: None."""
    try:
        with urllib.request.urlopen(server_url(port) + "/health", timeout=5) as r:
            said = json.loads(r.read(4096) or b"{}")
    except (urllib.error.HTTPError, ValueError):
        return False
    except OSError:
        return None
    return isinstance(said, dict) and said.get("status") == "ok" and "requests" in said


def served_model(port: int) -> str:
    """The default model of the quipu server on `port`: the first `/v1/models` lists."""
    with urllib.request.urlopen(server_url(port) + "/v1/models", timeout=30) as r:
        listed = json.loads(r.read(1 << 20))
    return str(listed["data"][0]["id"])


def served_context(port: int, model: str) -> int | None:
    """The context the quipu server on `port` gives a conversation with `model` (`num_ctx` among
    its parameters, once the model is loaded), where it says."""
    ask = urllib.request.Request(server_url(port) + "/api/show", json.dumps({"model": model}).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(ask, timeout=30) as r:
            said = json.loads(r.read(1 << 22)).get("parameters", "")
    except (OSError, ValueError, AttributeError):
        return None
    found = [line.split()[1] for line in str(said).splitlines() if line.startswith("num_ctx ")]
    return int(found[0]) if found and found[0].isdigit() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def agent_ctx(path: Path) -> str:
    """The context an agent's server is given (`--ctx`): the model's whole training length as far
    as memory allows (`auto`), where that is at most `AGENT_CTX`; else `AGENT_CTX`."""
    from quipu.gguf import GGUFError, read_gguf

    try:
        trained = read_gguf(path).context_length
    except (OSError, GGUFError):
        trained = None  # (the server says what is wrong with the file)
    return "auto" if trained is not None and trained <= AGENT_CTX else str(AGENT_CTX)


def serve_args(model: str, port: int, ctx: str, parallel: int) -> list[str]:
    """`quipu serve`'s command line for an agent: its model, the port, its context, and how many
    conversations it answers at once."""
    return [sys.executable, "-m", "quipu", "serve", "-m", model, "--port", str(port), "--ctx", ctx,
            "--parallel", str(parallel)]


def start_server(args: Sequence[str], port: int, environ: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
    """`quipu serve` started with `args`, once it answers on `port`, its log written to `log`
    (the agent has the terminal). A server that exits first is an error with its reason."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as sink:
        proc = subprocess.Popen(list(args), stdin=subprocess.DEVNULL, stdout=sink, stderr=sink, env=dict(environ))
    deadline = time.monotonic() + UP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            said = log.read_text(errors="replace").strip().splitlines()
            raise QuipuError(f"quipu serve exited ({proc.returncode}) before it answered: "
                             f"{said[-1] if said else 'it said nothing'}")
        if quipu_answers(port):
            return proc
        time.sleep(0.25)  # (loading its model: asked again)
    stop_server(proc)
    raise QuipuError(f"quipu serve did not answer on port {port} within {UP_S:.0f} s")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """Stops a server `start_server` started (SIGTERM: every reply cut, every kept conversation kept)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_agent(path: str, pointed: Pointed, args: Sequence[str], environ: Mapping[str, str]) -> int:
    """The agent run in this terminal until it exits: its exit status."""
    env = {**environ, **pointed.environ}
    try:
        return subprocess.call([path, *pointed.args, *args], env=env)
    except KeyboardInterrupt:
        return 130


def shown(pointed: Pointed, agent: Agent, args: Sequence[str]) -> str:
    """How to run the agent by hand against the server (`quipu launch --print`): its environment
    as shell lines, and its command."""
    lines = [f"export {k}={shlex.quote(v)}" for k, v in pointed.environ.items()]
    return "\n".join([*lines, shlex.join([agent.program, *pointed.args, *args])]) + "\n"


def launch(env: Environment, name: str, model: str | None, port: int | None, ctx: str | None,
           parallel: int | None, show_only: bool, args: Sequence[str], say: Callable[[str], None],
           shown_to: Callable[[str], None]) -> int:
    """Runs agent `name` on `model` (none: the default) through the quipu server on `port` (the
    config's, else 8080), started for it where none answers there (and stopped after); with
    `show_only`, only shows how (`shown`). The agent's exit status."""
    agent = agent_of(name)
    if parallel is not None and parallel < 1:
        raise UsageError(f"--parallel must be 1 or more, got {parallel}")
    port = port or int(env.config.serve.get("port", 8080))
    answering = quipu_answers(port)
    if answering is False:  # (another program has the port: the server takes a free one)
        port = free_port()
        answering = None
    if answering:
        served = model or served_model(port)
        say(f"the quipu server at {server_url(port)} answers")
    else:
        served, path = env.resolve_model(model)
        ctx = ctx or agent_ctx(path)
    if show_only:
        pointed = agent.point(server_url(port), served, served_context(port, served) if answering else
                              int(ctx) if ctx and ctx.isdigit() else None)
        serve = "" if answering else shlex.join(["quipu", *serve_args(str(path), port, ctx or "auto",
                                                                     parallel or AGENT_PARALLEL)[3:]]) + " &\n"
        shown_to(serve + shown(pointed, agent, args))
        return 0
    where = program(agent, env.environ)
    proc = None
    if not answering:
        log = env.dirs.state / "launch" / f"serve-{port}.log"
        say(f"starting quipu serve on port {port} (--ctx {ctx}, --parallel {parallel or AGENT_PARALLEL}); its log: "
            f"{log}")
        proc = start_server(serve_args(str(path), port, ctx or "auto", parallel or AGENT_PARALLEL), port, env.environ,
                            log)
    try:
        n_ctx = served_context(port, served)
        say(f"{agent.program} on {served}" + (f", {n_ctx:,} tokens of context a conversation" if n_ctx else ""))
        pointed = agent.point(server_url(port), served, n_ctx)
        return run_agent(where, pointed, args, env.environ)
    finally:
        if proc is not None:
            stop_server(proc)
