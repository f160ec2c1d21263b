"""Every feature with the model's layers on a GPU, for real: on a build of llama.cpp for a GPU (CI:
Vulkan on Mesa's software driver, lavapipe, `.ci/run`). On a build for the CPU alone these are
skipped, saying so; with QUIPU_REQUIRE_DEVICE=1 they fail instead.

A device's first use in a process compiles its pipelines (about a minute on lavapipe, on a loaded
machine): the tests keep to the tiny models, few tokens and few processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tinymodel import write_tiny_gguf

from quipu.engine.devices import offload_devices, supports_offload

pytestmark = pytest.mark.device

if not supports_offload():
    if os.environ.get("QUIPU_REQUIRE_DEVICE") == "1":
        raise RuntimeError("QUIPU_REQUIRE_DEVICE=1, and this llama.cpp offloads to no device (`quipu doctor` says why)")
    pytest.skip("this llama.cpp offloads to no device (CI runs these on a Vulkan build: .ci/run)",
                allow_module_level=True)

DEVICE = offload_devices()[0].name
SLOW = 900  # (seconds a process may take: a software device compiles its pipelines first)


def ok(r) -> dict:
    assert r.returncode == 0 and "Traceback" not in r.stderr.decode(), r.stderr.decode()
    return json.loads(r.stdout)


def run(quipu, model, *args, input=None, env=None):
    return quipu("run", "-m", model, "-t", "0", "-n", "6", "--json", *args, input=input, env=env, timeout=SLOW)


def chat(home, model, lines: str, *args) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    env["QUIPU_HOME"] = str(home)
    r = subprocess.run([sys.executable, "-m", "quipu", "chat", "-m", str(model), "-n", "6", *args],
                       input=lines.encode(), capture_output=True, env=env, timeout=SLOW)
    assert r.returncode == 0 and "Traceback" not in r.stderr.decode(), r.stderr.decode()
    return r.stdout.decode().splitlines()


def need(model_report: dict) -> int:
    """The bytes a placement takes on the device, as `quipu doctor` measures them."""
    share = model_report["placement"]["memory"][0]
    assert share["device"] == DEVICE
    return share["model_bytes"] + share["context_bytes"] + share["compute_bytes"]


def doctor_model(quipu, model, *args) -> dict:
    found = ok(quipu("doctor", "-m", model, "--ctx", "512", "--json", *args, timeout=SLOW))
    return found["model"]


def test_doctor_sees_the_device_and_what_each_layer_count_takes_there(quipu, vision):
    found = ok(quipu("doctor", "--json", timeout=SLOW))
    assert found["offload"] is True and found["gpu_backends"] and "install_gpu_build" not in found
    device = next(d for d in found["devices"] if d["name"] == DEVICE)
    assert device["kind"] in ("gpu", "igpu") and 0 < device["free_bytes"] <= device["total_bytes"]
    model = vision / "tiny.gguf"
    every = doctor_model(quipu, model, "-ngl", "all")
    assert every["all_on_gpu"] and every["placement"]["gpu_layers"] == every["placement"]["layers"] == 3
    host = every["placement"]["memory"][-1]
    assert host["device"] == "CPU" and host["layers"] == 0
    # Fewer layers, less on the device; the KV cache goes with its layers.
    one, two = doctor_model(quipu, model, "-ngl", "1"), doctor_model(quipu, model, "-ngl", "2")
    assert need(one) < need(two) < need(every)
    assert one["placement"]["memory"][0]["context_bytes"] == 0 < two["placement"]["memory"][0]["context_bytes"]
    assert "fits: every layer on the GPU" in quipu("doctor", "-m", model, "-ngl", "all", timeout=SLOW).stdout.decode()


def test_all_some_and_auto_layers_answer_and_say_where(quipu, vision, bundled_model):
    model = vision / "tiny.gguf"
    every = ok(run(quipu, model, "-ngl", "all", "hello"))
    assert every["placement"]["gpu_layers"] == 3 and every["placement"]["devices"] == [DEVICE]
    assert every["placement"]["summary"] == f"3/3 layers on {DEVICE}" and every["usage"]["completion_tokens"] > 0
    some = run(quipu, model, "-ngl", "2", "--stats", "hello")
    assert ok(some)["placement"]["gpu_layers"] == 2
    assert f"; on 2/3 layers on {DEVICE}, the rest on the CPU" in some.stderr.decode()
    auto = run(quipu, model, "--verbose", "hello")
    assert ok(auto)["placement"]["gpu_layers"] == 3  # (the default: as many as fit, here all)
    assert f"the model runs on 3/3 layers on {DEVICE}" in auto.stderr.decode()
    on_device = ok(run(quipu, bundled_model, "-ngl", "all", "-n", "12", "What is the capital of France?"))
    assert on_device["placement"]["gpu_layers"] == 31 and "Paris" in on_device["text"], on_device["text"]


def test_the_device_computes_what_the_cpu_computes(bundled_model):
    """The same prompt's next-token scores with every layer on the device and with none: the same
    ranking at the top, within the rounding of other kernels (a tiny model's greedy reply may still
    part ways where two tokens score within that rounding)."""
    import numpy as np

    from quipu.engine.settings import ContextSettings, Offload
    from quipu.engine.llama import LlamaBackend
    from quipu.engine.native import lc

    scores = []
    for where in (Offload(layers="all"), Offload(devices=("none",))):
        with LlamaBackend(bundled_model, ContextSettings(n_ctx=512), offload=where) as backend:
            assert backend.placement.on_device == (where.layers == "all")
            tokens = backend.vocab.tokenize("The capital of France is Paris. The capital of Italy is", add_special=True,
                                      parse_special=False)
            backend.prefill(tokens, 0)
            scores.append(np.ctypeslib.as_array(lc.llama_get_logits_ith(backend.native.ptr, -1),
                                                shape=(backend.n_vocab,)).copy())
    device, cpu = scores
    assert np.corrcoef(device, cpu)[0, 1] > 0.999
    assert int(np.argmax(device)) in np.argsort(cpu)[-3:]
    assert np.abs(device - cpu).max() < 0.05 * (cpu.max() - cpu.min())


def test_a_small_gpu_memory_takes_the_layers_that_fit_and_all_is_refused(quipu, vision):
    model = vision / "tiny.gguf"
    cap = need(doctor_model(quipu, model, "-ngl", "2")) + 1
    fitted = run(quipu, model, "--ctx", "512", "--gpu-memory", str(cap), "hello")
    assert ok(fitted)["placement"]["gpu_layers"] == 2
    said = fitted.stderr.decode().strip()
    assert said.startswith("quipu: warning: 2 of the model's 3 layers fit on") and "the rest run on the CPU" in said
    assert len(said.splitlines()) == 1, said
    # A session goes on where it ran while that still fits, though the device has more room now:
    # the same sums, bit for bit, and nothing to say.
    made = ok(run(quipu, model, "--ctx", "512", "--gpu-memory", str(cap), "-S", "tight", "hello"))
    resumed = run(quipu, model, "-S", "tight", "and then")
    assert made["placement"]["gpu_layers"] == 2 == ok(resumed)["placement"]["gpu_layers"]
    assert resumed.stderr == b"" and ok(resumed)["usage"]["cached_tokens"] > 0, resumed.stderr.decode()
    refused = run(quipu, model, "--ctx", "512", "--gpu-memory", str(cap), "-ngl", "all", "hello")
    err = refused.stderr.decode()
    assert refused.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("quipu: error: --gpu-layers all: 3 layers need") and "2 fit (--gpu-layers auto)" in err


def test_ctx_auto_keeps_every_layer_on_the_device_and_shrinks_the_context_to_fit(quipu, tmp_path):
    long = write_tiny_gguf(tmp_path / "long.gguf", n_ctx_train=65536)

    def auto(*args) -> dict:
        return ok(quipu("doctor", "-m", long, "--ctx", "auto", "--json", *args, timeout=SLOW))["model"]

    assert auto()["ctx"] == 65536 and auto()["all_on_gpu"]  # (room for it all)
    at_16k = ok(quipu("doctor", "-m", long, "--ctx", "16384", "-ngl", "all", "--json", timeout=SLOW))["model"]
    squeezed = auto("--gpu-memory", str(need(at_16k) + 1))
    assert 4096 <= squeezed["ctx"] <= 16384 and squeezed["all_on_gpu"], squeezed
    r = run(quipu, long, "--ctx", "auto", "--gpu-memory", str(need(at_16k) + 1), "hello")
    assert ok(r)["placement"]["gpu_layers"] == 3 and r.stderr == b"", r.stderr.decode()


def test_a_session_on_the_device_resumes_exactly_and_undo_goes_back_exactly(quipu, vision, home):
    model = vision / "tiny.gguf"
    first = ok(run(quipu, model, "-ngl", "all", "-S", "gpu", "--seed", "3", "-t", "0.9", "hello there"))
    second = ok(run(quipu, model, "-ngl", "all", "-S", "gpu", "--seed", "3", "-t", "0.9", "and then"))
    assert second["usage"]["cached_tokens"] >= first["usage"]["prompt_tokens"]  # (restored, not read again)
    whole = chat(home, model, "hello there\nand then\n", "-ngl", "all", "-S", "whole", "--seed", "3", "-t", "0.9")
    assert whole[:2] == [first["text"], second["text"]]
    # /undo takes the context back exactly: the reply after it is the one that had no detour.
    straight = chat(home, model, "hello there\nand then\n", "-ngl", "all", "-S", "straight", "-t", "0")
    undone = chat(home, model, "hello there\nsomething else\n/undo\nand then\n", "-ngl", "all", "-S", "undo",
                  "-t", "0")
    assert undone[0] == straight[0] and undone[-1] == straight[-1]
    # A fork goes on as its source does.
    assert quipu("sessions", "fork", "gpu", "gpu-b").returncode == 0
    a = ok(run(quipu, model, "-ngl", "all", "-S", "gpu", "more"))
    b = ok(run(quipu, model, "-ngl", "all", "-S", "gpu-b", "more"))
    assert a["text"] == b["text"] and b["usage"]["cached_tokens"] > 0


def test_a_hybrid_session_on_the_device_keeps_its_recurrent_state_apart_and_resumes_exactly(quipu, home, tmp_path):
    # Qwen 3.5's architecture (Gated DeltaNet and attention) on the device: the second turn, in a
    # new process, restores the cells and the recurrent state read back from the device, and the
    # session says what one chat says.
    from pathlib import Path

    from tinymodel import write_tiny_qwen35

    template = (Path(__file__).parent / "templates" / "Qwen3.5-4B.jinja").read_text()
    model = write_tiny_qwen35(tmp_path / "qwen35.gguf", chat_template=template)
    first = ok(run(quipu, model, "-ngl", "all", "-S", "gpu", "Tell me of the sky and the world."))
    second = ok(run(quipu, model, "-ngl", "all", "-S", "gpu", "And is the world blue?"))
    assert second["usage"]["cached_tokens"] > 0 and second["placement"]["gpu_layers"] > 0
    assert sorted(p.name for p in (home / "data" / "sessions").glob("gpu.kvr*")) == ["gpu.kvr0", "gpu.kvr1"]
    whole = chat(home, model, "Tell me of the sky and the world.\nAnd is the world blue?\n", "-ngl", "all", "-S",
                 "whole", "-t", "0")
    saved = {n: json.loads((home / "data" / "sessions" / f"{n}.json").read_text())["tokens"] for n in ("gpu", "whole")}
    assert saved["gpu"] == saved["whole"], (first, second, whole)


def test_a_session_moved_from_the_device_to_the_cpu_says_so_and_goes_on(quipu, vision, home):
    model = vision / "tiny.gguf"
    ok(run(quipu, model, "-ngl", "all", "-S", "laptop", "hello"))
    moved = run(quipu, model, "--device", "none", "-S", "laptop", "and then")
    answer = ok(moved)
    assert answer["usage"]["cached_tokens"] > 0 and answer["placement"]["gpu_layers"] == 0
    err = moved.stderr.decode().strip()
    assert err == (f"quipu: warning: session 'laptop' was saved running on 3 layers on {DEVICE} and now runs on the "
                   "CPU: its context is restored, but from here the reply is no longer bit for bit what it would have "
                   "been there"), err
    assert run(quipu, model, "--device", "none", "-S", "laptop", "more").stderr == b""


def test_the_prompt_cache_a_batch_a_schema_and_embeddings_on_the_device(quipu, vision):
    model = vision / "tiny.gguf"
    document = "the sea and the sky " * 40
    cold = ok(run(quipu, model, "-ngl", "all", "Summarize:", input=document))
    warm = ok(run(quipu, model, "-ngl", "all", "Summarize:", input=document))
    assert warm["usage"]["cached_tokens"] > 0 and warm["text"] == cold["text"]
    r = quipu("run", "-m", model, "-ngl", "all", "-n", "6", "--seed", "5", "--batch", "-", "--parallel", "2",
              input="hello world\nthe sky\n", timeout=SLOW)
    rows = [json.loads(line) for line in r.stdout.decode().splitlines()]
    assert r.returncode == 0 and [row["index"] for row in rows] == [0, 1], r.stderr.decode()
    assert all(row["placement"]["gpu_layers"] == 3 for row in rows)
    schema = '{"type":"object","properties":{"n":{"type":"integer"}},"required":["n"],"additionalProperties":false}'
    shaped = ok(run(quipu, model, "-ngl", "all", "-n", "24", "--schema", schema, "a number"))
    if shaped["finish_reason"] == "stop":
        assert isinstance(json.loads(shaped["text"])["n"], int)
    else:
        assert shaped["text"].startswith('{"n":')
    vectors = quipu("embed", "-m", model, "-ngl", "all", "one", "two", timeout=SLOW)
    assert vectors.returncode == 0, vectors.stderr.decode()
    found = [json.loads(line)["embedding"] for line in vectors.stdout.decode().splitlines()]
    assert len(found) == 2 and found[0] != found[1] and len(found[0]) == 128


def test_an_image_is_seen_through_a_projector_on_the_device(quipu, vision):
    model = vision / "tiny.gguf"
    red = run(quipu, model, "-ngl", "all", "--verbose", "-a", vision / "red.png", "What is it?")
    blue = ok(run(quipu, model, "-ngl", "all", "-a", vision / "blue.png", "What is it?"))
    assert ok(red)["text"] != blue["text"]
    log = red.stderr.decode()
    assert "CLIP using" in log and "CLIP using CPU" not in log, log[-2000:]
