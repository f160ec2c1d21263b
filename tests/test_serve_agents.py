"""The APIs agents speak, on `quipu serve` started for real: Anthropic's Messages API spoken to by
the official `anthropic` client, OpenAI's Responses API by the official `openai` client. Whole and
streamed replies are the same answer, and `quipu run`'s; a forced tool call holds its tool's
schema; a Responses conversation goes on by `previous_response_id` from its kept context, after a
restart too and from an earlier response (a branch), answering as a fresh server given the whole
conversation does."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import pytest

from servers import SYSTEM, WEATHER, quipu_serve

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

GREEDY = {"temperature": 0}  # (sent as older clients send it: the newest anthropic client has no field for it)
TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}


def messages_client(url: str, key: str = "none"):
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)


def responses_client(url: str, key: str = "none"):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def run_answer(quipu, model, system: str, prompt: str, n: int) -> str:
    r = quipu("run", "-m", model, "--system", system, "-t", "0", "-n", str(n), "--no-cache", "--json", prompt)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["text"]


def test_the_anthropic_client_gets_quipu_run_s_answer_whole_and_streamed(quipu, home, bundled_model, tmp_path):
    with quipu_serve(home, bundled_model, tmp_path=tmp_path) as url:
        c = messages_client(url)
        asked = {"model": "", "max_tokens": 24, "system": "Be brief.", "extra_body": GREEDY,
                 "messages": [{"role": "user", "content": "Name a colour."}]}
        whole = c.messages.create(**asked)
        assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
        assert whole.stop_reason in ("end_turn", "max_tokens") and whole.usage.output_tokens > 0
        [block] = whole.content
        with c.messages.stream(**asked) as stream:
            pieces = list(stream.text_stream)
            final = stream.get_final_message()
        assert len(pieces) > 1 and "".join(pieces) == block.text == final.content[0].text
        assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
        # the second read of the same prompt is restored: Anthropic's cache_read_input_tokens
        assert final.usage.cache_read_input_tokens > 0
        def total(u):  # (the prompt: read and kept, read and written to the prompt cache, restored)
            return u.input_tokens + (u.cache_creation_input_tokens or 0) + u.cache_read_input_tokens

        assert total(final.usage) == total(whole.usage)
        # a stop sequence ends the reply there and is named
        cut = c.messages.create(**{**asked, "stop_sequences": [block.text.split()[1]]})
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == block.text.split()[1]
        assert block.text.startswith(cut.content[0].text) and len(cut.content[0].text) < len(block.text)
        # a count of the prompt's tokens is the prompt the reply read
        counted = c.messages.count_tokens(model="", system="Be brief.", messages=asked["messages"])
        assert counted.input_tokens == whole.usage.input_tokens
    assert block.text == run_answer(quipu, bundled_model, "Be brief.", "Name a colour.", 24)


def test_a_forced_tool_call_holds_its_schema_and_its_result_goes_back(home, bundled_model, tmp_path):
    with quipu_serve(home, bundled_model, tmp_path=tmp_path) as url:
        c = messages_client(url)
        messages = [{"role": "user", "content": "What is the weather in Rome?"}]
        asked = {"model": "", "max_tokens": 64, "tools": [TOOL], "extra_body": GREEDY}
        called = c.messages.create(**asked, messages=messages, tool_choice={"type": "tool", "name": "get_weather"})
        assert called.stop_reason == "tool_use"
        [use] = [b for b in called.content if b.type == "tool_use"]
        assert use.name == "get_weather"
        jsonschema.validate(use.input, TOOL["input_schema"])
        with c.messages.stream(**asked, messages=messages, tool_choice={"type": "any"}) as stream:
            streamed = stream.get_final_message()
        [streamed_use] = [b for b in streamed.content if b.type == "tool_use"]
        assert streamed_use.input == use.input and streamed.stop_reason == "tool_use"
        # the client runs it and gives its result back; the model answers in words
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in called.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": "Sunny, 24 degrees."}]}]
        answered = c.messages.create(**asked, messages=messages, tool_choice={"type": "none"})
        assert answered.stop_reason in ("end_turn", "max_tokens") and answered.content[0].type == "text"
        # the Responses API's forced call holds the schema too
        r = responses_client(url).responses.create(
            model="", input="What is the weather in Rome?", tools=[{"type": "function", **WEATHER["function"]}],
            tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=64, temperature=0)
        [call] = [item for item in r.output if item.type == "function_call"]
        assert call.name == "get_weather" and call.call_id
        jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
        deltas = []
        with responses_client(url).responses.stream(
                model="", input="What is the weather in Rome?", tools=[{"type": "function", **WEATHER["function"]}],
                tool_choice="required", max_output_tokens=64, temperature=0) as stream:
            for event in stream:
                if event.type == "response.function_call_arguments.delta":
                    deltas.append(event.delta)
            streamed_call = [i for i in stream.get_final_response().output if i.type == "function_call"]
        assert [(c.name, c.arguments) for c in streamed_call] == [(call.name, call.arguments)]
        assert "".join(deltas) == call.arguments
        # its output goes back, and the model answers in words
        after = responses_client(url).responses.create(
            model="", previous_response_id=r.id, max_output_tokens=16, temperature=0,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 degrees."}])
        assert after.output[-1].type == "message"


LONG = SYSTEM * 8  # (a conversation of some length: a restore takes all but the last step (256 tokens) of a whole read)


def greedy_response(c, **asked):
    return c.responses.create(model="", max_output_tokens=16, temperature=0, instructions=LONG, **asked)


def streamed_response(c, **asked):
    """The response a stream ends with (completed, or incomplete at its length), and its text's deltas."""
    deltas, last = [], None
    with c.responses.stream(model="", max_output_tokens=16, temperature=0, instructions=LONG, **asked) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            last = event
    assert last.type in ("response.completed", "response.incomplete")
    return last.response, deltas


