"""Models already on the user's disk, the config file, shell completions, embeddings."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tinymodel import write_tiny_gguf

pytestmark = pytest.mark.quick  # (the quick set: `python -m pytest -m quick`)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def machine(tmp_path, tiny_model):
    """A home folder with models where the Hugging Face hub, LM Studio and Ollama keep them."""
    home = tmp_path / "user"
    hf = home / ".cache" / "huggingface" / "hub" / "models--acme--tiny-chat-GGUF" / "snapshots" / "abc123"
    hf.mkdir(parents=True)
    write_tiny_gguf(hf / "tiny-chat.Q8_0.gguf", seed=1)
    lms = home / ".lmstudio" / "models" / "lmstudio-community" / "Tiny-GGUF"
    lms.mkdir(parents=True)
    write_tiny_gguf(lms / "Tiny-Instruct.gguf", seed=2)
    (lms / "mmproj-Tiny.gguf").write_bytes(b"GGUF")  # a vision projector, not a language model
    ollama = home / ".ollama" / "models"
    (ollama / "blobs").mkdir(parents=True)
    write_tiny_gguf(ollama / "blobs" / "sha256-0123abcd", seed=3)
    manifest = ollama / "manifests" / "registry.ollama.ai" / "library" / "tinyllama"
    manifest.mkdir(parents=True)
    (manifest / "1b").write_text(json.dumps({"layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:ffff"},
        {"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:0123abcd"},
    ]}))
    return {"HOME": str(home)}


def test_models_list_finds_every_place(quipu, machine):
    r = quipu("models", "list", "--json", env=machine)
    assert r.returncode == 0, r.stderr.decode()
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert rows["SmolLM2-135M-Instruct"]["source"] == "bundled"
    assert rows["acme/tiny-chat-GGUF/tiny-chat.Q8_0"]["source"] == "huggingface"
    assert rows["lmstudio-community/Tiny-GGUF/Tiny-Instruct"]["source"] == "lmstudio"
    assert rows["tinyllama:1b"]["source"] == "ollama"
    assert not any("mmproj" in name for name in rows)
    tiny = rows["tinyllama:1b"]
    assert (tiny["architecture"], tiny["quantization"], tiny["context_length"]) == ("llama", "F32", 2048)
    assert rows["SmolLM2-135M-Instruct"]["parameters"].endswith("M")
    table = quipu("models", "list", env=machine).stdout.decode()
    assert "tinyllama:1b" in table and "ollama" in table


@pytest.mark.parametrize("name", ["tinyllama:1b", "acme/tiny-chat-GGUF/tiny-chat.Q8_0", "lmstudio-community/Tiny-GGUF/Tiny-Instruct"])
def test_any_listed_name_works_as_model(quipu, machine, name):
    r = quipu("run", "-m", name, "--json", "-n", "4", "hello", env=machine)
    assert r.returncode == 0, r.stderr.decode()
    assert json.loads(r.stdout)["model"] == name


def test_locations_can_be_overridden(quipu, machine, tmp_path):
    moved = tmp_path / "elsewhere"
    os.rename(Path(machine["HOME"]) / ".ollama" / "models", moved)
    assert "tinyllama:1b" not in quipu("models", "list", env=machine).stdout.decode()
    assert "tinyllama:1b" in quipu("models", "list", env={**machine, "OLLAMA_MODELS": str(moved)}).stdout.decode()


def test_models_add_and_info(quipu, tiny_model, home):
    assert quipu("models", "add", tiny_model, "--name", "mine").returncode == 0
    assert quipu("models", "add", tiny_model, "--name", "mine").returncode == 2
    info = json.loads(quipu("models", "info", "mine", "--json").stdout)
    assert info["architecture"] == "llama" and info["context_length"] == 2048
    assert info["special_tokens"]["bos"] == "<s>" and info["special_tokens"]["eos"] == "<|im_end|>"
    assert "im_start" in info["chat_template"]
    text = quipu("models", "info", "mine", "--template").stdout.decode()
    assert "architecture    llama" in text and "<|im_start|>" in text
    default = quipu("models", "info").stdout.decode()
    assert "SmolLM2-135M-Instruct" in default
    r = quipu("models", "add", home)
    assert r.returncode == 2 and "not a usable GGUF" in r.stderr.decode()
    # `models rm` undoes `models add`: the name goes, the file stays
    gone = quipu("models", "rm", "mine")
    assert gone.returncode == 0 and f"the file {tiny_model} stays" in gone.stderr.decode()
    assert tiny_model.exists() and "mine" not in quipu("models", "list").stdout.decode()
    assert quipu("models", "rm", "mine").returncode == 2


def test_a_hostile_header_is_refused_quickly(tmp_path):
    import struct

    from quipu.gguf import GGUFError, read_gguf

    cases = [
        b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**60),  # a key longer than the file
        b"GGUF" + struct.pack("<IQQ", 3, 2**40, 0),  # an absurd tensor count
        b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 8, 2**50),
        b"GGUF" + struct.pack("<IQQ", 7, 0, 0),  # a future version
        b"GGU",
        b"",
    ]
    for i, data in enumerate(cases):
        path = tmp_path / f"h{i}.gguf"
        path.write_bytes(data)
        with pytest.raises(GGUFError):
            read_gguf(path)


def test_precedence_command_line_environment_config_default(quipu, home, tiny_model, tmp_path):
    other = write_tiny_gguf(tmp_path / "other.gguf", seed=4)
    (home / "config").mkdir()
    (home / "config" / "config.toml").write_text(
        f'model = "{tiny_model}"\nsystem = "be kind"\n\n[generation]\ntemperature = 0\nmax_tokens = 3\n'
    )
    model_of = lambda r: json.loads(r.stdout)["model"]  # noqa: E731
    assert model_of(quipu("run", "--json", "hi")) == "tiny"
    assert model_of(quipu("run", "--json", "hi", env={"QUIPU_MODEL": str(other)})) == "other"
    assert model_of(quipu("run", "--json", "-m", "SmolLM2-135M-Instruct", "hi", env={"QUIPU_MODEL": str(other)})) == "SmolLM2-135M-Instruct"
    out = json.loads(quipu("run", "--json", "hi").stdout)
    assert out["usage"]["completion_tokens"] <= 3
    assert json.loads(quipu("run", "--json", "-n", "5", "--temperature", "0", "hi").stdout)["usage"]["completion_tokens"] <= 5
    shown = json.loads(quipu("config", "show", "--json").stdout)
    assert shown["generation.temperature"] == {"value": 0, "source": f"config ({home / 'config' / 'config.toml'})"}
    assert shown["generation.top_k"]["source"] == "default"
    assert shown["model"]["value"] == str(tiny_model)
    assert quipu("config", "path").stdout.decode().strip() == str(home / "config" / "config.toml")


def test_a_context_not_asked_for_is_the_models_training_length_at_most_the_cap(quipu, tmp_path):
    # Each token of context is cache memory allocated and cleared at the start; the cap is what
    # --help and `quipu config show` say it is.
    from quipu.engine.settings import DEFAULT_CTX_CAP, ContextSettings
    from quipu.engine.llama import LlamaBackend

    for trained, expected in ((DEFAULT_CTX_CAP * 8, DEFAULT_CTX_CAP), (512, 512)):
        path = write_tiny_gguf(tmp_path / f"trained{trained}.gguf", n_ctx_train=trained)
        with LlamaBackend(path, ContextSettings(n_threads=1)) as backend:
            assert backend.context.n_ctx == expected
    said = f"at most {DEFAULT_CTX_CAP}"
    assert said in " ".join(quipu("run", "--help").stdout.decode().split())
    assert said in json.loads(quipu("config", "show", "--json").stdout)["generation.ctx"]["value"]


@pytest.mark.parametrize(
    "text, line, words",
    [
        ("[generation]\ntemperature = 0.5\ntop_p = 3\n", 3, "top-p"),
        ("model = 5\n", 1, "must be a string"),
        ("\n\n[generation]\ntemprature = 1\n", 4, "unknown key 'temprature'"),
        ("[generation\n", 1, "Expected"),
        ("[sessions]\nmax_state_bytes = 'lots'\n", 2, "integer"),
        ("colour = 'red'\n", 1, "unknown key 'colour'"),
    ],
)
def test_a_broken_config_names_file_and_line(quipu, home, text, line, words):
    (home / "config").mkdir()
    path = home / "config" / "config.toml"
    path.write_text(text)
    r = quipu("run", "hi")
    err = r.stderr.decode()
    assert r.returncode == 2, err
    assert str(path) in err and f"line {line}" in err and words in err and "Traceback" not in err


# ---- shell completions -------------------------------------------------------------------------------

def test_completion_scripts_are_generated_from_the_app_and_current(tmp_path):
    from quipu.cli.completion import SHELLS, write_all

    write_all(tmp_path)
    for filename in SHELLS.values():
        committed = ROOT / "completions" / filename
        assert committed.read_text() == (tmp_path / filename).read_text(), (
            f"completions/{filename} is stale: run python -m quipu.cli.completion completions"
        )


def complete(home, words: str, extra_env: dict | None = None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    env.update(QUIPU_HOME=str(home), COMP_WORDS=words, COMP_CWORD=str(len(words.split(" ")) - 1),
               _QUIPU_COMPLETE="complete_bash", **(extra_env or {}))
    r = subprocess.run([sys.executable, "-m", "quipu"], env=env, capture_output=True, text=True)
    return r.stdout.split()


def test_completion_of_commands_options_sessions_and_models(quipu, home, tiny_model, machine):
    assert quipu("run", "-m", tiny_model, "-S", "holiday", "-n", "2", "hi").returncode == 0
    assert "sessions" in complete(home, "quipu ses")
    assert {"--top-k", "--top-p"} <= set(complete(home, "quipu run --top"))
    assert complete(home, "quipu run -S hol") == ["holiday"]
    assert complete(home, "quipu sessions show h") == ["holiday"]
    assert "tinyllama:1b" in complete(home, "quipu run -m tiny", machine)


def test_completion_of_roles_and_the_short_names_pull_knows(quipu, home):
    assert quipu("roles", "add", "translator", "--system", "Translate.").returncode == 0
    assert complete(home, "quipu run -R tr") == ["translator"]
    assert complete(home, "quipu chat --role tra") == ["translator"]
    assert complete(home, "quipu models pull llama3") == ["llama3.2:1b", "llama3.2:3b"]


# ---- embeddings ------------------------------------------------------------------------------------

def test_embed_gives_one_vector_per_input(tiny_model):
    from quipu.engine.settings import ContextSettings
    from quipu.engine.llama import LlamaBackend

    with LlamaBackend(tiny_model, ContextSettings(n_ctx=256, n_threads=2)) as backend:
        texts = ["hello world", "the sky is blue", "hello world"]
        vectors = backend.embed(texts)
        assert len(vectors) == 3 and all(len(v) == 128 for v in vectors)
        close = lambda a, b: max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4  # noqa: E731
        assert close(vectors[0], vectors[2]) and not close(vectors[0], vectors[1])
        alone = backend.embed(["the sky is blue"])
        assert close(alone[0], vectors[1])
        assert backend.embed(texts, "last")[0] != vectors[0]


def test_embed_command(quipu, tiny_model):
    r = quipu("embed", "-m", tiny_model, "--normalize", "hello", "the sky")
    assert r.returncode == 0, r.stderr.decode()
    rows = [json.loads(line) for line in r.stdout.decode().splitlines()]
    assert [(row["index"], row["text"]) for row in rows] == [(0, "hello"), (1, "the sky")]
    assert all(abs(math.sqrt(sum(x * x for x in row["embedding"])) - 1) < 1e-4 for row in rows)
    piped = quipu("embed", "-m", tiny_model, "--pooling", "cls", input="one\n\ntwo\nthree\n")
    assert [json.loads(line)["text"] for line in piped.stdout.decode().splitlines()] == ["one", "two", "three"]
    assert quipu("embed", "-m", tiny_model, "--pooling", "max", "x").returncode == 2
    assert quipu("embed", "-m", tiny_model).returncode == 2


def test_a_backend_that_cannot_embed_refuses(tiny_model, monkeypatch):
    from quipu.engine.llama import LlamaBackend
    from quipu.errors import CapabilityError
    from quipu.app.embed import embed_texts
    from quipu.app.environment import Environment
    from quipu.app.turn_options import TurnOptions

    monkeypatch.setattr(LlamaBackend, "supports_embeddings", False)
    with pytest.raises(CapabilityError, match="cannot compute embeddings"):
        embed_texts(["hi"], TurnOptions(model=str(tiny_model)), Environment.load({"QUIPU_HOME": "/nonexistent"}))


def test_a_fingerprint_is_remembered_across_runs_until_the_file_changes(tmp_path, monkeypatch):
    """A one-shot or a resume does not hash the model again (the record in the cache folder, kept
    private); a file written over with its size and times put back, or a damaged record, is
    hashed again, never trusted."""
    import stat

    from quipu import models
    from quipu.app.environment import Environment
    from quipu.app.local import model_fingerprint

    env = Environment.load({"QUIPU_HOME": str(tmp_path / "home")})
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(1000))
    first = model_fingerprint(path, env)
    record = env.dirs.cache / "fingerprints.json"
    assert stat.S_IMODE(record.stat().st_mode) == 0o600 and stat.S_IMODE(record.parent.stat().st_mode) == 0o700

    def no_hashing(_path):
        raise AssertionError("hashed again")

    models._FINGERPRINTS.clear()  # (a new process)
    with monkeypatch.context() as m:
        m.setattr("quipu.app.local.fingerprint", no_hashing)
        assert model_fingerprint(path, env) == first

    before = path.stat()
    path.write_bytes(b"GGUF" + bytes([1]) * 1000)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # the same size and times as before
    models._FINGERPRINTS.clear()
    changed = model_fingerprint(path, env)
    assert changed != first and changed == models.fingerprint(path)

    for damage in (b"\xff\x00 not json", b"[1, 2]", json.dumps({str(path.resolve()): ["x", changed]}).encode()):
        record.write_bytes(damage)
        models._FINGERPRINTS.clear()
        assert model_fingerprint(path, env) == changed


def test_a_model_file_changed_in_place_gets_a_new_fingerprint(tmp_path):
    """The fingerprint is remembered by the process for a file that has not changed; one
    written over (same name, same size) is read again."""
    import os

    from quipu.models import fingerprint

    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(1000))
    first = fingerprint(path)
    assert fingerprint(path) == first
    path.write_bytes(b"GGUF" + bytes([1]) * 1000)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    assert fingerprint(path) != first
