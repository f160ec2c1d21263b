"""Coding agents on `quipu serve`: Claude Code's and Codex's first requests as they send them
(recorded in tests/data/agents, their long descriptions cut to keep the suite quick) answered in
the APIs' shapes, the stream speaking before the prompt is read, the prompt restored on the next
request, in a new conversation and after a restart, the answer a fresh read's; what an agent sends
that only tunes a hosted service let be and said once; and the agents themselves (installed from
npm where CI installs them) answering through `quipu launch` and through a server pointed at by hand."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import jsonschema
import pytest

from bench.agents import recorded
from servers import free_port, quipu_serve

CUT = 300  # (each text of a recorded request cut to so many characters: the suite stays quick)
CTX = "32768"  # (the tiny model reads an agent's prompt byte by byte: some 20,000 tokens)


def events(lines) -> list[tuple[str, dict]]:
    """A stream's server-sent events (its lines) as (type, data), its comments as ("comment", {})."""
    out, kind = [], None
    for line in lines:
        if line.startswith(":"):
            out.append(("comment", {}))
        elif line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            data = json.loads(line[6:])
            out.append((kind or data.get("type"), data))
    return out


def replay(url: str, request: dict) -> list[tuple[str, dict]]:
    with httpx.stream(request["method"], url + request["path"], json=request["body"], timeout=600,
                      headers={**request["headers"], "Authorization": "Bearer none"}) as r:
        assert r.status_code == 200, r.read()
        return events(r.iter_lines())


def text_of(said: list[tuple[str, dict]]) -> str:
    return "".join(d["delta"].get("text", "") if k == "content_block_delta" else d.get("delta", "")
                   if k == "response.output_text.delta" else "" for k, d in said)


def log_of(tmp_path: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(tmp_path.glob("serve-*.log")))


