"""`quipu serve`, started for real on a free loopback port and stopped, spoken to by the official
`openai` client: a conversation streamed and whole, kept across a restart of the server, bad
requests refused in the API's shape while the server goes on, and its address and key checks."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest

from servers import free_port, wait_until_up

openai = pytest.importorskip("openai")

SYSTEM = "You are a patient tutor who answers every question in one short, plain sentence. " * 12


@contextlib.contextmanager
def quipu_serve(home, model, *args, tmp_path):
    port = free_port()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ["QUIPU_HOME"] = str(home)
    log = tmp_path / f"serve-{port}.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "quipu", "serve", "-m", str(model), "--port", str(port),
                                 *map(str, args)], stdout=sink, stderr=sink, stdin=subprocess.DEVNULL, env=environ)
    try:
        wait_until_up(proc, f"http://127.0.0.1:{port}/health", log, timeout=120)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "Traceback" not in log.read_text(errors="replace")


def client(url, key="none"):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def ask(c, messages, **more):
    return c.chat.completions.create(model=c.models.list().data[0].id, messages=messages,
                                     **{"temperature": 0, "max_tokens": 8, **more})


def test_the_openai_client_holds_a_conversation_streamed_and_whole(home, tiny_model, tmp_path):
    with quipu_serve(home, tiny_model, tmp_path=tmp_path) as url:
        c = client(url)
        model = c.models.list().data[0]  # (the default first, then every other model here)
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
        whole = ask(c, messages)
        assert whole.model == model.id and whole.choices[0].message.role == "assistant"
        assert whole.choices[0].finish_reason in ("stop", "length")
        assert whole.usage.completion_tokens > 0 and whole.usage.prompt_tokens > 0
        pieces, usage = [], None
        for chunk in ask(c, messages, stream=True, stream_options={"include_usage": True}):
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
            if chunk.usage is not None:
                usage = chunk.usage
        # greedy: the stream is the whole answer, piece by piece
        assert "".join(pieces) == whole.choices[0].message.content
        assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
        # the conversation goes on from the answer
        messages += [{"role": "assistant", "content": whole.choices[0].message.content},
                     {"role": "user", "content": "And again."}]
        assert ask(c, messages).choices[0].message.content is not None


def test_a_plain_completion_is_the_one_run_raw_gives(quipu, home, tiny_model, tmp_path):
    prompt = "Once upon a time"
    with quipu_serve(home, tiny_model, tmp_path=tmp_path) as url:
        c = client(url)
        model = c.models.list().data[0].id
        whole = c.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=6)
        assert whole.object == "text_completion" and whole.choices[0].finish_reason in ("stop", "length")
        streamed = "".join(chunk.choices[0].text for chunk in
                           c.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=6, stream=True)
                           if chunk.choices)
        assert streamed == whole.choices[0].text
        with pytest.raises(openai.BadRequestError, match="one prompt"):
            c.completions.create(model=model, prompt=["a", "b"], max_tokens=2)
    r = quipu("run", "-m", tiny_model, "--raw", "-t", "0", "-n", "6", "--no-cache", "--json", prompt)
    assert r.returncode == 0 and json.loads(r.stdout)["text"] == whole.choices[0].text


def test_a_conversation_goes_on_from_its_kept_context_in_memory_and_after_a_restart(home, tiny_model, tmp_path):
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a river?"}]
    with quipu_serve(home, tiny_model, tmp_path=tmp_path) as url:
        one = ask(client(url), first)
        following = first + [{"role": "assistant", "content": one.choices[0].message.content},
                             {"role": "user", "content": "And a lake?"}]
        held = ask(client(url), following)  # (the context still holds the first turn: kept from memory)
    with quipu_serve(home, tiny_model, tmp_path=tmp_path) as url:  # a new process: only the disk kept it
        two = ask(client(url), following)
    # (restored to where a step of the prefill starts, 256 tokens a step, so that what is read
    # computes as in a run without the cache)
    read = one.usage.prompt_tokens + one.usage.completion_tokens
    assert read - 256 < held.usage.prompt_tokens_details.cached_tokens <= read
    assert read - 256 < two.usage.prompt_tokens_details.cached_tokens < two.usage.prompt_tokens
    # the answer a fresh read of the whole conversation gives
    with quipu_serve(tmp_path / "fresh", tiny_model, tmp_path=tmp_path) as url:
        fresh = ask(client(url), following)
        other = ask(client(url), [{"role": "user", "content": "Something else."}])
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert held.choices[0].message.content == two.choices[0].message.content == fresh.choices[0].message.content
    # another conversation after it takes nothing of it, and is answered as on a fresh server
    with quipu_serve(tmp_path / "fresh2", tiny_model, tmp_path=tmp_path) as url:
        alone = ask(client(url), [{"role": "user", "content": "Something else."}])
    assert other.choices[0].message.content == alone.choices[0].message.content


def test_an_answer_kept_to_a_schema_is_parsed_by_the_client(home, bundled_model, tmp_path):
    from typing import Literal

    from pydantic import BaseModel

    class Sky(BaseModel):
        colour: Literal["blue", "grey", "red"]
        clouds: bool

    with quipu_serve(home, bundled_model, tmp_path=tmp_path) as url:
        c = client(url)
        messages = [{"role": "user", "content": "What colour is the sky on a clear day? Answer as JSON."}]
        parsed = c.chat.completions.parse(model=c.models.list().data[0].id, messages=messages, response_format=Sky,
                                          temperature=0, max_tokens=60).choices[0].message.parsed
        assert isinstance(parsed, Sky)
        whole = ask(c, messages, response_format={"type": "json_object"}, max_tokens=60)
        text = whole.choices[0].message.content
        assert text.startswith("{")  # (held to an object from its first token; whole where not cut)
        assert whole.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict)
        with pytest.raises(openai.BadRequestError, match="response_format.type"):
            ask(c, messages, response_format={"type": "yaml"})
        with pytest.raises(openai.BadRequestError, match="schema"):
            ask(c, messages, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": 3}})


def test_the_ollama_client_chats_and_generates_streamed_and_whole(home, tiny_model, tmp_path):
    ollama = pytest.importorskip("ollama")
    options = {"temperature": 0, "num_predict": 6}
    messages = [{"role": "user", "content": "Say something."}]
    with quipu_serve(home, tiny_model, tmp_path=tmp_path) as url:
        c = ollama.Client(host=url)
        model = c.list().models[0]
        whole = c.chat(model=model.model, messages=messages, options=options, stream=False)
        assert whole.done and whole.done_reason in ("stop", "length") and whole.eval_count > 0
        assert whole.prompt_eval_count > 0
        streamed = list(c.chat(model=model.model, messages=messages, options=options, stream=True))
        assert streamed[-1].done and "".join(p.message.content for p in streamed) == whole.message.content
        assert streamed[-1].eval_count == whole.eval_count
        # the same answer through the OpenAI API: one engine, one plan
        assert ask(client(url), messages, max_tokens=6).choices[0].message.content == whole.message.content
        made = c.generate(model=model.model, prompt="Say something.", options=options)
        assert made.done and made.response == whole.message.content  # (the same conversation)
        with pytest.raises(ollama.ResponseError) as refused:
            c.chat(model=model.model, messages=messages, options={"temperature": -1})
        assert refused.value.status_code == 400 and "options.temperature must be 0 or more" in refused.value.error
        assert c.list().models  # and it goes on


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


def test_serve_imports_no_web_framework_into_other_commands(home):
    # (a plain `run` and `--version` stay quick: only `quipu serve` imports Starlette and uvicorn)
    code = "import sys; from quipu.cli import build_app; build_app(); print(sorted(m for m in sys.modules " \
           "if m.split('.')[0] in ('starlette', 'uvicorn', 'fastapi')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# (in the shape Ollama's client sends a tool in: its keys in this order, nothing more)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, today.",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}}}}
QWEN = Path(__file__).parent / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"


def test_a_tool_call_goes_to_the_client_and_its_result_back_as_run_does_it(quipu, home, tiny_model, tmp_path):
    # The client runs the tools: a reply that calls one ends there (finish_reason "tool_calls"),
    # whole and streamed as deltas, the call the one `quipu run --tools` makes with the same
    # seed; the conversation goes on from the client's result as `run --messages` goes on from it.
    asked = [{"role": "user", "content": "Weather?"}]
    sampling = {"temperature": 1.0, "seed": 11, "max_tokens": 400}
    choice = {"type": "function", "function": {"name": "get_weather"}}
    (tmp_path / "tools.json").write_text(json.dumps([WEATHER]))
    with quipu_serve(home, tiny_model, "--chat-template", QWEN, tmp_path=tmp_path) as url:
        c = client(url)
        whole = ask(c, asked, tools=[WEATHER], tool_choice=choice, **sampling)
        calls = whole.choices[0].message.tool_calls
        assert whole.choices[0].finish_reason == "tool_calls" and calls[0].function.name == "get_weather"
        assert json.loads(calls[0].function.arguments)["city"] in ("Paris", "Rome") and calls[0].id
        deltas = [chunk.choices[0].delta for chunk in ask(c, asked, tools=[WEATHER], tool_choice=choice, stream=True,
                                                           **sampling) if chunk.choices]
        [streamed] = [d.tool_calls for d in deltas if d.tool_calls]
        assert [(d.index, d.id, d.function.name, d.function.arguments) for d in streamed] == \
            [(i, c.id, c.function.name, c.function.arguments) for i, c in enumerate(calls)]
        told = asked + [whole.choices[0].message.model_dump(exclude_none=True)] + [
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'} for call in calls]
        after = ask(c, told, tools=[WEATHER], max_tokens=8)
        assert after.choices[0].message.content and after.choices[0].finish_reason in ("stop", "length")
        # Ollama's client sends the same conversation (its result names its tool) and gets the same reply
        ollama = pytest.importorskip("ollama")
        theirs = asked + [{"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}
            for call in calls]}] + [
            {"role": "tool", "tool_name": call.function.name, "content": '{"temperature": 21}'} for call in calls]
        reply = ollama.Client(host=url).chat(model=c.models.list().data[0].id, messages=theirs, tools=[WEATHER],
                                             options={"temperature": 0, "num_predict": 8}, stream=False)
        assert reply.message.content == after.choices[0].message.content
        # Ollama's shape of a call (tool_choice is quipu's own there), read by its client's type
        r = httpx.post(url + "/api/chat", json={"model": reply.model, "messages": asked, "tools": [WEATHER],
                                                "tool_choice": choice, "stream": False,
                                                "options": {"temperature": 1.0, "seed": 11, "num_predict": 400}})
        made = ollama.ChatResponse.model_validate(r.json())
        assert made.done and [(t.function.name, t.function.arguments) for t in made.message.tool_calls] == \
            [(call.function.name, json.loads(call.function.arguments)) for call in calls]
    run = json.loads(quipu("run", "-m", tiny_model, "--chat-template", QWEN, "--tools", tmp_path / "tools.json",
                           "--tool-choice", "get_weather", "-t", "1.0", "--seed", "11", "-n", "400", "--no-cache",
                           "--json", "Weather?").stdout)
    assert run["finish_reason"] == "tool_calls" and [(t["name"], t["arguments"]) for t in run["tool_calls"]] == \
        [(call.function.name, json.loads(call.function.arguments)) for call in calls]
    (tmp_path / "told.json").write_text(json.dumps({"messages": told, "tools": [WEATHER]}))
    again = json.loads(quipu("run", "-m", tiny_model, "--chat-template", QWEN, "--messages", tmp_path / "told.json",
                             "-t", "0", "-n", "8", "--no-cache", "--json").stdout)
    assert again["text"] == after.choices[0].message.content


def test_embeddings_are_the_ones_quipu_embed_gives_through_both_clients(quipu, home, tiny_model, tmp_path):
    import math

    texts = ["a river runs", "to the sea"]
    lines = quipu("embed", "-m", tiny_model, "--normalize", *texts).stdout.decode().splitlines()
    expected = [json.loads(line)["embedding"] for line in lines]
    with quipu_serve(home, tiny_model, tmp_path=tmp_path) as url:
        c = client(url)
        got = c.embeddings.create(model=c.models.list().data[0].id, input=texts)  # (the client asks for base64)
        assert [d.index for d in got.data] == [0, 1] and got.usage.prompt_tokens > 0
        for vector, want in zip([d.embedding for d in got.data], expected, strict=True):
            assert len(vector) == len(want) and math.isclose(sum(x * x for x in vector), 1.0, rel_tol=1e-4)
            assert max(abs(x - y) for x, y in zip(vector, want, strict=True)) < 1e-5
        floats = c.embeddings.create(model=got.model, input=texts[0], encoding_format="float").data[0].embedding
        assert max(abs(x - y) for x, y in zip(floats, got.data[0].embedding, strict=True)) < 1e-6
        ollama = pytest.importorskip("ollama")
        theirs = ollama.Client(host=url).embed(model=got.model, input=texts)
        assert max(abs(x - y) for x, y in zip(theirs.embeddings[1], expected[1], strict=True)) < 1e-5
        for bad, words in (([], "input must be"), ([1, 2], "token ids"), (["ok", " "], "input[1] is empty")):
            with pytest.raises(openai.BadRequestError, match=re.escape(words)):
                c.embeddings.create(model=got.model, input=bad)


def test_models_are_served_by_name_loaded_one_at_a_time_and_unloaded_when_told(home, tiny_model, bundled_model,
                                                                               tmp_path):
    ollama = pytest.importorskip("ollama")
    (home / "config").mkdir(exist_ok=True)
    (home / "config" / "config.toml").write_text('[serve]\nkeep_alive = "1h"\n')
    with quipu_serve(home, tiny_model, "-m", bundled_model, tmp_path=tmp_path) as url:
        c = ollama.Client(host=url)
        names = [m.model for m in c.list().models]
        tiny, bundled = names[:2]  # (-m's, in their order, before any other model here)
        assert [m.model for m in c.ps().models] == [tiny]  # (the default is loaded before the server listens)
        said = {"temperature": 0, "num_predict": 4}
        assert c.generate(model=bundled, prompt="Hi.", options=said).model == bundled
        [running] = c.ps().models
        assert running.model == bundled and running.context_length > 0
        assert running.expires_at.year == datetime.now(timezone.utc).year  # (the config's hour, not for good)
        first = ask(client(url), [{"role": "user", "content": "Hi."}], max_tokens=4)  # (no model named: the first)
        assert first.model == tiny and [m.model for m in c.ps().models] == [tiny]
        shown = c.show(bundled)
        assert shown.details.family == "llama" and "im_start" in shown.template and "completion" in shown.capabilities
        # Ollama's request with nothing to answer and keep_alive 0 unloads the model
        assert c.generate(model=tiny, prompt="", keep_alive=0).done_reason == "unload" and c.ps().models == []
        # a reply with keep_alive 0: the model is unloaded as soon as it is out
        c.chat(model=bundled, messages=[{"role": "user", "content": "Hi."}], options=said, keep_alive=0)
        assert c.ps().models == []
        with pytest.raises(ollama.ResponseError) as missing:
            c.show("no-such-model")
        assert missing.value.status_code == 404
        with pytest.raises(ollama.ResponseError, match="keep_alive must be"):
            c.chat(model=tiny, messages=[{"role": "user", "content": "Hi."}], keep_alive="soon")


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
    (["--port", "0"], "", "--port must be from 1 to 65535"),
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


@pytest.mark.parametrize("arch", ["qwen35", "lfm2"])
def test_a_hybrid_model_s_conversation_goes_on_from_its_checkpoints(home, tmp_path, arch):
    # Qwen 3.5's and LFM2's recurrent memory cannot go back a token: the next turn, and another
    # conversation between, go back to a checkpoint of it and answer as a fresh read does.
    from tinymodel import write_tiny_lfm2, write_tiny_qwen35

    templates = Path(__file__).parent / "templates"
    if arch == "qwen35":
        model = write_tiny_qwen35(tmp_path / "qwen35.gguf", chat_template=(templates / "Qwen3.5-4B.jinja").read_text())
    else:
        model = write_tiny_lfm2(tmp_path / "lfm2.gguf", chat_template=(templates / "LFM2.5-Instruct.jinja").read_text())
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a river?"}]
    with quipu_serve(home, model, tmp_path=tmp_path) as url:
        one = ask(client(url), first)
        following = first + [{"role": "assistant", "content": one.choices[0].message.content},
                             {"role": "user", "content": "And a lake?"}]
        held = ask(client(url), following)
        ask(client(url), [{"role": "user", "content": "Something else."}])
        again = ask(client(url), following)
    with quipu_serve(tmp_path / "fresh", model, tmp_path=tmp_path) as url:
        fresh = ask(client(url), following)
    assert held.usage.prompt_tokens_details.cached_tokens > 0
    assert held.choices[0].message.content == again.choices[0].message.content == fresh.choices[0].message.content


def test_eight_clients_at_once_get_the_answers_they_get_alone(home, bundled_model, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    questions = [[{"role": "user", "content": f"Name a colour that starts with the letter {letter}."}]
                 for letter in "BGRPOYWT"]
    with quipu_serve(home, bundled_model, tmp_path=tmp_path) as url:
        c = client(url)
        alone = [ask(c, q, max_tokens=12).choices[0].message.content for q in questions]
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda q: ask(client(url), q, max_tokens=12).choices[0].message.content,
                                     questions))
            streamed = list(pool.map(lambda q: "".join(
                chunk.choices[0].delta.content or "" for chunk in ask(client(url), q, max_tokens=12, stream=True)
                if chunk.choices), questions))
    assert together == alone and streamed == alone


def test_past_the_requests_that_wait_a_request_is_refused_as_busy_at_once(home, tiny_model):
    # (in process: the first request's reply is held at its first piece until the others are in)
    import threading

    from quipu.app.environment import Environment
    from quipu.app.serve import MAX_WAITING, ReplySink, Served
    from quipu.app.serve_plan import RequestError, chat_request
    from quipu.app.turn_options import TurnOptions

    served = Served(Environment.load({"QUIPU_HOME": str(home)}), TurnOptions.of({"model": str(tiny_model)}),
                    [str(tiny_model)])
    plan = served.plan({"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4}, chat_request)
    go, started = threading.Event(), threading.Event()

    class Held(ReplySink):
        def text(self, piece):
            started.set()
            go.wait(60)

    first = threading.Thread(target=served.chat, args=(plan, Held()))
    first.start()
    assert started.wait(60)
    waiting = [threading.Thread(target=served.chat, args=(plan, ReplySink())) for _ in range(MAX_WAITING)]
    for t in waiting:
        t.start()
    try:
        pause = threading.Event()
        while served.requests <= MAX_WAITING and not pause.wait(0.01):  # (until every place is taken)
            pass
        with pytest.raises(RequestError) as refused:
            served.room()
        assert refused.value.status == 503 and "busy" in str(refused.value)
    finally:
        go.set()
        for t in [first, *waiting]:
            t.join(60)
        served.close()
    served.room()  # (and the places are given back)


def test_a_request_with_x_quipu_session_is_a_turn_of_that_session_and_the_command_line_goes_on(quipu, home,
                                                                                              tiny_model, tmp_path):
    # A conversation a client starts under X-Quipu-Session goes on in `quipu run -S` and back; its
    # answers are those of the same turns made with `quipu run -S` alone.
    sampling = ("-t", "0", "-n", "8")
    with quipu_serve(home, tiny_model, tmp_path=tmp_path) as url:
        c = client(url)
        said = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a river?"}]
        one = ask(c, said, extra_headers={"X-Quipu-Session": "talk"})
        said.append({"role": "assistant", "content": one.choices[0].message.content})
        r = quipu("run", "-S", "talk", *sampling, "And a lake?")
        assert r.returncode == 0, r.stderr.decode()
        said += [{"role": "user", "content": "And a lake?"}, {"role": "assistant", "content": r.stdout.decode().removesuffix("\n")},
                 {"role": "user", "content": "And the sea?"}]
        three = ask(c, said, extra_headers={"X-Quipu-Session": "talk"})
        assert three.usage.prompt_tokens_details.cached_tokens > one.usage.prompt_tokens  # (restored, not read)
        edited = [*said[:1], {"role": "user", "content": "What is a mountain?"}, *said[2:]]
        with pytest.raises(openai.ConflictError, match=r"messages\[1\] differs from message 1 of session 'talk'"):
            ask(c, edited, extra_headers={"X-Quipu-Session": "talk"})
        with pytest.raises(openai.BadRequestError, match="bad session name"):
            ask(c, said, extra_headers={"X-Quipu-Session": "../x"})
    alone = []
    for i, text in enumerate(["What is a river?", "And a lake?", "And the sea?"]):
        more = ("--system", SYSTEM) if i == 0 else ()
        r = quipu("run", "-m", tiny_model, "-S", "alone", *more, *sampling, text)
        assert r.returncode == 0, r.stderr.decode()
        alone.append(r.stdout.decode().removesuffix("\n"))
    assert [one.choices[0].message.content, said[4]["content"], three.choices[0].message.content] == alone
    r = quipu("sessions", "show", "talk")
    assert r.returncode == 0 and "And the sea?" in r.stdout.decode()


def test_an_image_in_a_message_is_seen_as_run_attaches_it(quipu, home, vision, tmp_path):
    import base64

    def data_url(name):
        return "data:image/png;base64," + base64.b64encode((vision / name).read_bytes()).decode()

    def looking_at(name):
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(name)}},
                                             {"type": "text", "text": "What is it?"}]}]

    with quipu_serve(home, vision / "tiny.gguf", tmp_path=tmp_path) as url:
        c = client(url)
        red = ask(c, looking_at("red.png"), max_tokens=12).choices[0].message.content
        blue = ask(c, looking_at("blue.png"), max_tokens=12).choices[0].message.content
        assert red != blue  # (the model sees the image)
        assert ask(c, looking_at("red.png"), max_tokens=12).choices[0].message.content == red
        ollama = pytest.importorskip("ollama")
        theirs = ollama.Client(host=url).chat(model=c.models.list().data[0].id, stream=False, options={
            "temperature": 0, "num_predict": 12}, messages=[{"role": "user", "content": "What is it?",
                                                             "images": [vision / "red.png"]}])
        assert theirs.message.content == red
        linked = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]
        with pytest.raises(openai.BadRequestError, match="not a link for it to fetch"):
            ask(c, linked)
    r = quipu("run", "-m", vision / "tiny.gguf", "-a", vision / "red.png", "-t", "0", "-n", "12", "--json",
              "--no-cache", "What is it?")
    assert r.returncode == 0 and json.loads(r.stdout)["text"] == red


def test_a_body_that_never_comes_in_whole_is_let_go(monkeypatch):
    # (in process: a client that sends a byte of its body and then nothing)
    import asyncio

    from starlette.requests import Request

    from quipu.app.serve_plan import RequestError
    from quipu.cli import serve

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


def test_log_probabilities_are_the_model_s_for_each_drawn_token(home, bundled_model, tmp_path):
    import math

    messages = [{"role": "user", "content": "Name three colours."}]
    greedy = {"temperature": 0, "max_tokens": 10, "extra_body": {"repeat_penalty": 1.0}}
    with quipu_serve(home, bundled_model, tmp_path=tmp_path) as url:
        c = client(url)
        whole = ask(c, messages, logprobs=True, top_logprobs=3, **greedy)
        entries = whole.choices[0].logprobs.content
        assert b"".join(bytes(e.bytes) for e in entries).decode() == whole.choices[0].message.content
        for e in entries:  # (greedy: each drawn token is the likeliest; probabilities, not more than 1 together)
            assert len(e.top_logprobs) == 3 and e.token == e.top_logprobs[0].token
            assert e.logprob == e.top_logprobs[0].logprob <= 0
            assert sum(math.exp(t.logprob) for t in e.top_logprobs) <= 1 + 1e-6
        ends = [chunk.choices[0].logprobs for chunk in ask(c, messages, logprobs=True, top_logprobs=3, stream=True,
                                                            **greedy) if chunk.choices and chunk.choices[0].logprobs]
        assert [e.logprob for e in ends[-1].content] == [e.logprob for e in entries]
        assert whole.choices[0].logprobs is not None and ask(c, messages, **greedy).choices[0].logprobs is None
        plain = c.completions.create(model=whole.model, prompt="The sky is", max_tokens=5, temperature=0, logprobs=2)
        shaped = plain.choices[0].logprobs
        assert "".join(shaped.tokens) == plain.choices[0].text and len(shaped.top_logprobs[0]) == 2
        for bad, words in (({"logprobs": True, "top_logprobs": 50}, "top_logprobs must be"),
                           ({"top_logprobs": 2}, "needs logprobs: true")):
            with pytest.raises(openai.BadRequestError, match=words):
                ask(c, messages, **bad)


def test_n_answers_are_each_the_answer_of_its_own_seed(home, tiny_model, tmp_path):
    messages = [{"role": "user", "content": "Say something."}]
    with quipu_serve(home, tiny_model, tmp_path=tmp_path) as url:
        c = client(url)
        many = ask(c, messages, n=3, seed=5, temperature=1.0, max_tokens=6)
        assert [ch.index for ch in many.choices] == [0, 1, 2]
        alone = [ask(c, messages, seed=5 + i, temperature=1.0, max_tokens=6).choices[0].message.content
                 for i in range(3)]
        assert [ch.message.content for ch in many.choices] == alone and len(set(alone)) > 1
        assert many.usage.completion_tokens == sum(
            ask(c, messages, seed=5 + i, temperature=1.0, max_tokens=6).usage.completion_tokens for i in range(3))
        pieces = {0: "", 1: ""}
        for chunk in ask(c, messages, n=2, seed=5, temperature=1.0, max_tokens=6, stream=True):
            for ch in chunk.choices:
                pieces[ch.index] += ch.delta.content or ""
        assert [pieces[0], pieces[1]] == alone[:2]


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
