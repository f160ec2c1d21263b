"""`quipu serve`'s models: served by name, loaded one at a time and unloaded after their
keep-alive; their embeddings; images a model with a projector sees; eight clients at once."""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone

import httpx
import pytest

from servers import SYSTEM, ask, quipu_serve
from servers import openai_client as client

openai = pytest.importorskip("openai")


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
        loading = c.generate(model=bundled, prompt="Hi.", options=said)
        assert loading.model == bundled and loading.load_duration > 0  # (this request loaded it)
        assert c.generate(model=bundled, prompt="Hi.", options=said).load_duration == 0  # (loaded already)
        [running] = c.ps().models
        assert running.model == bundled and running.context_length > 0
        assert running.expires_at.year == datetime.now(timezone.utc).year  # (the config's hour, not for good)
        first = ask(client(url), [{"role": "user", "content": "Hi."}], max_tokens=4)  # (no model named: the first)
        assert first.model == tiny and [m.model for m in c.ps().models] == [tiny]
        shown = c.show(bundled)
        assert shown.details.family == "llama" and "im_start" in shown.template and "completion" in shown.capabilities
        # the server's own settings, as Ollama's parameters and a Modelfile that says the same
        assert "temperature 0.8" in shown.parameters.splitlines() and f"FROM {bundled_model}" in shown.modelfile
        assert "PARAMETER temperature 0.8" in shown.modelfile.splitlines()
        # each model's digest: the hash of its whole file, the same in every list, another for another file
        digests = {m.model: m.digest for m in c.list().models}
        assert len(digests[tiny]) == 32 and digests[tiny] != digests[bundled] and int(digests[bundled], 16) >= 0
        [now] = c.ps().models
        assert now.digest == digests[now.model]
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
        for bad, words in (([], "input must be"), ([1, 10**6], "not one of the model's"), (["ok", " "], "input[1] is empty"),
                           ([[1, 2], "a", 3], "input must be")):
            with pytest.raises(openai.BadRequestError, match=re.escape(words)):
                c.embeddings.create(model=got.model, input=bad)
        # a text's token ids are embedded as the text is (OpenAI's clients send them so)
        import llama_cpp

        vocab = llama_cpp.Llama(str(tiny_model), vocab_only=True, verbose=False)
        ids = [vocab.tokenize(t.encode(), add_bos=True, special=False) for t in texts]
        by_ids = c.embeddings.create(model=got.model, input=ids, encoding_format="float")
        assert by_ids.usage.prompt_tokens == got.usage.prompt_tokens == sum(map(len, ids))
        for vector, want in zip([d.embedding for d in by_ids.data], expected, strict=True):
            assert max(abs(x - y) for x, y in zip(vector, want, strict=True)) < 1e-5
        one = c.embeddings.create(model=got.model, input=ids[0], encoding_format="float").data
        assert len(one) == 1 and max(abs(x - y) for x, y in zip(one[0].embedding, expected[0], strict=True)) < 1e-5
        # Ollama's older route: one prompt, its vector as the model gives it (the same, not scaled)
        older = httpx.post(url + "/api/embeddings", json={"prompt": texts[0]}, timeout=60).json()["embedding"]
        norm = math.sqrt(sum(x * x for x in older))
        assert max(abs(x / norm - y) for x, y in zip(older, expected[0], strict=True)) < 1e-5
        assert httpx.post(url + "/api/embeddings", json={"prompt": ""}, timeout=60).status_code == 400


@pytest.mark.parametrize("parallel", [1, 2])
def test_an_image_in_a_message_is_seen_as_run_attaches_it(quipu, home, vision, tmp_path, parallel):
    import base64

    def data_url(name):
        return "data:image/png;base64," + base64.b64encode((vision / name).read_bytes()).decode()

    def looking_at(name):
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(name)}},
                                             {"type": "text", "text": "What is it?"}]}]

    with quipu_serve(home, vision / "tiny.gguf", "--parallel", parallel, tmp_path=tmp_path) as url:
        c = client(url)
        red = ask(c, looking_at("red.png"), max_tokens=12).choices[0].message.content
        blue = ask(c, looking_at("blue.png"), max_tokens=12).choices[0].message.content
        assert red != blue  # (the model sees the image)
        assert ask(c, looking_at("red.png"), max_tokens=12).choices[0].message.content == red
        if parallel > 1:  # (both at once: each image read with the context its own, between the other's tokens)
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(2) as pool:
                both = list(pool.map(lambda name: ask(client(url), looking_at(name), max_tokens=12)
                                     .choices[0].message.content, ["blue.png", "red.png"]))
            assert both == [blue, red]
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