def test_claude_code_s_request_is_answered_and_its_prompt_read_once(home, tiny_model, tmp_path):
    asked = recorded("claude-code", CUT)
    # (what Claude Code sends: a model of its own, a system of blocks whose first is its attribution
    # line, context management, adaptive thinking, an effort, a tool whose schema quipu cannot hold
    # whole, a system message after the user's)
    body = asked["body"]
    assert body["model"] not in ("", None) and body["system"][0]["text"].startswith("x-anthropic-billing-header")
    assert body["context_management"]["edits"][0]["type"] == "clear_thinking_20251015"
    assert "propertyNames" in json.dumps(body["tools"]) and body["messages"][-1]["role"] == "system"
    with quipu_serve(home, tiny_model, "--ctx", CTX, tmp_path=tmp_path) as url:
        first = replay(url, asked)
        kinds = [k for k, _ in first]
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "ping" in kinds
        start = first[0][1]["message"]["usage"]
        assert start["input_tokens"] > 10000 and start["cache_read_input_tokens"] == 0
        [end] = [d for k, d in first if k == "message_delta"]  # (what was read, written to the prompt cache)
        assert end["usage"]["cache_creation_input_tokens"] >= 0.9 * start["input_tokens"]
        assert end["usage"]["input_tokens"] + end["usage"]["cache_creation_input_tokens"] == start["input_tokens"]
        # the same request again: its prompt restored, the answer a fresh read's
        again = replay(url, asked)
        usage = again[0][1]["message"]["usage"]
        assert usage["cache_read_input_tokens"] >= 0.9 * start["input_tokens"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == start["input_tokens"]
        assert text_of(again) == text_of(first)
        # a new conversation from the same system prompt and tools: those are not read again
        other = json.loads(json.dumps(asked))
        other["body"]["messages"][0]["content"][-1]["text"] = "Which files are here?"
        fresh = replay(url, other)[0][1]["message"]["usage"]
        assert fresh["cache_read_input_tokens"] >= 0.5 * start["input_tokens"]
    log = log_of(tmp_path)
    assert f"model '{body['model']}' is not a model here" in log  # (said once, and answered)
    assert log.count("is not a model here") == 1
    assert "lets be what tunes a hosted service: metadata" in log and log.count("lets be") == 1
    assert "propertyNames" in log and "POST /v1/messages 200" in log
    # after a restart, the prompt is restored from disk
    (tmp_path / "after").mkdir()
    with quipu_serve(home, tiny_model, "--ctx", CTX, tmp_path=tmp_path / "after") as url:
        after = replay(url, asked)
    usage = after[0][1]["message"]["usage"]
    assert usage["cache_read_input_tokens"] >= 0.9 * start["input_tokens"] and text_of(after) == text_of(first)


def test_codex_s_request_is_answered_and_its_prompt_read_once(home, tiny_model, tmp_path):
    asked = recorded("codex", CUT)
    kinds = [t["type"] for t in asked["body"]["tools"]]
    assert "namespace" in kinds and "web_search" in kinds and asked["body"]["store"] is False
    with quipu_serve(home, tiny_model, "--ctx", CTX, tmp_path=tmp_path) as url:
        first = replay(url, asked)
        names = [k for k, _ in first]
        assert names[:2] == ["response.created", "response.in_progress"]
        assert names[-1] in ("response.completed", "response.incomplete")  # (cut at its 8 tokens)
        done = first[-1][1]["response"]
        assert done["usage"]["input_tokens"] > 5000 and done["usage"]["input_tokens_details"]["cached_tokens"] == 0
        again = replay(url, asked)
        usage = again[-1][1]["response"]["usage"]
        assert usage["input_tokens_details"]["cached_tokens"] >= 0.9 * done["usage"]["input_tokens"]
        assert text_of(again) == text_of(first)
        # a response not stored is kept nowhere: no id to go on from
        r = httpx.get(f"{url}/v1/responses/{done['id']}", timeout=30)
        assert r.status_code == 404
    log = log_of(tmp_path)
    assert "tools: web_search" in log and log.count("lets be") == 1


def test_a_stream_speaks_while_its_turn_waits_and_tells_its_prompt_s_size(home, tiny_model, tmp_path):
    import anthropic

    # a first request reads a long prompt, holding the one place: a second is told at once that it is
    # alive, and its message starts with its prompt's tokens once its turn comes
    long = {"model": "claude-opus-4-8", "max_tokens": 4, "stream": True,
            "messages": [{"role": "user", "content": "word " * 2000}]}
    asked = {"model": "claude-opus-4-8", "max_tokens": 16, "temperature": 0, "stream": True,
             "messages": [{"role": "user", "content": "Tell a story."}]}
    with quipu_serve(home, tiny_model, "--ctx", "16384", tmp_path=tmp_path) as url:
        with httpx.stream("POST", url + "/v1/messages", json=long, timeout=120) as held:
            assert held.status_code == 200
            lines = held.iter_lines()
            assert next(lines).startswith("event: message_start")  # (out before its prompt is read)
            with httpx.stream("POST", url + "/v1/messages", json=asked, timeout=120) as waiting:
                assert waiting.status_code == 200
                alive = waiting.iter_lines()
                assert next(alive).startswith(":")  # (a comment: alive, before its turn)
                for _ in lines:  # (the first read to its end: the second's turn comes)
                    pass
                said = events(alive)
        started = next(d for k, d in said if k == "message_start")["message"]["usage"]
        client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)
        whole = client.messages.create(**{k: v for k, v in asked.items() if k not in ("stream", "temperature")},
                                       extra_body={"temperature": 0})
        assert started["input_tokens"] + started["cache_read_input_tokens"] == \
            whole.usage.input_tokens + whole.usage.cache_creation_input_tokens + whole.usage.cache_read_input_tokens > 0
        assert [k for k, _ in said if k != "comment"][-1] == "message_stop"