def test_the_openai_client_s_responses_whole_and_streamed_are_quipu_run_s(quipu, home, bundled_model, tmp_path):
    with quipu_serve(home, bundled_model, tmp_path=tmp_path) as url:
        c = responses_client(url)
        whole = greedy_response(c, input="Name a colour.", store=False)
        assert whole.object == "response" and whole.status in ("completed", "incomplete")
        streamed, deltas = streamed_response(c, input="Name a colour.", store=False)
        assert len(deltas) > 1 and "".join(deltas) == whole.output_text == streamed.output_text
        assert streamed.usage.output_tokens == whole.usage.output_tokens
        # a response not stored is not kept
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(whole.id)
    assert whole.output_text == run_answer(quipu, bundled_model, LONG, "Name a colour.", 16)


QUESTIONS = ["What is a river?", "And a lake?", "And the sea?"]


def test_a_responses_conversation_goes_on_from_its_kept_context_after_a_restart(home, bundled_model, tmp_path):
    with quipu_serve(home, bundled_model, tmp_path=tmp_path) as url:
        c = responses_client(url)
        one = greedy_response(c, input=QUESTIONS[0])
        two, _ = streamed_response(c, input=QUESTIONS[1], previous_response_id=one.id)
        assert two.usage.input_tokens_details.cached_tokens >= 0.9 * one.usage.total_tokens
        kept = c.responses.retrieve(two.id)
        assert kept.output_text == two.output_text and kept.previous_response_id == one.id
        items = c.responses.input_items.list(two.id)
        assert [i.content[0].text for i in items.data] == [QUESTIONS[1]]
    with quipu_serve(home, bundled_model, tmp_path=tmp_path) as url:  # a new process: the disk kept it
        three = greedy_response(responses_client(url), input=QUESTIONS[2], previous_response_id=two.id)
    # (restored, not read again: at least nine tenths of what the conversation had read)
    assert three.usage.input_tokens_details.cached_tokens >= 0.9 * (two.usage.total_tokens)
    # a fresh server given the whole conversation answers the same
    conversation = [{"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": one.output_text},
                    {"role": "user", "content": QUESTIONS[1]}, {"role": "assistant", "content": two.output_text},
                    {"role": "user", "content": QUESTIONS[2]}]
    with quipu_serve(tmp_path / "fresh", bundled_model, tmp_path=tmp_path) as url:
        fresh = greedy_response(responses_client(url), input=conversation, store=False)
    assert fresh.usage.input_tokens_details.cached_tokens == 0
    assert three.output_text == fresh.output_text


