"""`quipu serve`, started for real on a free loopback port and stopped, spoken to by the official
`openai` and `ollama` clients: a conversation streamed and whole, kept in memory and across a
restart of the server, held to a schema, with tools the client runs, images, log probabilities,
several answers, and a quipu session's turns."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from servers import SYSTEM, WEATHER, ask, quipu_serve
from servers import openai_client as client

openai = pytest.importorskip("openai")


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


@pytest.mark.parametrize("arch", ["plain", "qwen35"])
def test_a_new_conversation_with_the_same_system_prompt_reads_only_its_own_question(home, tiny_model, tmp_path,
                                                                                    arch):
    # (the first request's reading ended a step where its question's text began: the next goes
    # on from there, its context cut back (a hybrid's: to its checkpoint there), and answers as
    # a fresh read does)
    from tinymodel import write_tiny_qwen35

    model = tiny_model if arch == "plain" else write_tiny_qwen35(
        tmp_path / "qwen35.gguf", chat_template=(Path(__file__).parent / "templates" / "Qwen3.5-4B.jinja").read_text())
    system = {"role": "system", "content": SYSTEM}
    second = [system, {"role": "user", "content": "And what is a lake, then?"}]
    with quipu_serve(home, model, tmp_path=tmp_path) as url:
        first = ask(client(url), [system, {"role": "user", "content": "What is a river?"}])
        then = ask(client(url), second)
    with quipu_serve(tmp_path / "fresh", model, tmp_path=tmp_path) as url:
        fresh = ask(client(url), second)
    cached = then.usage.prompt_tokens_details.cached_tokens
    # (its question and the generation prompt read, a few dozen tokens: not from a multiple of
    # the prefill's 256-token step, where a restore would otherwise go back to)
    assert 0 < then.usage.prompt_tokens - cached < 64 and cached % 256 and cached < first.usage.prompt_tokens
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert then.choices[0].message.content == fresh.choices[0].message.content


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
    # the session the API made names its model as the one the command line made does
    saved = {n: json.loads((home / "data" / "sessions" / f"{n}.json").read_text())["model"]["name"]
             for n in ("talk", "alone")}
    assert saved["talk"] == saved["alone"], saved


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
        # streamed, each piece comes with its own tokens' (as OpenAI sends them), the same in all
        pieces = [(chunk.choices[0].delta.content, chunk.choices[0].logprobs)
                  for chunk in ask(c, messages, logprobs=True, top_logprobs=3, stream=True, **greedy)
                  if chunk.choices and chunk.choices[0].logprobs]
        assert sum(1 for text, _ in pieces if text) >= 5
        assert [e.logprob for _, lp in pieces for e in lp.content] == [e.logprob for e in entries]
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


def test_a_session_the_api_makes_names_its_model_as_the_command_line_does(quipu, home, bundled_model, tmp_path):
    with quipu_serve(home, "SmolLM2-135M-Instruct", tmp_path=tmp_path) as url:
        ask(client(url), [{"role": "user", "content": "Hi."}], max_tokens=2, extra_headers={"X-Quipu-Session": "api"})
    assert quipu("run", "-S", "cli", "-n", "2", "Hi.").returncode == 0
    saved = {n: json.loads((home / "data" / "sessions" / f"{n}.json").read_text())["model"]["name"]
             for n in ("api", "cli")}
    assert saved["api"] == saved["cli"] == "SmolLM2-135M-Instruct", saved
    # and the command line goes on with the API's session on that model
    assert quipu("run", "-S", "api", "-n", "2", "And?").returncode == 0


def test_llama_server_s_list_of_biases_reads_a_text_of_digits_as_text(home, bundled_model, tmp_path):
    prompt = {"prompt": "1, 2, 3, 42, 42, 42, 42, 42,", "max_tokens": 6, "temperature": 0}
    with quipu_serve(home, bundled_model, tmp_path=tmp_path) as url:
        def said(bias):
            r = httpx.post(url + "/v1/completions", json={**prompt, "logit_bias": bias}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        plain = said([])
        assert "42" in plain
        # ["42", false]: the text 42 banned (as llama-server reads it); {"42": -100}: token 42, OpenAI's way
        assert "42" not in said([["42", False]]) and said({"42": -100}) == plain
