"""`quipu serve` tried as hostile and careless clients try it: links it must not fetch, values
that must be a 4xx and never a 500, more clients than it has places, clients that go away or
never send a whole request, a stop during replies, session turns that must be transactions, and
the sampling fields a client sends, each honoured or refused."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from servers import free_port, quipu_serve, wait_until_up
from servers import openai_client as client
from tinymodel import write_tiny_gguf

openai = pytest.importorskip("openai")
HI = [{"role": "user", "content": "Hi."}]


class Listener:
    """A socket on loopback that notes every connection made to it (a link the server must not fetch)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.hits = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/secret.wav"

    def _accept(self):
        while not self.done.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.hits += 1
            conn.close()

    def close(self):
        self.done.set()
        self.thread.join(5)
        self.sock.close()


def test_no_link_is_fetched_from_any_part_of_any_route(home, tiny_model, tmp_path):
    listener = Listener()
    url = listener.url
    cases = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": url, "format": "wav"}}]}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"url": url}}]}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": url}]}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}]}]}),
        ("/api/chat", {"messages": [{"role": "user", "content": "Hi.", "images": [url]}], "stream": False}),
        ("/api/generate", {"prompt": "Hi.", "images": [url], "stream": False}),
    ]
    try:
        with quipu_serve(home, tiny_model, tmp_path=tmp_path) as base:
            with httpx.Client(base_url=base, timeout=60) as http:
                for path, body in cases:
                    r = http.post(path, json=body)
                    assert r.status_code == 400, (path, r.text)
                    said = r.json()["error"]
                    said = said if isinstance(said, str) else said["message"]
                    assert "link" in said and "secret" not in said, said
    finally:
        listener.close()
    assert listener.hits == 0


def test_a_client_s_error_is_a_4xx_never_a_500(home, tiny_model, tmp_path):
    good = {"messages": HI, "max_tokens": 2}
    huge = 10 ** 400
    cases = [
        ("/v1/chat/completions", json.dumps({**good, "temperature": huge}).encode(), 400, "finite number"),
        ("/v1/chat/completions", json.dumps({**good, "top_p": huge}).encode(), 400, "finite number"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "lone surrogate"),
        ("/v1/chat/completions", json.dumps({**good, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"$ref": "#"}}}}).encode(), 400, ""),
        ("/v1/chat/completions", json.dumps({**good, "stop": ["x"] * 200_000}).encode(), 400, "at most 16"),
        ("/v1/chat/completions", json.dumps({**good, "response_format": {"type": "json_object", "schema": 123}}).encode(),
         400, "response_format.schema"),
        ("/v1/chat/completions", json.dumps({**good, "response_format": {"type": "json_object", "schema": {
            "type": "hiccup"}}}).encode(), 400, "hiccup"),
        ("/v1/chat/completions", json.dumps({**good, "stop": ["x" * 5000]}).encode(), 400, "at most 1000"),
        ("/v1/chat/completions", json.dumps({"messages": HI * 5000}).encode(), 400, "at most 4096"),
        ("/v1/chat/completions", json.dumps({**good, "logit_bias": {"15": "x"}}).encode(), 400, "logit_bias"),
        ("/v1/chat/completions", json.dumps({**good, "logit_bias": {"99999999": -100}}).encode(), 400, "vocabulary"),
        ("/v1/chat/completions", json.dumps({**good, "presence_penalty": 3}).encode(), 400, "presence_penalty"),
        ("/v1/chat/completions", json.dumps({**good, "n": 2}).encode(), 400, "n must be 1"),
        ("/api/chat", json.dumps({**good, "keep_alive": 1e12}).encode(), 400, "at most 365 days"),
        ("/api/chat", json.dumps({**good, "keep_alive": huge}).encode(), 400, "keep_alive"),
        ("/api/generate", json.dumps({"model": "", "keep_alive": "1e12"}).encode(), 400, "keep_alive"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "deep": ' + b"[" * 100
         + b"]" * 100 + b"}",
         400, "nests deeper"),
    ]
    with quipu_serve(home, tiny_model, tmp_path=tmp_path) as url:
        with httpx.Client(base_url=url, timeout=60) as http:
            for i, (path, body, status, words) in enumerate(cases):
                session = {"X-Quipu-Session": "s1"} if "n must be 1" in words else {}
                r = http.post(path, content=body, headers={"Content-Type": "application/json", **session})
                error = r.json()["error"]
                message = error if isinstance(error, str) else error["message"]
                assert r.status_code == status and words in message, (i, r.status_code, r.text[:300])
            assert not (home / "data" / "sessions" / "s1.json").exists()  # (refused before anything is saved)
            assert http.get("/api/ps").status_code == 200
            assert http.post("/v1/chat/completions", json=good).status_code == 200
            # (llama-server's schema beside json_object holds the answer to it, as json_schema's does)
            held = http.post("/v1/chat/completions", json={**good, "max_tokens": 10, "response_format": {
                "type": "json_object", "schema": {"const": "foooooo"}}}).json()
            assert held["choices"][0]["message"]["content"] == '"foooooo"'