def test_going_on_from_an_earlier_response_branches_and_the_later_one_goes_on_still(home, bundled_model, tmp_path):
    with quipu_serve(home, bundled_model, tmp_path=tmp_path) as url:
        c = responses_client(url)
        one = greedy_response(c, input=QUESTIONS[0])
        two = greedy_response(c, input=QUESTIONS[1], previous_response_id=one.id)
        other = greedy_response(c, input=QUESTIONS[2], previous_response_id=one.id)  # (from the first: a branch)
        on = greedy_response(c, input=QUESTIONS[2], previous_response_id=two.id)  # (the first branch, again)
        # each is the answer to its own conversation, as a fresh server gives it
        fresh = {}
        for name, conversation in {"other": [QUESTIONS[0], one, QUESTIONS[2]],
                                   "on": [QUESTIONS[0], one, QUESTIONS[1], two, QUESTIONS[2]]}.items():
            items = [{"role": "user", "content": x} if isinstance(x, str) else
                     {"role": "assistant", "content": x.output_text} for x in conversation]
            fresh[name] = greedy_response(c, input=items, store=False).output_text
        assert other.output_text == fresh["other"] and on.output_text == fresh["on"]
        # a response forgotten is gone; its conversation goes on from the others kept
        c.responses.delete(one.id)
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(one.id)
        with pytest.raises(openai.NotFoundError, match="previous_response_id"):
            greedy_response(c, input="Hi.", previous_response_id=one.id)
        assert greedy_response(c, input="Thanks.", previous_response_id=on.id).output_text


def test_the_agents_apis_refuse_what_they_do_not_take_in_their_shape(home, tiny_model, tmp_path):
    with quipu_serve(home, tiny_model, tmp_path=tmp_path) as url:
        def post(path, body, **headers):
            return httpx.post(url + path, json=body, headers=headers, timeout=60)

        message = [{"role": "user", "content": "Hi."}]
        for body, words in [
            ({"messages": message}, "max_tokens"),
            ({"max_tokens": 4, "messages": "Hi."}, "messages"),
            ({"max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:9/x.png"}}]}]}, "not a link"),
            ({"max_tokens": 4, "messages": message, "tools": [{"name": "w"}]}, "input_schema"),
            ({"max_tokens": 4, "messages": message, "temperature": "hot"}, "temperature"),
            ({"max_tokens": 4, "messages": message, "thinking": {"type": "enabled"}}, "budget_tokens"),
            ({"max_tokens": 4, "messages": message, "mcp_servers": [{"url": "http://x"}]}, "mcp_servers"),
            ({"max_tokens": 4, "messages": message, "stop_sequences": [""]}, "stop_sequences"),
        ]:
            r = post("/v1/messages", body)
            assert r.status_code == 400, (body, r.text)
            shaped = r.json()
            assert shaped["type"] == "error" and shaped["error"]["type"] == "invalid_request_error"
            assert words in shaped["error"]["message"], (words, shaped)
        for body, words in [
            ({"input": []}, "input"),
            ({"input": "Hi.", "tools": [{"type": "teleport"}]}, "a tool is a function"),
            ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "previous_response_id"),
            ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}],
              "store": False}, "not a link"),
            ({"input": "Hi.", "background": True}, "background"),
            ({"input": "Hi.", "text": {"format": {"type": "json_schema", "schema": "no"}}}, "schema"),
            ({"input": "Hi.", "previous_response_id": "resp_0123456789abcdef"}, "previous_response_id"),
            ({"input": "Hi.", "previous_response_id": "../../x"}, "previous_response_id"),
        ]:
            r = post("/v1/responses", body)
            assert 400 <= r.status_code < 500, (body, r.text)
            assert words in r.json()["error"]["message"], (words, r.json())
        # the tools a hosted service runs (a search) are left out of the model's, and the request answered
        assert post("/v1/responses", {"input": "Hi.", "tools": [{"type": "web_search"}], "max_output_tokens": 2,
                                      "store": False}).status_code == 200
        assert post("/v1/messages", {"max_tokens": 2, "messages": message, "tools": [
            {"type": "web_search_20250305", "name": "web_search"}]}).status_code == 200
        assert httpx.get(url + "/v1/responses/resp_0123456789abcdef", timeout=30).status_code == 404
        assert httpx.get(url + "/v1/responses/..%2F..%2Fx", timeout=30).status_code == 404
        assert post("/v1/messages/count_tokens", {"messages": "no"}).json()["type"] == "error"