def test_what_claude_code_sends_beside_its_messages_is_taken(home, tiny_model, bundled_model, tmp_path):
    import anthropic

    with quipu_serve(home, tiny_model, tmp_path=tmp_path) as url:
        c = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)
        base = {"model": "claude-opus-4-8[1m]", "max_tokens": 12, "extra_body": {"temperature": 0}}
        said = [{"role": "user", "content": "Name a river."}]
        plain = c.messages.create(**base, messages=said).content[0].text
        # a system note after the user's turn (Claude Code's) is answered as the user's turn with it
        note = "Answer in one word."
        late = c.messages.create(**base, messages=[*said, {"role": "system", "content": note}])
        joined = c.messages.create(**base, messages=[{"role": "user", "content": f"Name a river.\n\n{note}"}])
        assert late.content[0].text == joined.content[0].text
        # context management: earlier turns' thinking dropped as it says (here: all of it), the rest taken
        thought = [*said, {"role": "assistant", "content": [{"type": "thinking", "thinking": "Rivers flow.",
                                                              "signature": ""}, {"type": "text", "text": plain}]},
                   {"role": "user", "content": "And another?"}]
        unthought = [*said, {"role": "assistant", "content": plain}, {"role": "user", "content": "And another?"}]
        managed = c.messages.create(**{**base, "extra_body": {
            "temperature": 0, "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": {
                "type": "thinking_turns", "value": 0}}]}, "thinking": {"type": "adaptive"},
            "output_config": {"effort": "high"}, "metadata": {"user_id": "someone"}}},
            messages=thought, extra_headers={"anthropic-beta": "context-management-2025-06-27"})
        assert managed.content[0].text == c.messages.create(**base, messages=unthought).content[0].text
        # what Anthropic refuses, quipu refuses: a user's message that says nothing
        with pytest.raises(anthropic.BadRequestError, match="content is empty"):
            c.messages.create(**base, messages=[*said, {"role": "assistant", "content": plain},
                                                {"role": "user", "content": []}])
        # a prompt longer than the context names its tokens, the context, and the option that fits it
        r = httpx.post(url + "/v1/messages", json={**{k: v for k, v in base.items() if k != "extra_body"},
                                                  "messages": [{"role": "user", "content": "word " * 500}]})
        said = r.json()["error"]["message"]
        assert r.status_code == 400 and "the server's context holds 2,048" in said and "--ctx 4096" in said
    # a tool whose schema the engine cannot hold whole (Claude Code's propertyNames) is offered, its
    # call held to the rest (and the client checks it whole)
    tool = {"name": "TaskUpdate", "description": "Update a task.", "input_schema": {
        "type": "object", "properties": {"id": {"type": "string", "maxLength": 8}, "metadata": {
            "type": "object", "propertyNames": {"type": "string"}, "additionalProperties": {"type": "string"}}},
        "required": ["id"], "additionalProperties": False}}
    (tmp_path / "bundled").mkdir()
    with quipu_serve(home, bundled_model, tmp_path=tmp_path / "bundled") as url:
        c = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)
        called = c.messages.create(model="claude-opus-4-8", max_tokens=64, messages=[
            {"role": "user", "content": "Mark task 3 done."}], tools=[tool], tool_choice={"type": "tool", "name": "TaskUpdate"},
            extra_body={"temperature": 0})
    [use] = [b for b in called.content if b.type == "tool_use"]
    jsonschema.validate(use.input, tool["input_schema"])
    assert "TaskUpdate: its calls are held to its parameters but propertyNames" in log_of(tmp_path / "bundled")


# ---- the agents themselves -----------------------------------------------------------------------

def agent_program(name: str) -> str:
    """An agent's program: from QUIPU_AGENTS (the folder CI installs them in: .ci/agents), else the
    PATH; skipped without it, a failure where CI requires the agents."""
    folder = os.environ.get("QUIPU_AGENTS")
    found = shutil.which(name, path=folder) if folder else shutil.which(name)
    if found is None:
        reason = f"{name} is not installed (.ci/agents installs the agents from npm)"
        if os.environ.get("QUIPU_REQUIRE_AGENTS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return found


def agent_environ(home: Path, tmp_path: Path, program: str) -> dict[str, str]:
    """An agent's environment: a home of its own (its settings, nothing of this machine's user),
    quipu's home, the agent's folder first on the PATH."""
    user = tmp_path / "user"
    (user / ".codex").mkdir(parents=True, exist_ok=True)
    (user / ".claude.json").write_text(json.dumps({"hasCompletedOnboarding": True}))
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("QUIPU_", "ANTHROPIC_", "OPENAI_", "CODEX_"))}
    return {**environ, "QUIPU_HOME": str(home), "HOME": str(user), "CODEX_HOME": str(user / ".codex"),
            "PATH": f"{Path(program).parent}{os.pathsep}{environ.get('PATH', '')}",
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}


# Each agent, the model it is given, the context its server needs, and a task: Claude Code with a
# short system prompt of its own and no tools (a request the bundled model reads at once; its
# server's replies greedy and of one line), Codex and
# opencode with their own prompts and tools (the tiny model reads them byte by byte).
AGENTS = {"claude": ("bundled", None, ["-p", "Say hi.", "--system-prompt", "Be brief.", "--tools", "", "--max-turns", "1"]),
          "codex": ("tiny", "65536", ["exec", "--skip-git-repo-check", "Say hi."]),
          "opencode": ("tiny", "65536", ["run", "Say hi."])}