def test_sampling_fields_a_client_sends_are_honoured(home, bundled_model, tmp_path):
    # logit_bias bans the tokens a greedy reply opens with; the penalties change a reply that repeats
    with quipu_serve(home, bundled_model, tmp_path=tmp_path) as url:
        c = client(url)
        greedy = {"temperature": 0, "max_tokens": 24, "extra_body": {"repeat_penalty": 1.0}}
        plain = c.completions.create(model="", prompt="a b a b a b", logprobs=1, **greedy)
        first = plain.choices[0].logprobs.tokens[0]
        # (a token by its text, as llama-server takes one)
        banned = c.completions.create(model="", prompt="a b a b a b", logprobs=1, temperature=0, max_tokens=24,
                                      extra_body={"logit_bias": [[first, False]], "repeat_penalty": 1.0})
        assert banned.choices[0].logprobs.tokens[0] != first
        assert first not in banned.choices[0].logprobs.tokens
        repeating = c.completions.create(model="", prompt="1 1 1 1 1 1 1 1", **greedy).choices[0].text
        assert repeating.split().count("1") > 10
        for field in ("presence_penalty", "frequency_penalty"):
            penalised = c.completions.create(model="", prompt="1 1 1 1 1 1 1 1", **{field: 2.0}, **greedy)
            assert penalised.choices[0].text.split().count("1") < repeating.split().count("1"), field


def test_forty_clients_at_once_are_each_answered_whole_or_refused_before_any_body(home, tiny_model, tmp_path):
    body = {"messages": HI, "max_tokens": 48, "temperature": 1.0, "seed": 1}
    results: list[tuple[int, str, str | None]] = []
    polls: list[int] = []
    done = threading.Event()
    with quipu_serve(home, tiny_model, "--parallel", "2", tmp_path=tmp_path) as url:
        def one(i: int) -> None:
            with httpx.Client(base_url=url, timeout=120) as http:
                stream = i % 2 == 0
                with http.stream("POST", "/v1/chat/completions", json={**body, "stream": stream}) as r:
                    text = r.read().decode()
                    results.append((r.status_code, text, r.headers.get("retry-after")))

        def health() -> None:
            with httpx.Client(base_url=url, timeout=30) as http:
                while not done.is_set():
                    polls.append(http.get("/health").status_code)

        poller = threading.Thread(target=health)
        poller.start()
        clients = [threading.Thread(target=one, args=(i,)) for i in range(40)]
        for t in clients:
            t.start()
        for t in clients:
            t.join(300)
        done.set()
        poller.join(60)
        # (every place is given back)
        assert httpx.get(url + "/health").json()["requests"] == 0
    assert len(results) == 40 and polls and set(polls) == {200}
    answered = [text for status, text, _ in results if status == 200]
    refused = [(text, after) for status, text, after in results if status != 200]
    assert all(status in (200, 503) for status, _, _ in results)
    assert all(after == "1" and "busy" in json.loads(text)["error"]["message"] for text, after in refused)
    for text in answered:  # (whole: a completion, or a stream that ends as one)
        assert '"error"' not in text and ("[DONE]" in text or json.loads(text)["choices"][0]["message"])
    assert len(answered) >= 10  # (two answered and eight waiting at any time)


def test_idle_and_half_sent_connections_lock_no_one_out(home, tiny_model, tmp_path):
    with quipu_serve(home, tiny_model, tmp_path=tmp_path) as url:
        port = int(url.rsplit(":", 1)[1])
        idle = []
        for i in range(300):  # (past the connections the server holds at once)
            s = socket.create_connection(("127.0.0.1", port))
            if i % 2:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # (a head never ended)
            idle.append(s)
        try:
            r = httpx.post(url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 2}, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
        finally:
            for s in idle:
                s.close()


