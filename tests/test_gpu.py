"""Where a model runs, as a user on any build sees it: `quipu doctor`, the fit's arithmetic on a
real model's tensor table, and --gpu-layers, --gpu-memory and --device (with their config keys and
environment variables) on a build for the CPU alone, which is what most of these tests run on.
The same options on a real GPU build are `test_device.py`'s."""

from __future__ import annotations

import json
import sys

import pytest

from quipu.engine.settings import parse_layers, parse_size
from quipu.engine.devices import supports_offload
from quipu.errors import UsageError

cpu_only = pytest.mark.skipif(supports_offload(), reason="this llama.cpp is built for a GPU: test_device.py's")


def one_line_error(r, code: int = 2) -> str:
    err = r.stderr.decode()
    assert r.returncode == code, (r.returncode, err)
    assert err.startswith("quipu: error: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_doctor_says_what_this_machine_has_and_where_files_go(quipu, home):
    r = quipu("doctor", "--json")
    assert r.returncode == 0, r.stderr.decode()
    found = json.loads(r.stdout)
    from importlib.metadata import version

    assert found["versions"]["llama_cpp_python"] == version("llama_cpp_python")
    assert found["versions"]["quipu"] and found["versions"]["llama_cpp"]
    assert "CPU" in found["backends"]
    cpu = [d for d in found["devices"] if d["kind"] == "cpu"]
    assert len(cpu) == 1 and 0 < cpu[0]["free_bytes"] <= cpu[0]["total_bytes"]
    assert found["dirs"]["sessions"].startswith(str(home))
    threads = found["threads"]  # (what quipu would start a context with now, the load counted)
    assert 1 <= threads["now"] <= threads["most"] <= threads["cpus"]
    text = quipu("doctor").stdout.decode()
    assert f"llama-cpp-python {found['versions']['llama_cpp_python']}" in text and str(home) in text
    assert f"threads: up to {threads['most']} (one a physical core of {threads['cpus']} CPUs)" in text


@cpu_only
def test_on_a_cpu_build_doctor_gives_the_one_command_for_each_gpu_backend(quipu):
    found = json.loads(quipu("doctor", "--json").stdout)
    assert found["gpu_backends"] == [] and found["offload"] is False
    commands = {row["backend"]: row["command"] for row in found["install_gpu_build"]}
    # (the backends of this system: Metal on a Mac alone)
    assert set(commands) == ({"Metal"} if sys.platform == "darwin" else {"CUDA", "Vulkan", "ROCm"})
    for backend, flag in (("CUDA", "GGML_CUDA"), ("Metal", "GGML_METAL"), ("Vulkan", "GGML_VULKAN"),
                          ("ROCm", "GGML_HIP")):
        if backend not in commands:
            continue
        # Into the Python quipu runs in, the version it needs, built afresh (not pip's cached CPU wheel).
        assert f'CMAKE_ARGS="-D{flag}=on" {sys.executable} -m pip install' in commands[backend]
        assert "--no-cache-dir" in commands[backend] and found["versions"]["llama_cpp_python"] in commands[backend]
    text = quipu("doctor").stdout.decode()
    assert "built for the CPU alone" in text and all(command in text for command in commands.values())
    assert ("Metal" in text) == (sys.platform == "darwin")


def test_doctor_says_what_a_model_would_take_and_the_cache_grows_with_the_context(quipu, tiny_model):
    def share(ctx):
        r = quipu("doctor", "-m", tiny_model, "--ctx", ctx, "--json")
        assert r.returncode == 0, r.stderr.decode()
        model = json.loads(r.stdout)["model"]
        assert model["ctx"] == ctx and model["host_fits"] is True
        placement = model["placement"]
        assert placement["layers"] == 3  # (two blocks and the output layer)
        return placement["memory"][-1]

    small, large = share(512), share(1024)
    assert small["device"] == "CPU" and small["free_bytes"] > 0
    assert 0 < small["model_bytes"] == large["model_bytes"] < tiny_model.stat().st_size
    assert large["context_bytes"] == 2 * small["context_bytes"] > 0
    assert small["compute_bytes"] > 0  # (measured as llama.cpp plans the context, nothing allocated)
    text = quipu("doctor", "-m", tiny_model, "--ctx", "512").stdout.decode()
    assert "a context of 512 tokens, on the CPU" in text and "KV cache" in text


def test_the_cache_a_layer_keeps_is_what_llama_cpp_allocates(tiny_model, make_backend):
    """The fit's figure for the KV cache against the bytes of a real context's state."""
    from quipu.engine.placement import layer_sizes, read_table

    layers = layer_sizes(read_table(tiny_model), 512, "f16")
    backend = make_backend(n_ctx=512)
    tokens = backend.vocab.tokenize("a b c d e f g h", add_special=False, parse_special=False)
    backend.prefill(tokens, 0)
    n = len(tokens)
    state = len(backend.memory.snapshot_bytes())
    # A state holds each cell's K and V rows of every block (and a small header per cell and layer).
    per_cell = sum(layers.caches) / 512
    assert per_cell * n <= state < per_cell * n + 4096


def test_the_fit_puts_the_output_layer_first_then_the_last_blocks():
    from quipu.engine.placement import Layers

    layers = Layers(weights=(100, 100, 100, 100), caches=(10, 10, 10, 10), output=50, embed=40, tied=True)
    assert layers.count == 5
    assert [layers.on_device(k) for k in range(6)] == [0, 90, 200, 310, 420, 530, ][:6]
    assert layers.most_that_fit(89) == 0 and layers.most_that_fit(90) == 1 and layers.most_that_fit(309) == 2
    assert layers.most_that_fit(10**9) == 5


def test_sizes_and_layer_counts_are_read_as_people_write_them():
    assert parse_layers("auto") == "auto" and parse_layers("ALL") == "all" and parse_layers("33") == 33
    assert parse_size("512M") == 512 << 20 and parse_size("6G") == 6 << 30 and parse_size("1.5GiB") == 3 << 29
    assert parse_size("1000") == 1000
    for bad in ("-1", "x", "1.5", "auto9", ""):
        with pytest.raises(UsageError):
            parse_layers(bad)
    for bad in ("0", "5Q", "-2G", "G", "1e9"):
        with pytest.raises(UsageError):
            parse_size(bad)


@cpu_only
def test_on_a_cpu_build_layers_asked_for_are_said_once_and_auto_is_silent(quipu, tiny_model, home):
    # (a count of layers, as scripts carry `-ngl 99` for llama.cpp, which warns and runs on the CPU:
    # so does quipu; `all`, every layer or a refusal, and a device by name are refused)
    base = ("run", "-m", tiny_model, "-t", "0", "-n", "4")
    plain = quipu(*base, "--json", "hi")
    for layers in ("5", "99"):
        r = quipu(*base, "--json", "-ngl", layers, "hi")
        err = r.stderr.decode()
        assert r.returncode == 0 and err.count("\n") == 1 and "quipu: warning:" in err, err
        assert f"--gpu-layers {layers}: this llama.cpp is built for the CPU alone" in err and "running on the CPU" in err
        assert json.loads(r.stdout)["text"] == json.loads(plain.stdout)["text"]
    err = one_line_error(quipu(*base, "-ngl", "all", "hi"))
    assert "--gpu-layers all: this llama.cpp is built for the CPU alone" in err and "quipu doctor" in err
    err = one_line_error(quipu(*base, "--device", "CUDA0", "hi"))
    assert "--device CUDA0" in err and "built for the CPU alone" in err
    for args in (("-ngl", "auto"), ("--gpu-layers", "0"), ("--device", "none"), ("--gpu-memory", "1G")):
        r = quipu(*base, "--json", *args, "hi")
        assert r.returncode == 0 and r.stderr == b"", r.stderr.decode()
        assert json.loads(r.stdout)["text"] == json.loads(plain.stdout)["text"]
    shown = json.loads(plain.stdout)["placement"]
    assert shown["backend"] == "CPU" and shown["gpu_layers"] == 0 and shown["summary"] == "the CPU"
    stats = quipu(*base, "--stats", "hi").stderr.decode()
    assert stats.strip().endswith("; on the CPU")
    # The environment and the config say it too, the command line over both.
    err = one_line_error(quipu(*base, "hi", env={"QUIPU_GPU_LAYERS": "all"}))
    assert "--gpu-layers all" in err
    assert quipu(*base, "-ngl", "auto", "hi", env={"QUIPU_GPU_LAYERS": "all"}).returncode == 0
    config = home / "config" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text("[generation]\ngpu_layers = 12\n")
    assert "--gpu-layers 12" in quipu(*base, "hi").stderr.decode()
    shown = json.loads(quipu("config", "show", "--json").stdout)
    assert shown["generation.gpu_layers"]["value"] == 12 and "config" in shown["generation.gpu_layers"]["source"]
    assert quipu(*base, "-ngl", "0", "hi").returncode == 0


def test_bad_values_are_one_line_wherever_they_are_given(quipu, tiny_model, home):
    base = ("run", "-m", tiny_model, "-n", "2")
    assert "--gpu-layers takes a number of layers, auto or all, not 'lots'" in one_line_error(
        quipu(*base, "-ngl", "lots", "hi"))
    assert "--gpu-memory takes a size" in one_line_error(quipu(*base, "--gpu-memory", "5Q", "hi"))
    assert "--gpu-memory takes a size" in one_line_error(quipu(*base, "hi", env={"QUIPU_GPU_MEMORY": "much"}))
    assert "--device takes device names" in one_line_error(quipu(*base, "--device", ",", "hi"))
    config = home / "config" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text("[generation]\ntemperature = 0.5\ngpu_memory = \"lots\"\n")
    err = one_line_error(quipu(*base, "hi"))
    assert f"{config}, line 3" in err and "gpu_memory takes a size" in err
    config.write_text("[generation]\ngpu_layers = [1]\n")
    assert "gpu_layers must be a string or a whole number" in one_line_error(quipu(*base, "hi"))


def test_ngl_is_its_own_option_not_n_with_a_value(monkeypatch, home):
    """llama.cpp's spelling: `-ngl 99` is the layers, never `-n gl99`."""
    from quipu.cli import spec
    from quipu.cli.run import PARAMS

    given = spec.parse(PARAMS, ["-ngl", "99", "-n", "5", "x"])
    assert given is not None and given["gpu_layers"] == "99" and given["max_tokens"] == 5


def test_a_session_from_a_gpu_box_resumes_here_and_says_it_is_no_longer_bit_for_bit(quipu, tiny_model, home):
    """A session's files copied from a machine where it ran on a GPU: its state bytes are the same
    on every device, so its context is restored, with one line that says the sums are now made
    elsewhere; the next save records where it runs now."""
    def turn(prompt):
        r = quipu("run", "-m", tiny_model, "-t", "0", "-n", "4", "--json", "-S", "moved", prompt)
        assert r.returncode == 0, r.stderr.decode()
        return r, json.loads(r.stdout)

    first, _ = turn("hi")
    assert first.stderr == b""
    path = home / "data" / "sessions" / "moved.json"
    record = json.loads(path.read_text())
    here = record["model"]["placement"]
    if not supports_offload():
        assert here == {"backend": "CPU", "devices": [], "gpu_layers": 0}
    record["model"]["placement"] = {"backend": "CUDA", "devices": ["CUDA0"], "gpu_layers": 3}
    path.write_text(json.dumps(record))
    moved, answer = turn("and then?")
    err = moved.stderr.decode().strip()
    now = f"{here['gpu_layers']} layers on {', '.join(here['devices'])}" if here["gpu_layers"] else "the CPU"
    assert err == (f"quipu: warning: session 'moved' was saved running on 3 layers on CUDA0 and now runs on {now}: "
                   "its context is restored, but from here the reply is no longer bit for bit what it would have "
                   "been there"), err
    assert answer["usage"]["cached_tokens"] > 0  # (restored, not read again)
    assert json.loads(path.read_text())["model"]["placement"] == here
    again, _ = turn("more")
    assert again.stderr == b""


def test_ctx_auto_takes_the_whole_training_length_where_memory_allows(quipu, tmp_path, home):
    from tinymodel import write_tiny_gguf

    long = write_tiny_gguf(tmp_path / "long.gguf", n_ctx_train=32768)
    found = json.loads(quipu("doctor", "-m", long, "--ctx", "auto", "--json").stdout)["model"]
    assert found["ctx"] == 32768 and found["host_fits"]
    assert json.loads(quipu("doctor", "-m", long, "--json").stdout)["model"]["ctx"] == 4096  # (the default)
    r = quipu("run", "-m", long, "--ctx", "auto", "-n", "2", "-S", "long", "hi")
    assert r.returncode == 0, r.stderr.decode()
    record = json.loads((home / "data" / "sessions" / "long.json").read_text())
    assert record["context"]["n_ctx"] == 32768
    # The config says it as the command line does; a batch, which shares its context out, refuses it.
    config = home / "config" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text('[generation]\nctx = "auto"\n')
    assert json.loads(quipu("doctor", "-m", long, "--json").stdout)["model"]["ctx"] == 32768
    err = one_line_error(quipu("run", "-m", long, "--batch", "-", input="hi\n"))
    assert "--ctx auto" in err and "--ctx N" in err
    config.write_text('[generation]\nctx = "most"\n')
    assert "ctx takes a number of tokens or auto, not 'most'" in one_line_error(quipu("run", "-m", long, "hi"))