def test_a_key_is_taken_as_anthropic_s_header_or_a_bearer_token(home, tiny_model, tmp_path):
    with quipu_serve(home, tiny_model, "--api-key", "s3cret", tmp_path=tmp_path) as url:
        asked = {"model": "", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi."}]}
        with pytest.raises(anthropic.AuthenticationError):
            messages_client(url, "wrong").messages.create(**asked)
        assert messages_client(url, "s3cret").messages.create(**asked).content  # (as x-api-key)
        r = httpx.post(url + "/v1/messages", json=asked, headers={"Authorization": "Bearer s3cret"}, timeout=60)
        assert r.status_code == 200
        assert responses_client(url, "s3cret").responses.create(model="", input="Hi.", max_output_tokens=2,
                                                                store=False).output


ODD = [None, 0, -1, 1.5, "x", "", True, [], {}, [1], ["x"], [{}], [None], {"type": 1}, {"type": "x"},
       [{"type": "text"}], [{"role": "user"}], [{"role": "user", "content": [{"type": 7}]}]]


def test_every_odd_value_of_every_field_is_a_4xx_never_a_500(home, tiny_model, tmp_path):
    messages = {"model": "", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi."}]}
    responses = {"model": "", "max_output_tokens": 2, "input": "Hi.", "store": False}
    fields = {"/v1/messages": (messages, ["max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p",
                                          "top_k", "tools", "tool_choice", "thinking", "output_config", "metadata",
                                          "logit_bias", "model", "stream"]),
              "/v1/responses": (responses, ["input", "instructions", "tools", "tool_choice", "text", "reasoning",
                                            "max_output_tokens", "temperature", "top_p", "previous_response_id",
                                            "include", "truncation", "store", "model", "stream"])}
    with quipu_serve(home, tiny_model, tmp_path=tmp_path) as url:
        with httpx.Client(base_url=url, timeout=60) as http:
            for path, (good, names) in fields.items():
                for name in names:
                    for value in ODD:
                        r = http.post(path, json={**good, name: value})
                        assert r.status_code < 500, (path, name, value, r.text[:300])
                        if r.status_code >= 400:
                            body = r.json()
                            assert (body["error"]["message"] if path == "/v1/responses" else
                                    body["error"]["message"]), body
            # the same odd values inside a message, an item, a block
            for value in ODD:
                for body in ({**messages, "messages": [{"role": "user", "content": [value]}]},
                             {**messages, "messages": [{"role": "assistant", "content": [value]},
                                                       {"role": "user", "content": "Hi."}]},
                             {**messages, "messages": [{"role": "user", "content": [
                                 {"type": "tool_result", "tool_use_id": "t", "content": value}]}]},
                             {**messages, "tools": [value]}):
                    r = http.post("/v1/messages", json=body)
                    assert r.status_code < 500, (body, r.text[:300])
                for body in ({**responses, "input": [value]},
                             {**responses, "input": [{"role": "user", "content": [value]}]},
                             {**responses, "input": [{"type": "function_call_output", "call_id": "c", "output": value}]},
                             {**responses, "tools": [value]}):
                    r = http.post("/v1/responses", json=body)
                    assert r.status_code < 500, (body, r.text[:300])
            assert http.get("/health").json()["status"] == "ok"


def test_the_hostile_checks_hold_for_the_agents_apis(home, tiny_model, tmp_path):
    with quipu_serve(home, tiny_model, "--ctx", "256", tmp_path=tmp_path) as url:
        # a prompt longer than the context: a 4xx in the API's shape before any event
        with pytest.raises(anthropic.BadRequestError, match="context holds"):
            with messages_client(url).messages.stream(model="", max_tokens=4,
                                                      messages=[{"role": "user", "content": "word " * 2000}]) as s:
                s.get_final_message()
        c = responses_client(url)
        with pytest.raises(openai.BadRequestError, match="context holds"):
            for _ in c.responses.create(model="", input="word " * 2000, stream=True, max_output_tokens=4):
                pass
        # a kept response is a transaction: one whose client went before its end is not kept
        first = c.responses.create(model="", input="Hi.", max_output_tokens=4, temperature=0)
        with httpx.Client(base_url=url, timeout=60) as http:
            long = {"type": "json_schema", "name": "long", "schema": {  # (no reply of this ends within its length)
                "type": "array", "items": {"type": "integer"}, "minItems": 1000}}
            with http.stream("POST", "/v1/responses", json={"input": "More.", "previous_response_id": first.id,
                                                            "max_output_tokens": 200, "temperature": 1.0,
                                                            "text": {"format": long}, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data:") and "created" in line:
                        gone = json.loads(line[5:])["response"]["id"]
                    if "output_text.delta" in line:
                        break
            deadline = time.monotonic() + 60
            while http.get("/health").json()["requests"] and time.monotonic() < deadline:
                time.sleep(0.05)  # (until the reply has ended: what is kept is what the store says)
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(gone)
        # and the conversation goes on from the response before it, as if it had never been asked
        on = c.responses.create(model="", input="More.", previous_response_id=first.id, max_output_tokens=4,
                                temperature=0)
        assert c.responses.retrieve(on.id).output_text == on.output_text
    # a busy server's refusal in Anthropic's shape, which its client retries
    from quipu.serve.anthropic import error_body
    from quipu.serve.pool import busy

    assert error_body(busy()) == (503, {"type": "error", "error": {
        "type": "overloaded_error", "message": "the server is busy: too many requests wait; try again soon"}})


def test_a_thinking_model_s_reasoning_is_its_own_block_and_item(tmp_path, home):
    from tinymodel import REASONING_SPECIALS, write_tiny_gguf

    templates = __import__("pathlib").Path(__file__).parent / "templates"
    model = write_tiny_gguf(tmp_path / "think.gguf", tool_specials=True, tokenizer="bpe",
                            extra_specials=REASONING_SPECIALS, chat_template=(templates / "Qwen3.5-4B.jinja").read_text())
    import llama_cpp

    vocab = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
    close = vocab.tokenize(b"</think>", add_bos=False, special=True)
    ends = [t for t in range(vocab.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab._model.vocab, t)]
    never = {str(t): -100 for t in ends}  # (greedy, and no end: the reply runs to its length)
    with quipu_serve(home, model, tmp_path=tmp_path) as url:
        c = messages_client(url)
        asked = {"model": "", "max_tokens": 24, "messages": [{"role": "user", "content": "Why?"}],
                 "thinking": {"type": "enabled", "budget_tokens": 4}}
        whole = c.messages.create(**asked, extra_body={**GREEDY, "logit_bias": never})
        thought, said = whole.content
        assert thought.type == "thinking" and thought.thinking and said.type == "text" and said.text
        with c.messages.stream(**asked, extra_body={**GREEDY, "logit_bias": never}) as stream:
            events = [e.type for e in stream]
            streamed = stream.get_final_message()
        assert [b.type for b in streamed.content] == ["thinking", "text"] and "content_block_start" in events
        assert streamed.content[0].thinking == thought.thinking and streamed.content[1].text == said.text
        # reasoning off: no thinking block (the template closes the reasoning in the prompt)
        off = c.messages.create(**{**asked, "thinking": {"type": "disabled"}}, extra_body={**GREEDY, "logit_bias": never})
        assert [b.type for b in off.content] == ["text"]
        # the Responses API: a reasoning item before the message
        r = responses_client(url).responses.create(model="", input="Why?", max_output_tokens=24, temperature=0,
                                                   reasoning={"effort": "low"}, store=False)
        assert r.output[0].type == "reasoning" and r.output[0].content[0].text
    assert close  # (the model's markup is its own tokens)


def test_a_reply_is_held_to_the_schema_either_api_gives(home, tiny_model, tmp_path):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    with quipu_serve(home, tiny_model, tmp_path=tmp_path) as url:
        r = responses_client(url).responses.create(
            model="", input="A number.", max_output_tokens=40, store=False,
            text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
        jsonschema.validate(json.loads(r.output_text), schema)
        m = messages_client(url).messages.create(model="", max_tokens=40, messages=[{"role": "user", "content": "A number."}],
                                                 output_config={"format": {"type": "json_schema", "schema": schema}})
        jsonschema.validate(json.loads(m.content[0].text), schema)


def test_a_responses_request_again_is_answered_and_one_not_stored_keeps_nothing(quipu, home, tiny_model, tmp_path):
    import threading

    def logged() -> int:
        r = quipu("logs", "list", "--json", "-n", "1000")
        return len(r.stdout.decode().strip().splitlines()) if r.returncode == 0 else 0

    with quipu_serve(home, tiny_model, "--ctx", "16384", tmp_path=tmp_path) as url:
        c = responses_client(url)
        one = greedy_response(c, input=QUESTIONS[0])
        # the same request again (a retry after a lost reply, a regeneration): answered, as the first was
        two = greedy_response(c, input=QUESTIONS[1], previous_response_id=one.id)
        again = greedy_response(c, input=QUESTIONS[1], previous_response_id=one.id)
        assert again.output_text == two.output_text and again.id != two.id
        # and two of them at once
        answers: list = []
        threads = [threading.Thread(target=lambda: answers.append(greedy_response(
            c, input=QUESTIONS[1], previous_response_id=one.id))) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [a.output_text for a in answers] == [two.output_text] * 2
        for a in answers:  # (each kept once its client has it: asked for, it is waited for)
            assert c.responses.retrieve(a.id).status == a.status
        # a response not stored changes nothing on disk: the session's branch, the log of answers
        sessions = home / "data" / "sessions"
        before = {p.name: p.read_bytes() for p in sessions.iterdir() if p.suffix != ".lock"}
        count = logged()
        off = greedy_response(c, input=QUESTIONS[2], previous_response_id=one.id, store=False)
        assert off.output_text and logged() == count
        assert {p.name: p.read_bytes() for p in sessions.iterdir() if p.suffix != ".lock"} == before
        # the conversation goes on from the response last kept, as before
        assert greedy_response(c, input=QUESTIONS[2], previous_response_id=again.id).output_text


def test_a_response_s_input_is_listed_in_pages_and_one_being_made_is_said_so_at_once(home, tiny_model, tmp_path):
    with quipu_serve(home, tiny_model, "--ctx", "16384", tmp_path=tmp_path) as url:
        c = responses_client(url)
        items = [{"role": "user", "content": q} for q in QUESTIONS]
        r = c.responses.create(model="", input=items, max_output_tokens=4)
        listed = c.responses.input_items.list(r.id)  # (the last first, as OpenAI's, 20 at most)
        assert [i.content[0].text for i in listed.data] == QUESTIONS[::-1] and not listed.has_more
        first = c.responses.input_items.list(r.id, limit=2, order="asc")
        assert [i.content[0].text for i in first.data] == QUESTIONS[:2] and first.has_more
        rest = c.responses.input_items.list(r.id, limit=2, order="asc", after=first.data[-1].id)
        assert [i.content[0].text for i in rest.data] == QUESTIONS[2:] and not rest.has_more
        assert httpx.get(f"{url}/v1/responses/{r.id}/input_items?limit=0", timeout=30).status_code == 400
        assert httpx.get(f"{url}/v1/responses/{r.id}/input_items?after=nothing", timeout=30).status_code == 400
        # a response being made (here: its long prompt read) is said so at once, however many ask, and
        # none of them holds a place the listing routes share
        with c.responses.stream(model="", input="word " * 2000, max_output_tokens=4) as stream:
            created = next(iter(stream))
            assert created.type == "response.created"
            ident = created.response.id
            for _ in range(6):
                shown = httpx.get(f"{url}/v1/responses/{ident}", timeout=30)
                assert shown.status_code == 200 and shown.json()["status"] == "in_progress"
            assert httpx.get(url + "/v1/models", timeout=30).status_code == 200
            for _ in stream:
                pass
        assert c.responses.retrieve(ident).status in ("completed", "incomplete")


def test_a_responses_tool_loop_goes_on_as_the_same_conversation_sent_whole(home, bundled_model, tmp_path):
    tool = {"type": "function", **WEATHER["function"]}
    with quipu_serve(home, bundled_model, tmp_path=tmp_path) as url:
        c = responses_client(url)
        asked = {"model": "", "tools": [tool], "temperature": 0}
        one = c.responses.create(**asked, input="What is the weather in Rome?", tool_choice="required",
                                 max_output_tokens=40)
        [call] = [i for i in one.output if i.type == "function_call"]
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 degrees."}
        chained = c.responses.create(**asked, previous_response_id=one.id, input=[result], max_output_tokens=16)
        whole = c.responses.create(**asked, store=False, max_output_tokens=16, input=[
            {"role": "user", "content": "What is the weather in Rome?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            result])
    # (the kept call laid out as the client sends it back: the same prompt, the same answer)
    assert chained.usage.input_tokens == whole.usage.input_tokens
    assert chained.output_text == whole.output_text