def test_a_whole_reply_stops_when_its_client_goes(quipu, home, bundled_model, tmp_path):
    # (the model may not end its reply itself: its ends are banned, so a reply not stopped runs to 3,000 tokens)
    body = json.dumps({"messages": [{"role": "user", "content": "Write a very long story about a river."}],
                       "max_tokens": 3000, "temperature": 1.0, "seed": 3, "logit_bias": {"0": -100, "2": -100},
                       "stream": False}).encode()
    with quipu_serve(home, bundled_model, tmp_path=tmp_path) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            with httpx.Client(base_url=url, timeout=60) as http:
                deadline = time.monotonic() + 60
                while not http.get("/health").json()["requests"] and time.monotonic() < deadline:
                    time.sleep(0.05)  # (until the request is in; the outcome is what the log says)
        with httpx.Client(base_url=url, timeout=60) as http:
            deadline = time.monotonic() + 120
            while http.get("/health").json()["requests"] and time.monotonic() < deadline:
                time.sleep(0.05)
    # (stopped as it read the prompt, there is no answer to log; stopped later, the answer is cut)
    logged = [json.loads(line) for line in quipu("logs", "-n", "1", "--json").stdout.decode().splitlines()]
    assert all(e["finish_reason"] == "interrupted" and e["completion_tokens"] < 3000 for e in logged)


def test_a_streamed_request_that_cannot_fit_is_refused_before_the_stream(home, tiny_model, tmp_path):
    with quipu_serve(home, tiny_model, "--ctx", "256", tmp_path=tmp_path) as url:
        c = client(url)
        with pytest.raises(openai.BadRequestError, match="context holds"):
            for _ in c.chat.completions.create(model="", messages=[{"role": "user", "content": "word " * 2000}],
                                               stream=True, max_tokens=4):
                pass


def test_session_turns_are_transactions_and_a_request_s_options_its_own(home, tiny_model, tmp_path):
    with quipu_serve(home, tiny_model, tmp_path=tmp_path) as url:
        c = client(url)
        session = {"extra_headers": {"X-Quipu-Session": "talk"}}
        first = c.chat.completions.create(model="", messages=HI, max_tokens=6, temperature=0, logprobs=True,
                                          response_format={"type": "json_object"}, **session)
        assert first.choices[0].logprobs is not None and first.choices[0].logprobs.content
        told = HI + [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user",
                                                                                          "content": "More."}]
        # a turn whose client went away is not kept: the client's retry is answered, not refused
        with httpx.Client(base_url=url, timeout=60) as http:
            with http.stream("POST", "/v1/chat/completions", headers={"X-Quipu-Session": "talk"}, json={
                    "messages": told, "max_tokens": 400, "temperature": 1.0, "stream": True}) as r:
                for line in r.iter_lines():
                    if '"content": "' in line and '"content": ""' not in line:
                        break
            deadline = time.monotonic() + 60
            while http.get("/health").json()["requests"] and time.monotonic() < deadline:
                time.sleep(0.05)
        again = c.chat.completions.create(model="", messages=told, max_tokens=4, **session)
        assert again.choices[0].message.role == "assistant"
        # kept once it was out whole: the turn after it goes on from it (waiting for its save, if need be)
        after = told + [{"role": "assistant", "content": again.choices[0].message.content},
                        {"role": "user", "content": "And?"}]
        second = c.chat.completions.create(model="", messages=after, max_tokens=8, temperature=1.0, **session)
        # the same request again (a client that never had the answer of a turn that was kept) is answered from it
        retry = c.chat.completions.create(model="", messages=after, max_tokens=8, temperature=1.0, **session)
        assert retry.choices[0].message.content == second.choices[0].message.content
        # (the retry read the session once its turn was saved) a request's schema and sampling were its own
        saved = json.loads((home / "data" / "sessions" / "talk.json").read_text())
        assert saved["params"]["grammar"] is None and saved["params"]["temperature"] not in (0, 1.0)
        with pytest.raises(openai.ConflictError):  # (messages that are not the session's own)
            c.chat.completions.create(model="", messages=[{"role": "user", "content": "Other."}] + after,
                                      max_tokens=4, **session)