@pytest.mark.parametrize("parallel", [1, 3, 8])
def test_eight_clients_at_once_get_the_answers_they_get_alone(home, bundled_model, tmp_path, parallel):
    # (one at a time; three decoded together while the others wait, each joining as one ends; or
    # all eight together: each conversation its own stream of cells, its tokens computed as alone)
    from concurrent.futures import ThreadPoolExecutor

    questions = [[{"role": "user", "content": f"What is the capital of {country}?"}]
                 for country in ("France", "Italy", "Spain", "Germany", "Japan", "Egypt", "Canada", "Peru")]
    with quipu_serve(home, bundled_model, "--parallel", parallel, tmp_path=tmp_path) as url:
        c = client(url)
        alone = [ask(c, q, max_tokens=10).choices[0].message.content for q in questions]
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda q: ask(client(url), q, max_tokens=10).choices[0].message.content,
                                     questions))
            streamed = list(pool.map(lambda q: "".join(
                chunk.choices[0].delta.content or "" for chunk in ask(client(url), q, max_tokens=10, stream=True)
                if chunk.choices), questions))
    assert together == alone and streamed == alone


def test_with_parallel_requests_each_conversation_keeps_its_context_in_memory(home, tiny_model, tmp_path):
    # (two conversations by turns, the disk cache kept to nothing: with two places, each goes on
    # from its own context, which the other's request left alone; with one, the other's took it)
    (home / "config").mkdir(exist_ok=True)
    (home / "config" / "config.toml").write_text("[cache]\nmax_bytes = 0\n")
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a river?"}]
    other = [{"role": "system", "content": SYSTEM.upper()}, {"role": "user", "content": "What is a hill?"}]
    cached = {}
    for parallel in (2, 1):
        with quipu_serve(home, tiny_model, "--parallel", parallel, tmp_path=tmp_path) as url:
            c = client(url)
            one = ask(c, first)
            ask(c, other)
            following = first + [{"role": "assistant", "content": one.choices[0].message.content},
                                 {"role": "user", "content": "And a lake?"}]
            cached[parallel] = ask(c, following).usage.prompt_tokens_details.cached_tokens
    read = one.usage.prompt_tokens + one.usage.completion_tokens
    assert read - 256 < cached[2] <= read and cached[1] == 0


def test_a_model_file_found_two_ways_is_listed_once(quipu, home, tiny_model, tmp_path):
    assert quipu("models", "add", str(tiny_model), "--name", "also-tiny").returncode == 0
    with quipu_serve(home, tiny_model, tmp_path=tmp_path) as url:
        names = [m.id for m in client(url).models.list().data]
        tags = [m["name"] for m in httpx.get(url + "/api/tags", timeout=30).json()["models"]]
        assert names.count("tiny") == 1 and "also-tiny" not in names and tags == names
        # (still a name a request may use)
        assert client(url).chat.completions.create(model="also-tiny", max_tokens=2,
                                                   messages=[{"role": "user", "content": "Hi."}]).model == "tiny"


def test_generate_gives_its_context_and_goes_on_from_it(home, bundled_model, tmp_path):
    def generate(url, **asked):
        r = httpx.post(url + "/api/generate", json={"stream": False, "options": {"num_predict": 12, "temperature": 0},
                                                    **asked}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    with quipu_serve(home, bundled_model, tmp_path=tmp_path) as url:
        one = generate(url, prompt="What is a river?")
        two = generate(url, prompt="And a lake?", context=one["context"])
        # the context after a reply begins with the one it went on from, and holds its prompt and reply
        assert two["context"][:len(one["context"])] == one["context"] and len(two["context"]) > len(one["context"])
        assert two["prompt_eval_count"] < len(two["context"]) - two["eval_count"]  # (the exchange before, kept)
        lines = [json.loads(line) for line in httpx.post(url + "/api/generate", json={
            "prompt": "And a lake?", "context": one["context"], "options": {"num_predict": 12, "temperature": 0}},
            timeout=120).text.splitlines()]
        assert "".join(line["response"] for line in lines) == two["response"]
        assert lines[-1]["context"] == two["context"] and "context" not in lines[0]
        for bad in ([10 ** 7], "no", [1.5], [True]):
            r = httpx.post(url + "/api/generate", json={"prompt": "x", "context": bad}, timeout=30)
            assert r.status_code == 400 and "context" in r.json()["error"]
        chat = httpx.post(url + "/api/chat", json={"stream": False, "messages": [{"role": "user", "content": "Hi."}],
                                                   "options": {"num_predict": 2}}, timeout=60).json()
        assert "context" not in chat
    # a server that never saw the first exchange goes on from its context as this one did
    with quipu_serve(tmp_path / "other", bundled_model, tmp_path=tmp_path) as url:
        again = generate(url, prompt="And a lake?", context=one["context"])
    assert again["response"] == two["response"] and again["context"] == two["context"]
