"""`quipu models pull`, `-m hf:...` and `models rm` against a Hub on loopback (tests/hub_server.py)
speaking the part of the Hub's API that `huggingface_hub` uses, serving GGUF files made here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hub_server import start_hub
from limits import small_filesystem
from tinymodel import write_tiny_gguf, write_tiny_projector

LARGE = b"GGUF" + bytes(range(256)) * (96 * 1024)  # 24 MB: a GGUF's magic, then bytes (never loaded)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("hubfiles")
    write_tiny_gguf(d / "tiny.gguf")
    write_tiny_gguf(d / "other.gguf", seed=3)
    write_tiny_gguf(d / "big.gguf", split_max_tensors=8)
    write_tiny_projector(d / "mmproj.gguf")
    return {
        "mmproj": (d / "mmproj.gguf").read_bytes(),
        "q4": (d / "tiny.gguf").read_bytes(),
        "q8": (d / "other.gguf").read_bytes(),
        "parts": [(d / f"big-0000{i}-of-00003.gguf").read_bytes() for i in (1, 2, 3)],
    }


@pytest.fixture
def hub(files):
    server = start_hub({
        "tiny/Tiny-GGUF": {"README.md": b"# tiny", "tiny-Q4_K_M.gguf": files["q4"], "tiny-Q8_0.gguf": files["q8"],
                           "chat_template.jinja": b"{% for m in messages %}{{ m.content }}\n{% endfor %}"},
        "tiny/Vision-GGUF": {"tiny-Q4_K_M.gguf": files["q4"], "mmproj-tiny-Q8_0.gguf": files["mmproj"],
                             "mmproj-tiny-f16.gguf": files["mmproj"]},
        "tiny/Split-GGUF": {f"split-Q8_0-0000{i}-of-00003.gguf": part for i, part in enumerate(files["parts"], 1)},
        "tiny/NoGGUF": {"README.md": b"# nothing", "model.safetensors": b"\0" * 16},
        "tiny/Gated-GGUF": {"gated-Q4_K_M.gguf": files["q4"]},
        "tiny/Fake-GGUF": {"fake-Q4_K_M.gguf": b"this is not a model at all" * 10},
        # Larger than the client's 10 MB chunks, so that a cut download has written some of it.
        "tiny/Large-GGUF": {"large-Q4_K_M.gguf": LARGE},
    })
    server.gated.add("tiny/Gated-GGUF")
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()


@pytest.fixture
def hub_env(hub, home, tmp_path):
    return {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "hf-cache"), "HF_HUB_DISABLE_XET": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1", "HF_TOKEN": ""}


def cached_blobs(env) -> list:
    from pathlib import Path

    return sorted(p for p in Path(env["HF_HUB_CACHE"]).rglob("blobs/*"))


def test_pull_then_run_by_its_hub_name(quipu, hub, hub_env):
    r = quipu("models", "pull", "tiny/Tiny-GGUF", env=hub_env)
    assert r.returncode == 0, r.stderr.decode()
    err = r.stderr.decode()
    assert r.stdout == b""  # nothing on stdout
    assert "Q4_K_M" in err and "Q8_0" in err  # the default pick, and the others said
    # In the Hub's own cache layout: the Hub's client finds it without the network.
    code = ("import huggingface_hub, sys; p = huggingface_hub.try_to_load_from_cache('tiny/Tiny-GGUF', "
            "'tiny-Q4_K_M.gguf'); print(p)")
    found = subprocess.run([sys.executable, "-c", code], env={**os.environ, **hub_env}, capture_output=True)
    assert found.stdout.decode().strip().endswith("tiny-Q4_K_M.gguf")
    listed = json.loads(quipu("models", "list", "--json", env=hub_env).stdout)
    mine = [m for m in listed if m["name"] == "tiny/Tiny-GGUF/tiny-Q4_K_M"]
    assert mine and mine[0]["source"] == "huggingface (pulled by quipu)"
    out = quipu("run", "-m", "hf:tiny/Tiny-GGUF:Q4_K_M", "-n", "3", "--json", "hi", env=hub_env)
    assert out.returncode == 0, out.stderr.decode()
    # Pulled again: nothing is downloaded.
    asked = len(hub.ranges)
    again = quipu("models", "pull", "tiny/Tiny-GGUF:q4_k_m", env=hub_env)
    assert again.returncode == 0 and len(hub.ranges) == asked
    # The repository's chat template differs from the file's: models info offers it.
    info = json.loads(quipu("models", "info", "hf:tiny/Tiny-GGUF:Q4_K_M", "--json", env=hub_env).stdout)
    assert info["repository_template"] and info["repository_template"].endswith("chat_template.jinja")


def test_a_pull_brings_the_model_s_projector_and_it_sees(quipu, hub, hub_env, tmp_path):
    from PIL import Image

    r = quipu("models", "pull", "tiny/Vision-GGUF", env=hub_env)
    assert r.returncode == 0, r.stderr.decode()
    assert "and its projector mmproj-tiny-f16.gguf" in r.stderr.decode()  # (f16 before Q8_0, as llama.cpp's -hf)
    info = json.loads(quipu("models", "info", "hf:tiny/Vision-GGUF", "--json", env=hub_env).stdout)
    assert info["media"] == ["image"] and info["projector"].endswith("mmproj-tiny-f16.gguf")
    Image.new("RGB", (50, 40), (200, 30, 90)).save(tmp_path / "red.png")
    seen = quipu("run", "-m", "hf:tiny/Vision-GGUF", "-t", "0", "-n", "8", "-a", tmp_path / "red.png", "What?",
                 env=hub_env)
    blind = quipu("run", "-m", "hf:tiny/Vision-GGUF", "-t", "0", "-n", "8", "What?", env=hub_env)
    assert seen.returncode == 0 and blind.returncode == 0, seen.stderr.decode()
    assert seen.stdout != blind.stdout
    assert quipu("models", "rm", "tiny/Vision-GGUF:Q4_K_M", env=hub_env).returncode == 0
    assert cached_blobs(hub_env) == []  # (the projector went with its model)


def test_hf_names_are_pulled_on_first_use(quipu, hub, hub_env):
    r = quipu("run", "-m", "hf:tiny/Tiny-GGUF:Q8_0", "-n", "2", "--json", "hi", env=hub_env)
    assert r.returncode == 0, r.stderr.decode()
    assert "pulling tiny/Tiny-GGUF Q8_0" in r.stderr.decode() and json.loads(r.stdout)["text"] is not None


def test_a_split_model_is_fetched_whole_and_loads_as_one(quipu, hub, hub_env):
    r = quipu("models", "pull", "tiny/Split-GGUF", env=hub_env)
    assert r.returncode == 0, r.stderr.decode()
    assert len(cached_blobs(hub_env)) == 3
    listed = [m["name"] for m in json.loads(quipu("models", "list", "--json", env=hub_env).stdout)]
    assert [n for n in listed if n.startswith("tiny/Split-GGUF/")] == ["tiny/Split-GGUF/split-Q8_0-00001-of-00003"]
    out = quipu("run", "-m", "hf:tiny/Split-GGUF", "-n", "2", "--json", "hi", env=hub_env)
    assert out.returncode == 0, out.stderr.decode()


@pytest.mark.parametrize("ref, code, words", [
    ("tiny/Nope-GGUF", 2, "no model repository 'tiny/Nope-GGUF'"),
    ("tiny/NoGGUF", 2, "has no GGUF file"),
    ("tiny/Tiny-GGUF:IQ2_XXS", 2, "has no IQ2_XXS file; it has Q4_K_M, Q8_0"),
    ("tiny/Gated-GGUF", 1, "is gated"),
    ("not a repo", 2, "is not a Hub model"),
    ("tiny/Fake-GGUF", 1, "is not a GGUF file; it was removed"),
])
def test_what_goes_wrong_is_one_line(quipu, hub, hub_env, ref, code, words):
    r = quipu("models", "pull", ref, env=hub_env)
    err = r.stderr.decode()
    assert r.returncode == code and words in err and "Traceback" not in err, err
    lines = err.strip().splitlines()  # what would be fetched, said before it is, then one line of error
    assert [line for line in lines if not line.startswith("pulling ")] == [f"quipu: error: {lines[-1][14:]}"], err
    if "Fake" in ref:
        assert cached_blobs(hub_env) == []  # nothing left that could be read as a model


def test_a_gated_model_with_a_token(quipu, hub, hub_env):
    r = quipu("models", "pull", "tiny/Gated-GGUF", env={**hub_env, "HF_TOKEN": hub.token})
    assert r.returncode == 0, r.stderr.decode()
    assert len(cached_blobs(hub_env)) == 1


def test_no_network_says_where_it_looked(quipu, hub_env):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = quipu("models", "pull", "tiny/Tiny-GGUF", env={**hub_env, "HF_ENDPOINT": f"http://127.0.0.1:{port}"})
    err = r.stderr.decode()
    assert r.returncode == 1 and "cannot reach the Hub" in err and "HF_ENDPOINT" in err and ".gguf" in err, err


def test_a_wrong_checksum_is_removed_and_said(quipu, hub, hub_env):
    hub.corrupt = True
    r = quipu("models", "pull", "tiny/Tiny-GGUF", env=hub_env)
    err = r.stderr.decode()
    assert r.returncode == 1 and "does not match the Hub's checksum" in err, err
    assert cached_blobs(hub_env) == []
    hub.corrupt = False
    assert quipu("models", "pull", "tiny/Tiny-GGUF", env=hub_env).returncode == 0


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM"])
def test_an_interrupted_pull_goes_on_where_it_stopped(hub, hub_env, home, how):
    hub.stall_at = 15 << 20  # past the first 10 MB chunk, which the client has written by then
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ.update(QUIPU_HOME=str(home), **hub_env)
    pull = [sys.executable, "-m", "quipu", "models", "pull", "tiny/Large-GGUF"]
    # (born with Ctrl-C heard, as from a terminal, whatever this process was started with: a
    # script's background job, the suite run by one, has SIGINT ignored, and its children with it)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(pull, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert hub.stalled.wait(60)  # 15 MB sent, and the server holds the rest back
    deadline = time.monotonic() + 60  # (the client writes what came at its own pace: waited for, not timed)
    while time.monotonic() < deadline and not any(
            p.name.endswith(".incomplete") and p.stat().st_size >= 10 << 20 for p in cached_blobs(hub_env)):
        time.sleep(0.05)
    proc.send_signal(getattr(signal, how))  # Ctrl-C, or told to end
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    [partial] = [p for p in cached_blobs(hub_env) if p.name.endswith(".incomplete")]
    kept = partial.stat().st_size
    assert kept >= 10 << 20  # what had come is kept
    hub.release.set()
    hub.stall_at = None
    r = subprocess.run(pull, env=environ, capture_output=True, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr.decode()
    assert f"bytes={kept}-" in hub.ranges  # and only the rest was asked for
    [blob] = cached_blobs(hub_env)
    assert blob.read_bytes() == LARGE


def test_rm_removes_what_was_pulled_and_nothing_else(quipu, hub, hub_env, tiny_model):
    assert quipu("models", "pull", "tiny/Tiny-GGUF:Q8_0", env=hub_env).returncode == 0
    refused = quipu("models", "rm", str(tiny_model), env=hub_env)
    assert refused.returncode == 2 and "not a model quipu pulled" in refused.stderr.decode()
    assert tiny_model.exists()
    r = quipu("models", "rm", "tiny/Tiny-GGUF:Q8_0", env=hub_env)
    assert r.returncode == 0, r.stderr.decode()
    assert cached_blobs(hub_env) == []
    gone = quipu("run", "-m", "tiny/Tiny-GGUF/tiny-Q8_0", "-n", "1", "hi", env=hub_env)
    assert gone.returncode == 2


def test_a_full_disk_is_one_line_and_leaves_no_model_behind(hub, hub_env, home, tmp_path):
    # The disk had room when the pull began, and fills up while it runs (another writer).
    cache = tmp_path / "small-cache"
    cache.mkdir()
    hub.stall_at = 15 << 20
    with small_filesystem(cache, "48m"):
        env = {**hub_env, "HF_HUB_CACHE": str(cache)}
        environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
        environ.update(QUIPU_HOME=str(home), **env)
        proc = subprocess.Popen([sys.executable, "-m", "quipu", "models", "pull", "tiny/Large-GGUF"], env=environ,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        assert hub.stalled.wait(60)
        deadline = time.monotonic() + 60  # (until the first chunk is on disk: observed, not timed)
        while time.monotonic() < deadline and not any(
                p.name.endswith(".incomplete") and p.stat().st_size >= 10 << 20 for p in cached_blobs(env)):
            time.sleep(0.05)
        with open(cache / "filler", "wb") as filler:  # the rest of the disk, taken
            try:
                while True:
                    filler.write(b"\0" * (1 << 20))
                    filler.flush()
            except OSError:
                pass
        hub.stall_at = None
        hub.release.set()
        _, err = proc.communicate(timeout=120)
        err = err.decode()
        assert proc.returncode == 1 and "the disk is full" in err and "Traceback" not in err, err
        assert not list(cache.rglob("snapshots/*/*.gguf"))  # nothing quipu would take for a model
        listed = json.loads(subprocess.run([sys.executable, "-m", "quipu", "models", "list", "--json"], env=environ,
                                           capture_output=True).stdout)
        assert not [m for m in listed if m["name"].startswith("tiny/Large-GGUF")]


def test_a_file_longer_than_the_hub_said_is_stopped(quipu, hub, hub_env):
    hub.sizes["tiny-Q4_K_M.gguf"] = 100
    r = quipu("models", "pull", "tiny/Tiny-GGUF", env=hub_env)
    err = r.stderr.decode()
    assert r.returncode == 1 and "longer than the 100 bytes the Hub said" in err and "Traceback" not in err, err
    assert all(p.stat().st_size <= 100 for p in cached_blobs(hub_env))


def test_a_pull_shows_its_progress_on_a_terminal_and_nothing_on_stdout(hub, hub_env, home):
    import pty

    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ.update(QUIPU_HOME=str(home), COLUMNS="100", **hub_env)
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "quipu", "models", "pull", "tiny/Large-GGUF"], env=environ,
                            stdout=subprocess.PIPE, stderr=follower, stdin=subprocess.DEVNULL)
    out, _ = proc.communicate(timeout=120)
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    assert proc.returncode == 0 and out == b""
    said = seen.decode("utf-8", "replace")
    assert "downloading" in said and "MB" in said and "pulled tiny/Large-GGUF Q4_K_M" in said, said[-2000:]


@pytest.mark.parametrize("name, tag", [
    ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Q4_K_M"), ("qwen2.5-0.5b-instruct-q4_k_m.gguf", "Q4_K_M"),
    ("model.Q8_0.gguf", "Q8_0"), ("gemma-3-1b-it-BF16.gguf", "BF16"), ("x-IQ4_XS-00001-of-00002.gguf", "IQ4_XS"),
    ("Phi-3-mini-4k-instruct-fp16.gguf", "FP16"), ("Qwen3-0.6B-UD-IQ1_S.gguf", "IQ1_S"), ("model.gguf", None),
    ("DeepSeek-R1-Q2_K_XL.gguf", "Q2_K_XL"), ("tq-TQ1_0.gguf", "TQ1_0"),
])
def test_quantization_tags_are_read_from_file_names(name, tag):
    from quipu.app.hub import quant_of

    assert quant_of(name) == tag


def test_the_default_pick_and_the_nearest():
    from quipu.app.hub import HubFile, choose

    files = lambda *names: [HubFile(n, 1, None) for n in names]  # noqa: E731
    assert choose("a/b", files("m-Q8_0.gguf", "m-Q4_K_M.gguf", "mmproj-m-F16.gguf"), None).quant == "Q4_K_M"
    assert choose("a/b", files("m-Q8_0.gguf", "m-Q5_K_M.gguf", "m-F16.gguf"), None).quant == "Q5_K_M"
    plan = choose("a/b", files("m-Q8_0-00002-of-00002.gguf", "m-Q8_0-00001-of-00002.gguf", "README.md"), "q8_0")
    assert [f.path for f in plan.files] == ["m-Q8_0-00001-of-00002.gguf", "m-Q8_0-00002-of-00002.gguf"]
    with pytest.raises(Exception, match="has 1 of the 2 parts"):
        choose("a/b", files("m-Q8_0-00001-of-00002.gguf"), None)
    many = files(*(f"m-Q8_0-{i:05d}-of-99999.gguf" for i in range(1, 300)))
    with pytest.raises(Exception, match="in 99999 parts; quipu pulls a model of 1 to 256 parts"):
        choose("a/b", many, None)  # (refused before anything is fetched, however many it lists)
    with pytest.raises(Exception, match="in 0 parts"):
        choose("a/b", files("m-Q8_0-00000-of-00000.gguf"), None)


# ---- what a listing and its headers may not do ----------------------------------------------------

@pytest.mark.parametrize("name", ["ABSOLUTE", "sub/../../x-Q4_K_M.gguf", "a\\b-Q4_K_M.gguf", "C:x-Q4_K_M.gguf",
                                  "a//x-Q4_K_M.gguf", "./x-Q4_K_M.gguf",
                                  # what a terminal acts on, or reads backwards: C1, DEL, bidirectional overrides
                                  "x\x9b2J-Q4_K_M.gguf", "x\x7f-Q4_K_M.gguf", "fuf\u202egg.Q4_K_M.gguf",
                                  "x\u2066-Q4_K_M.gguf", "x\u200f-Q4_K_M.gguf"])
def test_a_listing_that_names_a_path_outside_the_repository_is_refused(quipu, hub, hub_env, files, tmp_path, name):
    outside = tmp_path / "outside" / "x-Q4_K_M.gguf"
    if name == "ABSOLUTE":
        name = str(outside)
    hub.repos["evil/Evil-GGUF"] = {name: files["q4"]}
    r = quipu("models", "pull", "evil/Evil-GGUF", env=hub_env)
    assert r.returncode == 1, r.stderr.decode()
    err = r.stderr.decode().strip()
    assert "evil/Evil-GGUF" in err and "not a path inside the repository" in err
    assert len(err.splitlines()) == 1 and err.isascii(), err  # (the name is shown escaped)
    assert not outside.exists() and not outside.parent.exists()
    assert hub.ranges == []  # nothing was fetched


@pytest.mark.parametrize("commit", ["../../../../escaped", "a/b", ".."])
def test_a_version_that_is_not_a_plain_name_is_refused(quipu, hub, hub_env, tmp_path, commit):
    hub.commit = commit
    r = quipu("models", "pull", "tiny/Tiny-GGUF", env=hub_env)
    assert r.returncode == 1
    err = r.stderr.decode()
    assert "not a plain name" in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if not line.startswith("pulling ")]) == 1
    assert not list(tmp_path.rglob("escaped")) and hub.ranges == []


def test_a_file_larger_than_the_free_disk_is_refused_before_the_download(quipu, hub, hub_env):
    hub.sizes["tiny-Q4_K_M.gguf"] = 1 << 40  # a terabyte
    r = quipu("models", "pull", "tiny/Tiny-GGUF", env=hub_env)
    assert r.returncode == 1
    err = r.stderr.decode().strip()
    assert "needs 1,099.5 GB" in err and "free" in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if not line.startswith("pulling ")]) == 1
    assert hub.ranges == []  # refused before a byte was asked for


def test_two_pulls_of_one_file_take_turns(hub, hub_env, home):
    import fcntl

    hub.stall_at = 15 << 20
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ.update(QUIPU_HOME=str(home), **hub_env)
    pull = [sys.executable, "-m", "quipu", "models", "pull", "tiny/Large-GGUF"]
    first = subprocess.Popen(pull, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert hub.stalled.wait(60)
    from pathlib import Path

    [lock] = Path(hub_env["HF_HUB_CACHE"]).rglob(".locks/*/*.lock")
    with open(lock) as held:  # the first pull holds its file's lock while it downloads
        with pytest.raises(BlockingIOError):
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    second = subprocess.Popen(pull, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while hub.heads.count("large-Q4_K_M.gguf") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # (until the second has asked what to fetch: observed, not timed)
    hub.stall_at = None
    hub.release.set()
    _, err1 = first.communicate(timeout=120)
    _, err2 = second.communicate(timeout=120)
    # The stalled connection is cut; the first pull says so or goes on, and the second
    # takes what the first leaves: one of them ends with the whole file, unmixed.
    assert 0 in (first.returncode, second.returncode), (err1.decode(), err2.decode())
    r = subprocess.run(pull, env=environ, capture_output=True, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr.decode()
    blobs = [p for p in cached_blobs(hub_env) if not p.name.endswith(".incomplete")]
    assert [b.read_bytes() == LARGE for b in blobs] == [True]


@pytest.fixture
def gemma_hub(files):
    server = start_hub({
        "ggml-org/gemma-3-1b-it-GGUF": {"gemma-3-1b-it-Q4_K_M.gguf": files["q4"], "gemma-3-1b-it-Q8_0.gguf": files["q8"]},
        "someone/gemma-fork-GGUF": {"fork-Q8_0.gguf": files["q8"]},
        "someone/gemma-safetensors": {"model.safetensors": b"\0" * 16},
        "tiny/Vision-GGUF": {"tiny-Q4_K_M.gguf": files["q4"], "mmproj-tiny-Q8_0.gguf": files["mmproj"],
                             "mmproj-tiny-f16.gguf": files["mmproj"]},
        "tiny/Split-GGUF": {f"split-Q8_0-0000{i}-of-00003.gguf": part for i, part in enumerate(files["parts"], 1)},
    })
    server.downloads = {"ggml-org/gemma-3-1b-it-GGUF": 900, "someone/gemma-fork-GGUF": 5000}
    yield server
    server.shutdown()


def test_a_short_name_pulls_its_repository_and_runs(quipu, gemma_hub, tmp_path):
    env = {"HF_ENDPOINT": gemma_hub.url, "HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": ""}
    listed = quipu("models", "pull", "--list").stdout.decode()
    assert "gemma3:1b" in listed and "ggml-org/gemma-3-1b-it-GGUF:Q4_K_M" in listed and "about 768.7 MB" in listed
    # -m NAME pulls it on first use, then runs it; the pull's own command then has nothing to fetch
    r = quipu("run", "-m", "gemma3:1b", "-n", "2", "hi", env=env)
    assert r.returncode == 0 and "pulling ggml-org/gemma-3-1b-it-GGUF Q4_K_M" in r.stderr.decode(), r.stderr
    pulled = quipu("models", "pull", "gemma3:1b", env=env)
    assert pulled.returncode == 0 and "pulled ggml-org/gemma-3-1b-it-GGUF Q4_K_M" in pulled.stderr.decode()
    other = quipu("models", "pull", "gemma3:1b:q8_0", env=env)  # another quantization: a third part
    assert other.returncode == 0 and "Q8_0" in other.stderr.decode(), other.stderr
    unknown = quipu("run", "-m", "gemma3:9b", "hi", env=env)
    err = unknown.stderr.decode()
    assert unknown.returncode == 2 and len(err.strip().splitlines()) == 1
    assert "'gemma3:9b' is not a short name quipu knows" in err and "gemma3:1b" in err and "qwen3:4b" in err
    removed = quipu("models", "rm", "gemma3:1b", env=env)
    assert removed.returncode == 0 and "removed ggml-org/gemma-3-1b-it-GGUF Q4_K_M" in removed.stderr.decode()


def test_an_ollama_model_of_a_short_name_is_used_as_it_is(quipu, files, tmp_path):
    ollama = tmp_path / "ollama"
    manifest = ollama / "manifests" / "registry.ollama.ai" / "library" / "gemma3" / "1b"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                "digest": "sha256:0123"}]}))
    (ollama / "blobs").mkdir()
    (ollama / "blobs" / "sha256-0123").write_bytes(files["q4"])
    env = {"OLLAMA_MODELS": str(ollama), "HF_ENDPOINT": "http://127.0.0.1:9", "HF_TOKEN": ""}  # no Hub there
    r = quipu("run", "-m", "gemma3:1b", "-n", "2", "--json", "hi", env=env)
    assert r.returncode == 0, r.stderr.decode()
    assert json.loads(r.stdout)["model"] == "gemma3:1b" and "pulling" not in r.stderr.decode()


def test_models_search_lists_gguf_repositories_most_downloaded_first(quipu, gemma_hub):
    env = {"HF_ENDPOINT": gemma_hub.url, "HF_TOKEN": ""}
    r = quipu("models", "search", "gemma", env=env)
    assert r.returncode == 0, r.stderr.decode()
    lines = r.stdout.decode().splitlines()
    assert [line.split()[0] for line in lines] == ["someone/gemma-fork-GGUF", "ggml-org/gemma-3-1b-it-GGUF"]
    assert "Q4_K_M: gemma-3-1b-it-Q4_K_M.gguf (also 1 more)" in lines[1] and "5,000" in lines[0]
    query = gemma_hub.searches[-1]
    assert query["search"] == ["gemma"] and query["filter"] == ["gguf"] and query["sort"] == ["downloads"]
    found = json.loads(quipu("models", "search", "split", "--json", "--limit", "1", env=env).stdout)
    assert found == [{"repo": "tiny/Split-GGUF", "downloads": 0, "quant": "Q8_0",
                      "files": [f"split-Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)], "others": []}]
    assert gemma_hub.searches[-1]["limit"] == ["1"]
    nothing = quipu("models", "search", "nomodelcalledthis", env=env)
    assert nothing.returncode == 0 and nothing.stdout == b"" and "no GGUF repository" in nothing.stderr.decode()
    # what a hostile listing names is not shown, and nothing fails
    gemma_hub.found = json.dumps([{"id": "../../etc", "downloads": 1}, {"id": "ok/Repo-GGUF", "downloads": "many",
                                   "siblings": [{"rfilename": "../../x.gguf"}, {"rfilename": "ok-Q4_0.gguf"}]}]).encode()
    odd = quipu("models", "search", "x", "--json", env=env)
    assert odd.returncode == 0, odd.stderr.decode()
    assert json.loads(odd.stdout) == [{"repo": "ok/Repo-GGUF", "downloads": 0, "quant": "Q4_0", "files": ["ok-Q4_0.gguf"],
                                       "others": []}]
    bad = quipu("models", "search", "x", "--limit", "0", env=env)
    assert bad.returncode == 2 and "--limit must be from 1 to 100" in bad.stderr.decode()


# ---- listings bounded in pages and bytes, pulls of one version --------------------------------

def test_a_listing_that_pages_forever_or_sends_a_huge_page_is_one_line(quipu, hub, hub_env):
    asked = []

    def empty_forever(path):
        asked.append(path)
        return b"[]", f"/api/models/tiny/Tiny-GGUF/tree/x?cursor={len(asked)}"

    hub.listing = empty_forever
    r = quipu("models", "pull", "tiny/Tiny-GGUF", env=hub_env)
    err = r.stderr.decode()
    assert r.returncode == 1 and "an empty page of the listing" in err and len(err.splitlines()) == 1, err
    assert len(asked) == 1

    def one_entry_forever(path):
        asked.append(path)
        return (json.dumps([{"type": "file", "path": f"f{len(asked)}.txt", "size": 1}]).encode(),
                f"/api/models/tiny/Tiny-GGUF/tree/x?cursor={len(asked)}")

    hub.listing = one_entry_forever
    r = quipu("models", "pull", "tiny/Tiny-GGUF", env=hub_env)
    assert r.returncode == 1 and "runs past 200 pages" in r.stderr.decode(), r.stderr.decode()

    hub.listing = b"[" + b'{"type": "file", "path": "x.txt", "size": 1},' * 400_000 + b"{}]"  # ~18 MB
    r = quipu("models", "pull", "tiny/Tiny-GGUF", env=hub_env)
    assert r.returncode == 1 and "a listing of 'tiny/Tiny-GGUF' larger than 16 MB" in r.stderr.decode()
    assert hub.ranges == []  # nothing was fetched


def test_a_pull_is_of_one_version_or_refused(quipu, hub, hub_env, files):
    moved = {**hub.repos, "tiny/Split-GGUF": {
        f"split-Q8_0-0000{i}-of-00003.gguf": part + b"\0" for i, part in enumerate(files["parts"], 1)}}
    hub.move = (1, moved, "feedfacefeedfacefeedfacefeedfacefeedface")  # (after the first part)
    r = quipu("models", "pull", "tiny/Split-GGUF", env=hub_env)
    err = r.stderr.decode()
    assert r.returncode == 1 and "moved to another version while it was pulled" in err and "pull again" in err, err
    listed = json.loads(quipu("models", "list", "--json", env=hub_env).stdout)
    assert not any("Split" in m["name"] for m in listed)  # not reported as pulled
    hub.move = None
    again = quipu("models", "pull", "tiny/Split-GGUF", env=hub_env)  # now at the new version, whole
    assert again.returncode == 0, again.stderr.decode()
    r = quipu("run", "-m", "hf:tiny/Split-GGUF", "-n", "2", "hi", env=hub_env)
    assert r.returncode == 0, r.stderr.decode()


def test_a_pull_waiting_for_another_says_so(quipu, hub, hub_env):
    import fcntl
    import threading

    first = quipu("models", "pull", "tiny/Tiny-GGUF", env=hub_env)
    assert first.returncode == 0
    for blob in cached_blobs(hub_env):  # (gone: the next pull fetches it again, and must take its lock)
        blob.unlink()
    locks = sorted(p for p in __import__("pathlib").Path(hub_env["HF_HUB_CACHE"]).rglob(".locks/**/*.lock"))
    assert locks
    held = [os.open(p, os.O_RDWR) for p in locks]
    for fd in held:
        fcntl.flock(fd, fcntl.LOCK_EX)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ.update(hub_env, QUIPU_HOME=str(hub_env["HF_HUB_CACHE"]) + "-home")
    p = subprocess.Popen([sys.executable, "-m", "quipu", "models", "pull", "tiny/Tiny-GGUF"], env=environ,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    said: list[bytes] = []

    def read_until_waiting() -> None:
        while not said or b"under way" not in said[-1]:
            line = p.stderr.readline()
            if not line:
                return
            said.append(line)

    reader = threading.Thread(target=read_until_waiting, daemon=True)
    reader.start()
    reader.join(120)
    assert said and b"another download of tiny-Q4_K_M.gguf is under way" in said[-1], said
    for fd in held:
        os.close(fd)  # (the other pull is done: this one goes on)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err.decode()


def test_offline_mode_is_said_in_whole_words(quipu):
    r = quipu("models", "pull", "gemma3:1b", env={"HF_HUB_OFFLINE": "1"})
    err = r.stderr.decode()
    assert r.returncode == 1 and err.count("\n") == 1, err
    assert "HF_HUB_OFFLINE is set, so the Hub is not asked: unset it to pull" in err


def test_a_long_message_of_the_hub_is_cut_where_a_word_ends():
    from quipu.app.hub import clipped

    said = "Cannot reach https://huggingface.co: offline mode is enabled. To disable it, please unset the variable"
    cut = clipped(said, 60)
    assert cut.endswith("…") and said.startswith(cut[:-1]) and said[len(cut) - 1] == " " and len(cut) <= 61
    assert clipped("short", 60) == "short"