def test_sigterm_during_replies_exits_0_and_the_next_server_goes_on(home, bundled_model, tmp_path):
    port = free_port()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")} | {"QUIPU_HOME": str(home)}
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "quipu", "serve", "-m", str(bundled_model), "--port", str(port), "--parallel", "2"]
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=sink, stdin=subprocess.DEVNULL, env=environ)
    try:
        wait_until_up(proc, url + "/health", log, timeout=120)
        c = client(url)
        kept = c.chat.completions.create(model="", messages=HI, max_tokens=8, temperature=0,
                                         extra_headers={"X-Quipu-Session": "kept"})
        long = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 3000, "stream": True}
        started = threading.Barrier(3)

        def reply(headers):
            with httpx.Client(base_url=url, timeout=120) as http:
                with http.stream("POST", "/v1/chat/completions", json=long, headers=headers) as r:
                    lines = r.iter_lines()
                    next(lines)
                    started.wait(60)
                    for _ in lines:
                        pass

        told = HI + [{"role": "assistant", "content": kept.choices[0].message.content},
                     {"role": "user", "content": "Go on."}]
        threads = [threading.Thread(target=reply, args=({},)),
                   threading.Thread(target=lambda: reply_session(url, told, started))]
        for t in threads:
            t.start()
        started.wait(60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        for t in threads:
            t.join(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in log.read_text(errors="replace")
    with quipu_serve(home, bundled_model, tmp_path=tmp_path) as url:  # (the kept conversation goes on)
        again = client(url).chat.completions.create(model="", messages=told, max_tokens=4,
                                                    extra_headers={"X-Quipu-Session": "kept"})
        assert again.choices[0].message.role == "assistant"


def reply_session(url, told, started):
    with httpx.Client(base_url=url, timeout=120) as http:
        with http.stream("POST", "/v1/chat/completions", headers={"X-Quipu-Session": "kept"},
                         json={"messages": told, "max_tokens": 3000, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            started.wait(60)
            for _ in lines:
                pass


def test_cors_preflights_the_headers_clients_send(home, tiny_model, tmp_path):
    with quipu_serve(home, tiny_model, "--cors", "https://app.example", tmp_path=tmp_path) as url:
        pre = httpx.options(url + "/v1/chat/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type, x-quipu-session, x-stainless-os, authorization"})
        assert pre.status_code == 200


def test_an_empty_api_key_is_refused(quipu, tiny_model):
    r = quipu("serve", "-m", tiny_model, "--api-key", "", "--port", str(free_port()))
    assert r.returncode == 2 and "--api-key is empty" in r.stderr.decode()


def test_a_model_that_differs_past_its_first_megabytes_is_given_none_of_the_other_s_state(quipu, bundled_model,
                                                                                           tmp_path):
    # (the same size, header and first 8 MiB; one byte of its last tensor otherwise)
    other = tmp_path / "other.gguf"
    data = bytearray(bundled_model.read_bytes())
    data[-1000] ^= 0x01
    other.write_bytes(bytes(data))
    prompt = "Read this. " + "The river runs to the sea and the sea to the sky. " * 40 + "What runs?"
    first = json.loads(quipu("run", "-m", bundled_model, "--json", "-n", "4", "-t", "0", prompt).stdout)
    again = json.loads(quipu("run", "-m", bundled_model, "--json", "-n", "4", "-t", "0", prompt).stdout)
    theirs = json.loads(quipu("run", "-m", other, "--json", "-n", "4", "-t", "0", prompt).stdout)
    assert first["usage"]["cached_tokens"] == 0 and again["usage"]["cached_tokens"] > 0
    assert theirs["usage"]["cached_tokens"] == 0


def test_a_session_named_by_the_start_of_its_model_file_is_known_again(quipu, home, tiny_model):
    # (as quipu named a model before its fingerprint covered the whole file)
    from quipu.models import head_fingerprint

    assert quipu("run", "-m", tiny_model, "-S", "old", "-n", "3", "Hi.").returncode == 0
    path = home / "data" / "sessions" / "old.json"
    record = json.loads(path.read_text())
    record["model"]["fingerprint"] = head_fingerprint(tiny_model)
    path.write_text(json.dumps(record))
    r = quipu("run", "-S", "old", "-n", "3", "More.")
    assert r.returncode == 0, r.stderr.decode()
    assert ":sha256:" in json.loads(path.read_text())["model"]["fingerprint"]


def test_keep_alive_0_during_a_reply_unloads_the_model_once_it_is_out(home, tiny_model, tmp_path):
    ollama = pytest.importorskip("ollama")
    with quipu_serve(home, tiny_model, "--parallel", "2", tmp_path=tmp_path) as url:
        c = ollama.Client(host=url)
        name = c.list().models[0].model
        reply = c.chat(model=name, messages=HI, stream=True, options={"num_predict": 400, "temperature": 1.0})
        next(reply)  # (a reply is under way)
        assert c.generate(model=name, prompt="", keep_alive=0).done_reason == "unload"  # (at once: no wait)
        for _ in reply:
            pass
        with httpx.Client(base_url=url, timeout=60) as http:
            deadline = time.monotonic() + 60
            while http.get("/health").json()["requests"] and time.monotonic() < deadline:
                time.sleep(0.05)
        assert c.ps().models == []


def test_a_template_s_refusal_and_a_session_in_use_are_4xx(home, tiny_model, tmp_path):
    # (Gemma's template refuses roles that do not alternate; a session another process is writing)
    from quipu.store.store import SessionStore

    template = tmp_path / "alternate.jinja"
    template.write_text("{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]"
                        "['role'] %}{{ raise_exception('Conversation roles must alternate user/assistant') }}"
                        "{% endif %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                        "{% if add_generation_prompt %}assistant: {% endif %}")
    with quipu_serve(home, tiny_model, "--chat-template", template, tmp_path=tmp_path) as url:
        with httpx.Client(base_url=url, timeout=60) as http:
            r = http.post("/v1/chat/completions", json={"messages": HI + HI, "max_tokens": 2})
            assert r.status_code == 400 and "must alternate" in r.json()["error"]["message"]
            r = http.post("/api/chat", json={"messages": HI + HI, "stream": True, "options": {"num_predict": 2}})
            assert r.status_code == 400 and "must alternate" in r.json()["error"]
            store = SessionStore(home / "data" / "sessions")
            with store.lock("busy"):  # (as `quipu chat -S busy` holds it)
                r = http.post("/v1/chat/completions", headers={"X-Quipu-Session": "busy"},
                              json={"messages": HI, "max_tokens": 2})
            assert r.status_code == 409 and "in use" in r.json()["error"]["message"]
            assert http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2}).status_code == 200


def test_a_port_in_use_is_one_line_and_exit_1_before_the_model_loads(quipu, tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        r = quipu("serve", "-m", tiny_model, "--port", str(taken.getsockname()[1]))
    err = r.stderr.decode()
    assert r.returncode == 1 and err.count("\n") == 1 and "cannot listen on 127.0.0.1:" in err, err
    assert "Traceback" not in err and "at http://" not in err  # (never said to serve)


def test_run_url_takes_the_address_the_server_prints(quipu, home, tiny_model, tmp_path):
    with quipu_serve(home, tiny_model, tmp_path=tmp_path) as url:
        log = next(tmp_path.glob("serve-*.log")).read_text()
        printed = log.split(" at ", 1)[1].split()[0]
        assert printed == url + "/v1"
        r = quipu("run", "--url", printed, "-n", "3", "Hi.")
        assert r.returncode == 0 and r.stdout.decode().strip(), r.stderr.decode()


def test_what_a_turn_says_goes_to_the_server_s_log_with_the_request_s_id(home, tiny_model, tmp_path):
    # (a --ctx past the model's training is said as it loads; a model without a chat template, at
    # each request, as `quipu run` says it)
    bare = tmp_path / "bare.gguf"
    write_tiny_gguf(bare, chat_template=None)
    with quipu_serve(home, bare, "--ctx", "8192", tmp_path=tmp_path) as url:
        r = httpx.post(url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 2}, timeout=60)
        ident = r.json()["id"]
    log = next(tmp_path.glob("serve-*.log")).read_text()
    assert "quipu serve: --ctx 8192 is past the" in log
    said = [line for line in log.splitlines() if line.startswith(f"quipu serve: {ident}: ")]
    assert said and all("\n" not in line for line in said)


def test_ollama_s_routes_answer_in_ollama_s_shape_even_those_not_served(home, tiny_model, tmp_path):
    ollama = pytest.importorskip("ollama")
    with quipu_serve(home, tiny_model, tmp_path=tmp_path) as url:
        with pytest.raises(ollama.ResponseError, match="quipu models pull NAME"):
            ollama.Client(host=url).pull("gemma3:1b")
        r = httpx.get(url + "/api/nothing")
        assert r.status_code == 404 and r.json() == {"error": "no such route"}
