"""Values that llama.cpp trusts, given to quipu from every side (flags, the config, a session, a
model's own metadata): each bounded where llama.cpp would assert, crash or fill the memory, and
refused in one line. Each case runs in a subprocess under a memory limit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from limits import memory_limited
from pty_run import on_a_terminal
from tinymodel import write_tiny_gguf


def run_limited(home, *args, stdin: bytes | None = None, timeout=120):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ["QUIPU_HOME"] = str(home)
    return subprocess.run([sys.executable, "-m", "quipu", *map(str, args)], capture_output=True, env=environ,
                          input=stdin, stdin=None if stdin is not None else subprocess.DEVNULL, timeout=timeout,
                          preexec_fn=memory_limited)


def one_line(r, code: int) -> str:
    """The error, asserted to be one `quipu: error:` line with exit `code`, no crash, no traceback."""
    err = r.stderr.decode()
    assert r.returncode == code and r.returncode not in (-signal.SIGSEGV, -signal.SIGABRT, -signal.SIGKILL), err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("quipu: error:")]
    assert "Traceback" not in err and len(lines) == 1, err[-2000:]
    return lines[0]


def write_config(home, text: str) -> None:
    path = home / "config" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize("args, said", [
    (["--ctx", "1"], "--ctx must be at least 16 tokens"),
    (["--ctx", "4294967297"], "--ctx must be at most"),        # past 2^32: once wrapped to a tiny context
    (["--ctx", "300000000"], "of cache in memory"),            # more than any test machine holds
    (["--threads", "100000"], "--threads must be at most 512"),  # (crashed in ggml's thread pool)
    (["--threads", "513"], "--threads must be at most 512"),
])
def test_context_and_threads_that_llama_cpp_cannot_take_are_one_line(home, tiny_model, args, said):
    assert said in one_line(run_limited(home, "run", "-m", tiny_model, "-n", "2", *args, "hi"), 2)


@pytest.mark.parametrize("config, said", [
    ("[generation]\nctx = 1\n", "ctx must be at least 16"),
    ("[generation]\nctx = 4294967297\n", "ctx must be at most"),
    ("[generation]\nctx = 300000000\n", "of cache in memory"),
    ("[generation]\nthreads = 100000\n", "must be at most 512"),
    ("[generation]\nctx = " + "9" * 5000 + "\n", "a number in it is too long to read"),
    ("[generation]\ntemperature = 0." + "1" * 5000 + "\n", None),  # (a long fraction reads fine)
])
def test_the_same_values_from_the_config_are_one_line_too(home, tiny_model, config, said):
    write_config(home, config)
    r = run_limited(home, "run", "-m", tiny_model, "-n", "2", "hi")
    if said is None:
        assert r.returncode == 0, r.stderr.decode()[-2000:]
    else:
        assert said in one_line(r, 2)
    chat = run_limited(home, "chat", "-m", tiny_model, "-n", "2", stdin=b"hi\n")
    if said is not None:
        assert said in one_line(chat, 2)


def test_a_model_whose_context_length_does_not_fit_32_bits_runs_on_the_default(home, tmp_path):
    model = write_tiny_gguf(tmp_path / "long.gguf", n_ctx_train=2**31 + 5)
    r = run_limited(home, "run", "-m", model, "-n", "2", "--json", "hi")
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert json.loads(r.stdout)["finish_reason"] == "length"
    shown = run_limited(home, "models", "info", model, "--json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["context_length"] is None, shown.stderr.decode()


@pytest.mark.parametrize("n_ctx, n_batch", [(1, 1), (2**40, 256), (4096, 0)])
def test_a_session_with_an_impossible_context_is_said_to_be_damaged(home, tiny_model, n_ctx, n_batch):
    r = run_limited(home, "run", "-m", tiny_model, "-S", "s", "-n", "2", "hi")
    assert r.returncode == 0, r.stderr.decode()
    path = home / "data" / "sessions" / "s.json"
    record = json.loads(path.read_text())
    record["context"].update(n_ctx=n_ctx, n_batch=n_batch)
    path.write_text(json.dumps(record))
    line = one_line(run_limited(home, "run", "-m", tiny_model, "-S", "s", "-n", "2", "again"), 1)
    assert "session 's' is damaged" in line and "left as it is" in line
    assert json.loads(path.read_text()) == record  # nothing was lost


# ---- names from outside quipu reach the terminal escaped ------------------------------------

UNSAFE = ("\x1b", "\x9b", "\x7f", "\u202e", "\u2066", "\u200f")


def test_a_model_s_metadata_and_file_name_are_shown_escaped(home, tmp_path):
    folder = tmp_path / "odd"
    folder.mkdir()
    model = write_tiny_gguf(folder / "m\x1b[2J\u202eevil.gguf", architecture="ar\x9bch\u2066")
    for args in (["models", "info", model], ["models", "info", "--template", model]):
        r = run_limited(home, *args)
        out = r.stdout.decode()
        assert r.returncode == 0 and not any(c in out for c in UNSAFE), out
        assert "\\x1b[2J\\u202eevil" in out and "ar\\x9bch\\u2066" in out
    placed = write_tiny_gguf(folder / "p\x1b[2J\u202eevil.gguf")  # (a model doctor can place)
    r = run_limited(home, "doctor", "-m", placed)
    out = r.stdout.decode()
    assert r.returncode == 0 and not any(c in out for c in UNSAFE) and "p\\x1b[2J\\u202eevil" in out, out
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ.update(QUIPU_HOME=str(home))
    r = subprocess.run([sys.executable, "-m", "quipu", "run", "-m", str(folder / "none\x1b]0;x\x07.gguf"), "hi"],
                       capture_output=True, env=environ, stdin=subprocess.DEVNULL, timeout=120)
    err = r.stderr.decode()
    assert r.returncode != 0 and not any(c in err for c in (*UNSAFE, "\x07")) and "\\x1b]0;x\\x07" in err, err


@pytest.mark.parametrize("name", ["two\nlines", "esc\x1b[31m", "c1\x9b", "bidi\u202eflip", " padded", "tab\tbed",
                                  "x" * 129])
def test_models_add_refuses_a_name_a_terminal_would_act_on(home, tiny_model, name):
    line = one_line(run_limited(home, "models", "add", tiny_model, "--name", name), 2)
    assert "bad model name" in line and not any(c in line for c in (*UNSAFE, "\n"))
    assert not (home / "data" / "models").exists() or not list((home / "data" / "models").iterdir())


# ---- --raw honours or refuses, in one line ----------------------------------------------------

@pytest.mark.parametrize("args, named", [
    (["-s", "be brief"], "--system"),
    (["--no-think"], "--think/--no-think"),
    (["--reasoning-effort", "high"], "--reasoning-effort"),
    (["--reasoning-budget", "8"], "--reasoning-budget"),
    (["--tool-choice", "required"], "--tool-choice"),
    (["--batch", "-", "-s", "x"], "--system"),
])
def test_raw_refuses_what_only_a_chat_template_gives(home, tiny_model, args, named):
    r = run_limited(home, "run", "-m", tiny_model, "--raw", "-n", "2", *args, *([] if "--batch" in args else ["hi"]),
                    stdin=b"row\n" if "--batch" in args else None)
    line = one_line(r, 2)
    assert f"{named} cannot be used with --raw" in line and r.stdout == b""


def test_raw_still_takes_what_it_can_honour(home, tiny_model):
    r = run_limited(home, "run", "-m", tiny_model, "--raw", "-n", "3", "-s", "", "--regex", "[ab]+", "--json", "hi")
    assert r.returncode == 0, r.stderr.decode()
    assert set(json.loads(r.stdout)["text"]) <= {"a", "b"}


# ---- media headers read and bounded before llama.cpp decodes them ---------------------------

@pytest.fixture(scope="module")
def ears(tmp_path_factory):
    """The tiny model with an audio projector beside it."""
    from tinymodel import write_tiny_audio_projector

    folder = tmp_path_factory.mktemp("ears")
    write_tiny_gguf(folder / "tiny.gguf")
    write_tiny_audio_projector(folder / "mmproj-audio.gguf")
    return folder


def wav(rate=16000, channels=1, frame_bytes=2, data_size=None, samples=b"\x00\x01" * 800, fact=None) -> bytes:
    import struct

    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * frame_bytes, frame_bytes, 16)
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt
    if fact is not None:
        chunks += b"fact" + struct.pack("<II", 4, fact)
    chunks += b"data" + struct.pack("<I", len(samples) if data_size is None else data_size) + samples
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


def flac(total_samples: int, rate: int = 16000) -> bytes:
    import struct

    bits = rate << 44 | 0 << 41 | 15 << 36 | total_samples
    info = struct.pack(">HH", 4096, 4096) + b"\x00" * 6 + struct.pack(">Q", bits) + b"\x00" * 16
    return b"fLaC" + bytes([0x80]) + len(info).to_bytes(3, "big") + info + b"\xff\xf8" + b"\x00" * 64


def mp3_with_xing(frames: int) -> bytes:
    import struct

    header = bytes([0xFF, 0xFB, 0x90, 0x00])  # MPEG-1 layer III, 128 kb/s, 44.1 kHz
    body = bytearray(417 - 4)
    body[32:44] = b"Xing" + struct.pack(">II", 1, frames)
    return (header + bytes(body)) * 3


@pytest.mark.parametrize("name, data, said", [
    ("slow.wav", wav(rate=1), "a sample rate of 1 Hz"),
    ("long.wav", wav(fact=0xFFFFFFFF), "minutes of sound"),
    ("zero.wav", wav(channels=0), "header is damaged"),
    ("noframe.wav", wav(frame_bytes=0), "header is damaged"),
    ("long.flac", flac((1 << 36) - 1), "minutes of sound"),
    ("slow.flac", flac(1000, rate=1), "a sample rate of 1 Hz"),
    ("long.mp3", mp3_with_xing(0xFFFFFFFF), "minutes of sound"),
])
def test_a_recording_whose_header_claims_too_much_is_refused_before_decoding(home, ears, tmp_path, name, data, said):
    (tmp_path / name).write_bytes(data)
    line = one_line(run_limited(home, "run", "-m", ears / "tiny.gguf", "-n", "2", "-a", tmp_path / name, "hi"), 2)
    assert f"cannot attach {name}" in line and said in line, line


@pytest.mark.parametrize("name, data", [
    ("cut.wav", wav(data_size=0xFFFFFFF0)),   # a data size past the file: read as far as the file goes
    ("stream.wav", wav(data_size=0xFFFFFFFF)),  # a recording written as a stream, its size never filled in
    ("short.mp3", mp3_with_xing(3)),
])
def test_a_recording_whose_header_is_honest_enough_is_heard(home, ears, tmp_path, name, data):
    (tmp_path / name).write_bytes(data)
    r = run_limited(home, "run", "-m", ears / "tiny.gguf", "-n", "2", "-a", tmp_path / name, "hi")
    assert r.returncode == 0, r.stderr.decode()[-2000:]


# ---- projectors checked before clip.cpp trusts them ------------------------------------------

@pytest.fixture
def picture(tmp_path):
    from PIL import Image

    Image.new("RGB", (50, 40), (200, 30, 90)).save(tmp_path / "red.png")
    return tmp_path / "red.png"


@pytest.fixture
def tone(tmp_path):
    (tmp_path / "tone.wav").write_bytes(wav(samples=b"\x10\x20" * 8000))
    return tmp_path / "tone.wav"


@pytest.mark.parametrize("missing", ["v.patch_embd.weight", "v.blk.0.attn_k.weight", "v.blk.0.attn_q.weight"])
def test_a_projector_missing_a_part_its_kind_needs_is_one_line_even_beside_the_model(home, tmp_path, picture, missing):
    from tinymodel import write_tiny_projector

    folder = tmp_path / "m"
    folder.mkdir()
    write_tiny_gguf(folder / "tiny.gguf")
    write_tiny_projector(folder / "mmproj-tiny.gguf", drop=[missing])  # (found with no option at all)
    line = one_line(run_limited(home, "run", "-m", folder / "tiny.gguf", "-n", "2", "-a", picture, "hi"), 1)
    assert "mmproj-tiny.gguf cannot be used" in line and "crashed encoding a first, tiny image" in line, line
    assert not (home / "cache" / "projectors").exists() or not list((home / "cache" / "projectors").iterdir())


@pytest.mark.parametrize("missing", ["a.blk.0.ln1.bias", "a.position_embd.weight", "a.blk.0.attn_q.weight"])
def test_an_audio_projector_missing_a_part_is_one_line(home, tmp_path, tone, missing):
    from tinymodel import write_tiny_audio_projector

    write_tiny_gguf(tmp_path / "tiny.gguf")
    write_tiny_audio_projector(tmp_path / "bad.gguf", drop=[missing])
    r = run_limited(home, "run", "-m", tmp_path / "tiny.gguf", "--mmproj", tmp_path / "bad.gguf", "-n", "2",
                    "-a", tone, "hi")
    line = one_line(r, 1)
    assert "bad.gguf cannot be used" in line and "a first, tiny recording" in line, line


def test_a_whole_projector_is_checked_once_and_then_used(home, tmp_path, picture):
    from tinymodel import write_tiny_projector

    write_tiny_gguf(tmp_path / "tiny.gguf")
    write_tiny_projector(tmp_path / "mmproj-tiny.gguf")
    for _ in range(2):
        r = run_limited(home, "run", "-m", tmp_path / "tiny.gguf", "-n", "2", "-a", picture, "hi")
        assert r.returncode == 0, r.stderr.decode()[-2000:]
        assert len(list((home / "cache" / "projectors").iterdir())) == 1
    (tmp_path / "mmproj-tiny.gguf").unlink()
    write_tiny_projector(tmp_path / "mmproj-tiny.gguf", drop=["v.patch_embd.weight"])  # (another file: checked anew)
    assert "cannot be used" in one_line(run_limited(home, "run", "-m", tmp_path / "tiny.gguf", "-n", "2", "-a",
                                                    picture, "hi"), 1)


@pytest.mark.parametrize("key, value, said", [
    ("clip.vision.image_size", ("32", 8), "clip.vision.image_size is a string, where llama.cpp reads a u32"),
    ("clip.use_gelu", (1, 4), "clip.use_gelu is a u32, where llama.cpp reads a bool"),
    ("clip.vision.attention.layer_norm_epsilon", (1e-6, 12), "is a f64, where llama.cpp reads a f32"),
    ("clip.projector_type", (7, 5), "clip.projector_type is a i32, where llama.cpp reads a string"),
])
def test_a_projector_key_of_the_wrong_type_is_one_line(home, tmp_path, picture, key, value, said):
    from tinymodel import write_tiny_projector

    write_tiny_gguf(tmp_path / "tiny.gguf")
    write_tiny_projector(tmp_path / "mmproj-tiny.gguf", retype={key: value})
    line = one_line(run_limited(home, "run", "-m", tmp_path / "tiny.gguf", "-n", "2", "-a", picture, "hi"), 1)
    assert "mmproj-tiny.gguf is damaged" in line and said in line, line


# ---- text that spells quipu's own markers is text -------------------------------------------

MEDIA_BASE = 1 << 30


def shown_prompt(home, model, *args) -> dict:
    r = run_limited(home, "run", "-m", model, "--show-prompt", "--json", *args)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def eyes(tmp_path_factory):
    from PIL import Image
    from tinymodel import write_tiny_projector

    folder = tmp_path_factory.mktemp("eyes")
    write_tiny_gguf(folder / "tiny.gguf")
    write_tiny_projector(folder / "mmproj-tiny.gguf")
    Image.new("RGB", (50, 40), (200, 30, 90)).save(folder / "red.png")
    return folder


@pytest.mark.parametrize("spelled", ["\ue0020\ue003", "\ue0027\ue003", "\ue0040\ue005"])
def test_a_prompt_or_a_file_that_spells_a_marker_is_read_as_text(home, eyes, tmp_path, spelled):
    model, red = eyes / "tiny.gguf", eyes / "red.png"
    one = shown_prompt(home, model, "-a", red, "look")
    n_image = sum(t >= MEDIA_BASE for t in one["tokens"])
    assert n_image > 0
    (tmp_path / "notes.txt").write_text(f"before {spelled} after\n")
    for args in (["-a", red, f"look {spelled} here"], ["-a", red, "-a", tmp_path / "notes.txt", "look"]):
        view = shown_prompt(home, model, *args)
        assert sum(t >= MEDIA_BASE for t in view["tokens"]) == n_image, args  # (one image, not two)
        as_text = spelled.replace(spelled[0], "\ufffd")
        assert as_text in view["text"] and spelled not in view["text"]
    # Without a medium in the context, the text around a marker-shaped run is read once.
    plain = shown_prompt(home, model, "--raw", f"A {spelled} B")
    same = shown_prompt(home, model, "--raw", f"A {spelled.replace(spelled[0], chr(0xFFFD))} B")
    assert plain["tokens"] == same["tokens"]


def test_a_messages_file_that_spells_its_own_placeholder_gets_one_medium(home, eyes, tmp_path):
    import base64

    data = base64.b64encode((eyes / "red.png").read_bytes()).decode()
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "first \ue0040\ue005 then"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}]}]
    (tmp_path / "m.json").write_text(json.dumps(messages))
    view = shown_prompt(home, eyes / "tiny.gguf", "--messages", tmp_path / "m.json")
    one = shown_prompt(home, eyes / "tiny.gguf", "-a", eyes / "red.png", "x")
    assert sum(t >= MEDIA_BASE for t in view["tokens"]) == sum(t >= MEDIA_BASE for t in one["tokens"])


# ---- bounds on counts and totals, not only sizes ---------------------------------------------

def test_attachments_are_bounded_in_number_and_in_bytes_together(home, tiny_model, tmp_path):
    (tmp_path / "n.txt").write_text("a note\n")
    many = [a for _ in range(65) for a in ("-a", tmp_path / "n.txt")]
    line = one_line(run_limited(home, "run", "-m", tiny_model, "-n", "2", *many, "hi"), 2)
    assert "at most 64 attachments; 65 were given" in line
    urls = [a for i in range(65) for a in ("-a", f"http://127.0.0.1:9/{i}.txt")]  # (none fetched: refused first)
    assert "at most 64 attachments" in one_line(run_limited(home, "run", "-m", tiny_model, *urls, "hi"), 2)
    big = []
    for i in range(5):
        (tmp_path / f"big{i}.txt").write_bytes(b"word " * (6 << 20))  # 30 MB each
        big += ["-a", tmp_path / f"big{i}.txt"]
    assert "at most 128 MB of attachments in all" in one_line(run_limited(home, "run", "-m", tiny_model, *big, "hi"), 2)
    lines = "".join(f"/attach {tmp_path / 'n.txt'}\n" for _ in range(65)) + "/attach\n"
    chat = run_limited(home, "chat", "-m", tiny_model, "-n", "2", stdin=lines.encode())
    err = chat.stderr.decode()
    assert chat.returncode == 0 and err.count("the next message carries at most 64 attachments") == 1, err[-2000:]


def test_a_messages_file_s_media_are_bounded_and_must_be_what_their_part_says(home, eyes, tmp_path):
    import base64

    png = base64.b64encode((eyes / "red.png").read_bytes()).decode()
    text = base64.b64encode(b"plain words, no picture\n").decode()

    def messages(*parts) -> str:
        path = tmp_path / f"m{len(list(tmp_path.glob('m*.json')))}.json"
        path.write_text(json.dumps([{"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}]))
        return str(path)

    def image(data: str) -> dict:
        return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}

    cases = [
        (messages(image(text)), "is an image_url part, but what it gives is UTF-8 text, not an image"),
        (messages({"type": "input_audio", "input_audio": {"data": png, "format": "wav"}}),
         "is an input_audio part, but what it gives is PNG, not a recording"),
        (messages(image("A" * (44 << 20))), "holds more than 32 MB"),
        (messages(*[image(png)] * 65), "a messages file carries at most 64 attachments"),
    ]
    for path, said in cases:
        r = run_limited(home, "run", "-m", eyes / "tiny.gguf", "-n", "2", "--messages", path)
        assert said in one_line(r, 2), said


def test_attach_on_a_full_disk_is_one_line_and_the_chat_goes_on(home, eyes):
    from limits import small_filesystem

    sessions = home / "data" / "sessions"
    sessions.mkdir(parents=True)
    with small_filesystem(sessions, "64k"):
        with open(sessions / "filler", "wb", buffering=0) as f:  # (the disk full to its last block)
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass
        r = run_limited(home, "chat", "-m", eyes / "tiny.gguf", "-n", "2", "-S", "full",
                        stdin=f"/attach {eyes / 'red.png'}\n/attach\n".encode())
    err = r.stderr.decode()
    assert r.returncode == 0 and "unexpected" not in err and "Traceback" not in err, err
    assert "cannot keep the medium" in err and "No space left on device" in err, err
    assert "nothing is attached" in err  # (the refused file does not wait for the next message)


def test_a_reply_that_spells_a_marker_is_text_too(eyes):
    from quipu.engine.settings import ContextSettings
    from quipu.engine.llama import LlamaBackend
    from quipu.sessions.base import Message
    from quipu.sessions.conversation import Conversation
    from quipu.sessions.inference import InferenceSession
    from quipu.sessions.params import SamplingParams

    with LlamaBackend(eyes / "tiny.gguf", ContextSettings(n_ctx=2048, n_threads=2)) as backend:
        backend.media.open_projector(eyes / "mmproj-tiny.gguf")
        mark = backend.media.media_mark((eyes / "red.png").read_bytes())
        session = InferenceSession(backend, SamplingParams(seed=0))
        one = Conversation.start(session, messages=[Message("user", mark + "What?")])
        n_image = sum(t >= MEDIA_BASE for t in one.render_tokens(one.messages, True))
        conv = Conversation.start(session, messages=[Message("user", mark + "What?"),
                                                     Message("assistant", f"{mark} it is red")])
        tokens = conv.render_tokens(conv.messages, True)
        assert n_image > 0 and sum(t >= MEDIA_BASE for t in tokens) == n_image  # (the reply's is text)


DEEP = "[" * 5000 + "]" * 5000  # (past Python's recursion, reading it)


@pytest.mark.parametrize("where, words", [
    ("config", "nests values deeper than quipu reads"),
    ("role", "the role cannot be read (it nests values deeper than quipu reads)"),
    ("set", "the value nests deeper than quipu reads"),
    ("row", "its JSON nests deeper than quipu reads"),
])
def test_values_nested_past_python_s_recursion_are_one_line(quipu, home, tiny_model, tmp_path, where, words):
    config = home / "config"
    (config / "roles").mkdir(parents=True, exist_ok=True)
    if where == "config":
        (config / "config.toml").write_text(f"[generation]\nstop = {DEEP}\n")
        r = quipu("run", "-m", tiny_model, "-n", "2", "hi")
    elif where == "role":
        (config / "roles" / "deep.toml").write_text(f"system = \"x\"\n[options]\nstop = {DEEP}\n")
        r = quipu("roles", "list")
    elif where == "set":
        r = quipu("roles", "add", "deep", "--set", f"stop={DEEP}")
    else:
        (tmp_path / "rows.jsonl").write_text('{"prompt": "hi"}\n' + DEEP + "\n")
        r = quipu("run", "-m", tiny_model, "-n", "2", "--batch", tmp_path / "rows.jsonl")
        rows = [json.loads(line) for line in r.stdout.decode().splitlines()]
        assert r.returncode == 0 and "text" in rows[0] and words in rows[1]["error"], r.stderr.decode()
        return
    err = r.stderr.decode()
    assert r.returncode == 2 and words in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("args, config, said", [
    (["--top-k", "4294967297"], "", "top-k must be in [0, 2147483647]"),  # (once cut to 1 by C: greedy, exit 0)
    (["-n", "99999999999"], "", "--max-tokens must be in (0, 2147483647]"),
    ([], "[generation]\nrepeat_last_n = 4000000000\n", "repeat-last-n must be in [0, 1048576]"),  # (gigabytes)
    ([], "[generation]\ntop_k = 4294967297\n", "top-k must be in [0, 2147483647]"),
])
def test_an_integer_past_what_c_holds_or_a_sane_bound_is_refused_where_it_enters(quipu, home, tiny_model, args,
                                                                                 config, said):
    if config:
        (home / "config").mkdir(exist_ok=True)
        (home / "config" / "config.toml").write_text(config)
    r = quipu("run", "-m", tiny_model, "-n", "2", *args, "hi") if "-n" not in args else \
        quipu("run", "-m", tiny_model, *args, "hi")
    err = r.stderr.decode()
    assert r.returncode == 2 and said in err and len(err.splitlines()) == 1, err
    if config:
        return
    chat = quipu("chat", "-m", tiny_model, "-n", "2", input="/set repeat_last_n 4000000000\n/set max_tokens 3000000000\n")
    assert "repeat-last-n must be in [0, 1048576]" in chat.stderr.decode() and \
        "max_tokens must be in (0, 2147483647]" in chat.stderr.decode()


def test_doctor_refuses_a_kv_type_as_run_does(quipu, tiny_model):
    said = [quipu(*command, "-m", tiny_model, "--kv-type", "q4_0", *more) for command, more in
            ((("doctor",), ()), (("run", "-n", "2"), ("hi",)))]
    assert [r.returncode for r in said] == [2, 2]
    assert said[0].stderr == said[1].stderr == b"quipu: error: --kv-type must be one of f16, q8_0, not 'q4_0'\n"


def test_input_lines_end_at_a_new_line_only(quipu, tiny_model):
    # (U+2028, U+0085 and a form feed are no line's end in JSON lines, nor in a user's text)
    rows = '{"id": "a", "prompt": "one\u2028two"}\n{"id": "b", "prompt": "three\u0085four\\f"}\n'
    r = quipu("run", "-m", tiny_model, "-n", "2", "--batch", "-", input=rows)
    out = [json.loads(line) for line in r.stdout.decode().splitlines()]
    assert r.returncode == 0 and [row.get("id") for row in out] == ["a", "b"] and all("text" in row for row in out)
    r = quipu("embed", "-m", tiny_model, input="one\u2028two\fthree\nfour\u0085five\n")
    texts = [json.loads(line)["text"] for line in r.stdout.decode().split("\n") if line]
    assert r.returncode == 0 and texts == ["one\u2028two\fthree", "four\u0085five"]


def test_a_tool_s_result_and_the_model_s_call_reach_the_terminal_escaped(quipu, tiny_model, tmp_path):
    templates = Path(__file__).parent / "templates"
    (tmp_path / "fns.py").write_text('def scary() -> str:\n    """Clears screens."""\n'
                                     '    return "\\x1b[2J\\x1b]0;owned\\x07 done"\n')
    r = quipu("run", "-m", tiny_model, "--chat-template", templates / "Qwen-Qwen2.5-7B-Instruct.jinja",
              "--functions", tmp_path / "fns.py", "--tool-choice", "scary", "--yes", "-n", "400", "go")
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert "→ scary(" in err and "\\x1b[2J\\x1b]0;owned\\x07 done" in err and "\x1b[2J" not in err
    chat = quipu("chat", "-m", tiny_model, "-n", "2", input="/nope\x1b[2J\n")
    said = chat.stderr.decode()
    assert "unknown command /nope\\x1b[2J" in said and "\x1b[2J" not in said


@pytest.mark.parametrize("option", ["--grammar", "--schema", "--messages", "--tools", "--mcp-config", "--chat-template"])
def test_sigterm_is_acted_on_while_an_option_s_file_is_a_fifo_that_is_waited_for(home, tiny_model, tmp_path, option):
    # (the file is a FIFO whose writer sends nothing: quipu waits for it, and a SIGTERM ends the
    # wait as it ends a reply: exit 130, one line)
    import threading

    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ["QUIPU_HOME"] = str(home)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    named = f"@{fifo}" if option == "--schema" else str(fifo)
    more = {"--messages": [], "--mcp-config": ["--mcp", "notes", "hi"]}.get(option, ["hi"])
    p = subprocess.Popen([sys.executable, "-m", "quipu", "run", "-m", tiny_model, option, named, *more],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=environ)
    writer: list[int] = []
    # (open for writing returns once quipu has it open, waiting to read)
    opened = threading.Thread(target=lambda: writer.append(os.open(fifo, os.O_WRONLY)), daemon=True)
    opened.start()
    opened.join(120)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    for fd in writer:
        os.close(fd)
    assert writer and p.returncode == 130 and b"Traceback" not in err and out == b"", err.decode()


@pytest.mark.parametrize("url, said", [
    ("http://127.0.0.1:9\r", "holds a control character or a space"),  # (a line of a Windows env file)
    ("http://127.0.0.1:9/" + "a" * 70000, "longer than 8192 characters"),
    ("http://" + "a" * 300 + ".com/", "is not a name DNS can hold"),
])
def test_a_server_address_httpx_would_choke_on_is_one_line(home, url, said):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    for where in ("--url", "config"):
        if where == "config":
            (home / "config").mkdir(exist_ok=True)
            (home / "config" / "config.toml").write_text(f"[remote]\nurl = {json.dumps(url)}\n")
        args = ["--url", url] if where == "--url" else []
        r = subprocess.run([sys.executable, "-m", "quipu", "run", *args, "hi"], capture_output=True,
                           env={**environ, "QUIPU_HOME": str(home)}, timeout=120)
        err = r.stderr.decode()
        assert r.returncode == 2 and said in err and len(err.strip().splitlines()) == 1, (where, err[:300])
        assert "\r" not in err


@pytest.mark.parametrize("args", [
    ["run", b"hi \xff there"], ["run", "-a", b"/tmp/\xfe.txt", "hi"], ["roles", "add", "r", "--system", b"a\x9bd"],
    ["logs", "-q", b"\xc3"], ["run", "-m", b"model\xff.gguf", "hi"],
])
def test_an_argument_that_is_not_utf8_is_one_line(home, args):
    # (a shell hands such bytes over as they are; Python as lone surrogates, which no write takes)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ["QUIPU_HOME"] = str(home)
    r = subprocess.run([sys.executable.encode(), b"-m", b"quipu", *(a if isinstance(a, bytes) else a.encode() for a in args)],
                       capture_output=True, env=environ, stdin=subprocess.DEVNULL, timeout=120)
    line = one_line(r, 2)
    bad = next(i for i, a in enumerate(args, 1) if isinstance(a, bytes))
    assert f"argument {bad} is not UTF-8 text" in line and "\\x" in line


def test_a_role_writes_what_its_reader_takes_and_a_broken_one_stands_in_no_other_s_way(home, tiny_model):
    # control characters and DEL in a role's texts come back as they were; a value TOML cannot
    # hold (nan, inf) is refused; a role file another hand broke is named, and removed, alone
    odd = "a\x01b\x7fc\x9bd\u202e"
    one_line(run_limited(home, "roles", "add", "nan", "--set", "temperature=nan"), 2)
    one_line(run_limited(home, "roles", "add", "inf", "--set", "top_p=-inf"), 2)
    assert run_limited(home, "roles", "add", "odd", "--system", odd, "--prompt", odd + " $input").returncode == 0
    listed = run_limited(home, "roles", "list")
    assert listed.returncode == 0 and not any(c in listed.stdout.decode() for c in UNSAFE)
    r = run_limited(home, "run", "-m", tiny_model, "-R", "odd", "--show-prompt", "--json", "q")
    assert r.returncode == 0, r.stderr.decode()
    shown = json.loads(r.stdout)
    assert odd in shown["text"] and f"{odd} q" in shown["text"]
    (home / "config" / "roles" / "broken.toml").write_text("temperature = = 1\n")
    assert "broken.toml" in one_line(run_limited(home, "roles", "list"), 2)
    r = run_limited(home, "run", "-m", tiny_model, "-R", "odd", "--show-prompt", "q")
    assert r.returncode == 0, r.stderr.decode()
    assert run_limited(home, "roles", "rm", "broken").returncode == 0
    assert run_limited(home, "roles", "list").returncode == 0


def test_the_command_line_writes_only_through_its_one_writer():
    # Every write of the command line goes through cli/terminal.py (`Terminal.out`, `err`, `table`,
    # `styled`, `live`, `say_error`), which escapes outside text on a terminal: a raw write
    # anywhere else is how a control sequence from a model, a file or a server would reach it.
    import re

    raw = re.compile(r"\.write\(|(?<![\w.])print\(|Console\(|\.print\(|\.dim\(|\bLive\(")
    cli = Path(__file__).parents[1] / "src" / "quipu" / "cli"
    found = [f"{path.name}:{n}: {line.strip()}" for path in sorted(cli.glob("*.py")) if path.name != "terminal.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if raw.search(line.split("#")[0])]
    assert found == []


def test_show_prompt_escapes_outside_text_on_a_terminal_and_gives_a_pipe_the_exact_prompt(quipu, home, tiny_model):
    code, seen, _ = on_a_terminal(home, "run", "-m", tiny_model, "--show-prompt", "-s", "sys\x1b]0;owned\x07",
                                  "clear\x1b[2J it\u202e")
    assert code == 0 and "sys\\x1b]0;owned\\x07" in seen and "clear\\x1b[2J it\\u202e" in seen
    assert "\x1b]0;" not in seen and "\x1b[2J" not in seen and "\u202e" not in seen
    piped = quipu("run", "-m", tiny_model, "--show-prompt", "-s", "sys\x1b]0;owned\x07", "clear\x1b[2J it")
    assert piped.returncode == 0 and "clear\x1b[2J it" in piped.stdout.decode()  # (a pipe: the prompt exactly)


def test_settings_from_the_config_are_shown_escaped(quipu, home):
    (home / "config").mkdir(parents=True, exist_ok=True)
    (home / "config" / "config.toml").write_text('system = "be \\u001b[31mred\\u001b[0m [bold]x"\n')
    r = quipu("config", "show")
    out = r.stdout.decode()
    assert r.returncode == 0, r.stderr.decode()
    assert "be \\x1b[31mred\\x1b[0m [bold]x" in out and "\x1b" not in out


def test_the_chat_s_markdown_and_the_writer_escape_what_a_terminal_would_act_on():
    # (rendering alone: a terminal made on strings; the model's text as a reply would bring it)
    import io

    from quipu.cli.render import MarkdownRenderer
    from quipu.cli.terminal import Dim, Terminal

    out, err = io.StringIO(), io.StringIO()
    term = Terminal(io.StringIO(), out, err, False, True, True, color=False)
    renderer = MarkdownRenderer(term)
    renderer.feed("# Title\n\nclear \x1b[2J and \x1b]0;owned\x07 **bold**")
    renderer.close()
    assert "\\x1b[2J" in out.getvalue() and "\x1b" not in out.getvalue()
    term.out("a\x1b[2Jb\r\n", Dim("\u202ec"))
    term.err("\x9b31m")
    assert out.getvalue().endswith("a\\x1b[2Jb\n\\u202ec") and err.getvalue() == "\\x9b31m"
    piped = Terminal(io.StringIO(), io.StringIO(), io.StringIO(), False, False, False, color=False)
    piped.out("a\x1b[2Jb\r\n")
    assert piped.stdout.getvalue() == "a\x1b[2Jb\r\n"  # (a pipe gets the reply exactly)


def test_a_lone_surrogate_in_json_is_one_line_wherever_it_comes(quipu, home, tiny_model, tmp_path):
    # (JSON allows "\ud800", a lone half of a UTF-16 pair, which is no text: no tokenizer can take it)
    messages = tmp_path / "m.json"
    messages.write_text('[{"role": "user", "content": "\\ud800 hi"}]')
    assert "lone surrogate" in one_line(quipu("run", "-m", tiny_model, "--messages", messages, "-n", "2"), 2)
    calls = tmp_path / "calls.json"
    calls.write_text('[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": '
                     '[{"id": "1", "function": {"name": "f", "arguments": "{\\"a\\": \\"\\\\ud800\\"}"}}]}]')
    assert "lone surrogate" in one_line(quipu("run", "-m", tiny_model, "--messages", calls, "-n", "2"), 2)
    tools = tmp_path / "t.json"
    tools.write_text('[{"type": "function", "function": {"name": "f", "description": "\\ud800", '
                     '"parameters": {"type": "object"}}}]')
    assert "lone surrogate" in one_line(quipu("run", "-m", tiny_model, "-S", "s", "--tools", tools, "-n", "2", "hi"),
                                        2)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "\\ud800"}\n{"prompt": "Hi."}\n')
    r = quipu("run", "-m", tiny_model, "--batch", rows, "-n", "2")
    out = [json.loads(line) for line in r.stdout.decode().splitlines()]
    assert r.returncode == 0 and "Traceback" not in r.stderr.decode()
    assert "lone surrogate" in out[0]["error"] and "text" in out[1]
