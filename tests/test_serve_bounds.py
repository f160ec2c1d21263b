"""`quipu serve` against what it must refuse: bad requests in the API's shape while it goes on
serving, an address others reach without a key, a page of another site, bad options, too many
requests, a body that never comes, a client that goes away."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from servers import WEATHER, free_port, quipu_serve
from servers import openai_client as client

openai = pytest.importorskip("openai")


def test_bad_requests_are_refused_in_the_api_s_shape_and_the_server_goes_on(home, tiny_model, tmp_path):
    good = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
    cases = [
        ("POST", "/v1/chat/completions", b"{not json", 400, "not JSON"),
        ("POST", "/v1/chat/completions", b"[1, 2]", 400, "a JSON object"),
        ("POST", "/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000, 400, "not JSON"),
        ("POST", "/v1/chat/completions", json.dumps({"max_tokens": 2}).encode(), 400, "messages"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "max_tokens": "x"}).encode(), 400, "max_tokens must be"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "temperature": -1}).encode(), 400,
         "temperature must be 0 or more"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "top_k": True}).encode(), 400, "top_k must be"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "stop": [3]}).encode(), 400, "stop must be"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "n": 9}).encode(), 400, "n must be a whole number"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "tools": [{"type": "function"}]}).encode(), 400,
         "tool 0 of the request has no function name"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "tools": {"a": 1}}).encode(), 400, "tools must be"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "tool_choice": "required"}).encode(), 400,
         "offers no tools"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "tools": [WEATHER], "tool_choice": {
            "type": "function", "function": {"name": "nope"}}}).encode(), 400, "tool_choice must name"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "tools": [WEATHER], "response_format": {
            "type": "json_object"}}).encode(), 400, "tools or a response format"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "functions": [{"name": "f"}]}).encode(), 400,
         "send tools"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "reasoning_effort": 3}).encode(), 400,
         "reasoning_effort must be a text"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "reasoning_effort": "high"}).encode(), 400,
         "takes no reasoning effort"),
        # (a tool's parameters no value ends: a property each value needs is the value again)
        ("POST", "/v1/chat/completions", json.dumps({**good, "tool_choice": "required", "tools": [{
            "type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}}]}).encode(), 400,
         "no value of the schema ends"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "model": "other"}).encode(), 404, "not a model here"),
        ("POST", "/v1/chat/completions", json.dumps({**good, "model": "/etc/passwd"}).encode(), 404,
         "not a model here"),
        ("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(),
         400, "messages[0].role"),
        ("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "system", "content": "x"}]}).encode(),
         400, "nothing to reply to"),
        ("POST", "/v1/chat/completions", b"x" * (9 << 20), 413, "at most 8 MB"),
        ("GET", "/v1/chat/completions", None, 405, "method"),
        ("GET", "/v2/nothing", None, 404, "no such route"),
    ]
    with quipu_serve(home, tiny_model, tmp_path=tmp_path) as url:
        with httpx.Client(base_url=url, timeout=60) as http:
            for method, path, body, status, words in cases:
                r = http.request(method, path, content=body, headers={"Content-Type": "application/json"})
                error = r.json()["error"]
                assert r.status_code == status and words in error["message"], (path, body and body[:40], r.text)
                assert set(error) == {"message", "type", "param", "code"}
            # a page that reached the server by another name (DNS rebinding) is refused
            r = http.post("/v1/chat/completions", json=good, headers={"Host": "attacker.example:80"})
            assert r.status_code == 403 and "Host" in r.json()["error"]["message"]
            # and the server still answers
            r = http.post("/v1/chat/completions", json=good)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


def test_an_address_other_machines_reach_needs_a_key_and_a_key_is_asked_for(quipu, home, tiny_model, tmp_path):
    r = quipu("serve", "-m", tiny_model, "--host", "0.0.0.0", "--port", str(free_port()))
    err = r.stderr.decode()
    assert r.returncode == 2 and "give --api-key" in err and err.count("\n") == 1 and "Traceback" not in err
    with quipu_serve(home, tiny_model, "--api-key", "s3cret", tmp_path=tmp_path) as url:
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").models.list()
        assert client(url, "s3cret").models.list().data
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi."}]})
        assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_api_key"
        assert httpx.get(url + "/health").status_code == 200  # (a probe needs no key)


def test_a_page_of_another_site_is_refused_unless_cors_names_it(home, tiny_model, tmp_path):
    good = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
    with quipu_serve(home, tiny_model, "--cors", "https://app.example", tmp_path=tmp_path) as url:
        with httpx.Client(base_url=url, timeout=60) as http:
            # a page elsewhere may send a simple POST (no preflight): it is refused before any work
            r = http.post("/v1/chat/completions", content=json.dumps(good), headers={
                "Origin": "https://evil.example", "Content-Type": "text/plain"})
            assert r.status_code == 403 and "another site" in r.json()["error"]["message"]
            pre = http.options("/v1/chat/completions", headers={
                "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type"})
            assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
            r = http.post("/v1/chat/completions", json=good, headers={"Origin": "https://app.example"})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"


@pytest.mark.parametrize("args, config, words", [
    (["--keep-alive", "soon"], "", "--keep-alive must be a number of seconds or a duration"),
    (["--cors", "evil"], "", "--cors takes an origin"),
    (["--port", "0"], "", "--port must be in [1, 65535]"),
    (["--parallel", "0"], "", "--parallel must be from 1 to 64"),
    (["--flash-attn", "sometimes"], "", "--flash-attn must be one of auto, on, off"),
    ([], "[serve]\nparallel = 1000\n", "[serve] parallel must be from 1 to 64"),
    ([], "[serve]\nport = \"x\"\n", "[serve] port must be an integer"),
    ([], "[serve]\nhost = \"0.0.0.0\"\n", "give --api-key"),
    ([], "[serve]\napi_key_env = \"QUIPU_TEST_NO_SUCH_KEY\"\n", "which is not set"),
    ([], "[serve]\nlisten = 1\n", "unknown key 'listen' in [serve]"),
])
def test_a_bad_serve_option_is_one_line_and_exit_2(quipu, home, tiny_model, args, config, words):
    if config:
        (home / "config").mkdir(exist_ok=True)
        (home / "config" / "config.toml").write_text(config)
    r = quipu("serve", "-m", tiny_model, *args)
    err = r.stderr.decode()
    assert r.returncode == 2 and words in err and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("parallel", [1, 3])
def test_past_the_requests_that_wait_a_request_is_refused_as_busy_at_once(home, tiny_model, parallel):
    # (in process: the replies answered at once are held at their first piece until the others are in)
    import threading

    from quipu.app.environment import Environment
    from quipu.app.turn_options import TurnOptions
    from quipu.serve.plan import RequestError, chat_request
    from quipu.serve.pool import MAX_WAITING, Pool
    from quipu.sessions.base import ReplySink

    served = Pool(Environment.load({"QUIPU_HOME": str(home)}), TurnOptions.of({"model": str(tiny_model)}),
                  [str(tiny_model)], parallel=parallel)
    plan = served.plan({"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4}, chat_request)
    go = threading.Event()
    started = threading.Semaphore(0)

    class Held(ReplySink):
        def __init__(self):
            self.first = True

        def text(self, piece):
            if self.first:
                self.first = False
                started.release()
            go.wait(60)

    def request(sink):  # (as the HTTP side does: counted in at arrival, out after its last byte)
        release = served.admit()
        try:
            served.chat(plan, sink)
        finally:
            release()

    answered = [threading.Thread(target=request, args=(Held(),)) for _ in range(parallel)]
    for t in answered:
        t.start()
    for _ in answered:  # (each is answered at once, beside the others)
        assert started.acquire(timeout=60)
    waiting = [threading.Thread(target=request, args=(ReplySink(),)) for _ in range(MAX_WAITING)]
    for t in waiting:
        t.start()
    try:
        pause = threading.Event()
        while served.requests < parallel + MAX_WAITING and not pause.wait(0.01):  # (until every place is taken)
            pass
        with pytest.raises(RequestError) as refused:
            served.admit()
        assert refused.value.status == 503 and "busy" in str(refused.value)
    finally:
        go.set()
        for t in [*answered, *waiting]:
            t.join(60)
        served.close()
    served.admit()()  # (and the places are given back)


def test_a_body_that_never_comes_in_whole_is_let_go(monkeypatch):
    # (in process: a client that sends a byte of its body and then nothing)
    import asyncio

    from starlette.requests import Request

    from quipu.serve import http as serve
    from quipu.serve.plan import RequestError

    monkeypatch.setattr(serve, "BODY_S", 0.2)
    sent = []

    async def receive():
        if not sent:
            sent.append(1)
            return {"type": "http.request", "body": b"{", "more_body": True}
        await asyncio.Event().wait()  # (never)

    request = Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}, receive)
    with pytest.raises(RequestError) as late:
        asyncio.run(serve.read_json(request))
    assert late.value.status == 408 and "did not come in whole" in str(late.value)


def test_a_client_that_goes_away_stops_its_reply(quipu, home, bundled_model, tmp_path):
    import time

    body = {"messages": [{"role": "user", "content": "Write a very long story about a river."}], "stream": True,
            "max_tokens": 3000, "temperature": 1.0, "seed": 3}
    with quipu_serve(home, bundled_model, tmp_path=tmp_path) as url:
        with httpx.Client(base_url=url, timeout=60) as http:
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if '"content": "' in line and '"content": ""' not in line:
                        break  # (a piece of the reply came: the client goes away)
            deadline = time.monotonic() + 120
            while http.get("/health").json()["requests"] and time.monotonic() < deadline:
                time.sleep(0.05)  # (until the reply is over: the outcome is what the log says of it)
    [logged] = [json.loads(line) for line in quipu("logs", "-n", "1", "--json").stdout.decode().splitlines()]
    assert logged["command"] == "serve" and logged["finish_reason"] == "interrupted"
    assert logged["completion_tokens"] < 3000


def test_serve_imports_no_web_framework_into_other_commands(home):
    # (a plain `run` and `--version` stay quick: only `quipu serve` imports Starlette and uvicorn)
    code = "import sys; from quipu.cli import build_app; build_app(); print(sorted(m for m in sys.modules " \
           "if m.split('.')[0] in ('starlette', 'uvicorn', 'fastapi')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