@pytest.mark.parametrize("agent", sorted(AGENTS))
def test_an_agent_answers_through_quipu_launch_and_a_server_pointed_at_by_hand(agent, home, tiny_model, bundled_model,
                                                                               tmp_path):
    import shlex

    program = agent_program(agent)
    environ = agent_environ(home, tmp_path, program)
    which, ctx, args = AGENTS[agent]
    model = bundled_model if which == "bundled" else tiny_model
    sized = ["--ctx", ctx] if ctx else []
    if which == "bundled":
        (home / "config").mkdir()
        # (greedy, and one line: however the agent's environment note leads the model on, the reply ends
        # well within Claude Code's bound on its length, which it takes for a failure when reached)
        (home / "config" / "config.toml").write_text('[generation]\ntemperature = 0\nstop = ["\\n"]\n')
    work = tmp_path / "work"
    work.mkdir()
    port = free_port()
    r = subprocess.run([sys.executable, "-m", "quipu", "launch", agent, "-m", str(model), "--port", str(port), *sized,
                        "--", *args], env=environ, cwd=work, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    assert r.stdout.strip() and "starting quipu serve" in r.stderr
    log = next((home / "state" / "launch").glob("serve-*.log")).read_text()
    assert " 200 " in log and "Traceback" not in log
    if agent == "codex":  # (Codex's own defaults: its search tool left out, and said)
        assert "POST /v1/responses 200" in log and "tools: web_search" in log
    # the server stopped with the agent
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    # by hand: the lines `quipu launch --print` gives, against a server of one's own
    with quipu_serve(home, model, *sized, tmp_path=tmp_path) as url:
        port = int(url.rsplit(":", 1)[1])
        shown = subprocess.run([sys.executable, "-m", "quipu", "launch", agent, "--port", str(port), "--print", "--",
                                *args], env=environ, capture_output=True, text=True, timeout=120)
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.strip().splitlines()
        pointed = {k: shlex.split(v)[0] for k, v in (line.removeprefix("export ").split("=", 1) for line in lines[:-1])}
        if agent == "claude":
            assert pointed["ANTHROPIC_BASE_URL"] == url and pointed["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
        by_hand = subprocess.run(shlex.split(lines[-1]), env={**environ, **pointed}, cwd=work, capture_output=True,
                                 text=True, timeout=900)
        assert by_hand.returncode == 0, (by_hand.stdout[-2000:], by_hand.stderr[-2000:])
        assert by_hand.stdout.strip()


def test_quipu_launch_says_in_one_line_what_it_cannot_do(quipu, tiny_model, tmp_path):
    r = quipu("launch", "aider")
    said = r.stderr.decode()
    assert r.returncode == 2 and "quipu launches claude, codex, opencode" in said
    assert len(said.strip().splitlines()) == 1 and "Traceback" not in said
    # an agent that is not installed: how to install it
    r = quipu("launch", "codex", "-m", tiny_model, "--port", str(free_port()), env={"PATH": str(tmp_path)})
    assert r.returncode == 1 and "npm install -g @openai/codex" in r.stderr.decode()
    # --print shows the server to start and the agent's command line; nothing is started
    port = free_port()
    r = quipu("launch", "codex", "-m", tiny_model, "--port", str(port), "--print", "--", "exec", "hi")
    shown = r.stdout.decode()
    assert r.returncode == 0, r.stderr
    assert f"quipu serve -m {tiny_model} --port {port}" in shown and 'wire_api = "responses"' in shown
    assert shown.strip().splitlines()[-1].endswith("exec hi")


def test_the_server_s_log_has_a_line_a_request(home, tiny_model, tmp_path):
    with quipu_serve(home, tiny_model, tmp_path=tmp_path) as url:
        ok = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi."}],
                                                            "max_tokens": 4}, timeout=60)
        bad = httpx.post(url + "/v1/chat/completions", json={"messages": []}, timeout=60)
        threads = [threading.Thread(target=httpx.post, args=(url + "/v1/messages",),
                                    kwargs={"json": {"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
                                            "timeout": 60}) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert ok.status_code == 200 and bad.status_code == 400
    log = log_of(tmp_path)
    assert f"POST /v1/chat/completions 200 {ok.json()['id']}:" in log and "prompt tokens" in log
    assert "POST /v1/chat/completions 400: the request must hold a list of messages" in log
    assert log.count("POST /v1/messages 200") == 2
