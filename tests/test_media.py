"""Images in a conversation on a local model, through llama.cpp's mtmd and a tiny random
projector written by the tests (clip.cpp reads it as Gemma 3's), paired with the tiny text model."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from PIL import Image
from tinymodel import write_tiny_audio_projector, write_tiny_gguf, write_tiny_projector


def answer(quipu, vision, *args):
    r = quipu("run", "-m", vision / "tiny.gguf", "-t", "0", "-n", "12", "--json", *args)
    assert r.returncode == 0, r.stderr.decode()
    assert "clip_" not in r.stderr.decode() and "add_text" not in r.stderr.decode()  # (mtmd's log is quiet)
    return json.loads(r.stdout)


def test_the_model_sees_an_attached_image_through_the_projector_beside_it(quipu, vision):
    red = answer(quipu, vision, "-a", vision / "red.png", "What is it?")
    blue = answer(quipu, vision, "-a", vision / "blue.png", "What is it?")
    plain = answer(quipu, vision, "What is it?")
    assert red["text"] != blue["text"] and red["text"] != plain["text"]  # what it sees changes the answer
    # The same bytes under another name are the same image; the projector named is the one beside it.
    assert answer(quipu, vision, "-a", vision / "red-copy.png", "What is it?")["text"] == red["text"]
    again = answer(quipu, vision, "--mmproj", vision / "mmproj-tiny.gguf", "-a", vision / "red.png", "What is it?")
    assert again["text"] == red["text"]
    # An image is 4 positions with the projector's wrapping around it; and no cache holds it.
    assert red["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 4
    assert again["usage"]["cached_tokens"] == 0


@pytest.mark.parametrize("fmt", ["GIF", "BMP", "JPEG"])
def test_every_format_llama_cpp_reads_is_seen(quipu, vision, tmp_path, fmt):
    Image.open(vision / "red.png").save(tmp_path / f"red.{fmt.lower()}", fmt)
    Image.open(vision / "blue.png").save(tmp_path / f"blue.{fmt.lower()}", fmt)
    red = answer(quipu, vision, "-a", tmp_path / f"red.{fmt.lower()}", "What is it?")
    blue = answer(quipu, vision, "-a", tmp_path / f"blue.{fmt.lower()}", "What is it?")
    assert red["text"] != blue["text"]


def test_two_images_and_a_text_file_go_in_one_message(quipu, vision, tmp_path):
    (tmp_path / "n.txt").write_text("colors\n")
    both = answer(quipu, vision, "-a", vision / "red.png", "-a", vision / "blue.png", "-a", tmp_path / "n.txt", "Which?")
    swapped = answer(quipu, vision, "-a", vision / "blue.png", "-a", vision / "red.png", "-a", tmp_path / "n.txt",
                     "Which?")
    assert both["text"] != swapped["text"]  # (their order is kept)
    r = quipu("run", "-m", vision / "tiny.gguf", "-a", vision / "red.png", "-a", tmp_path / "n.txt", "--show-prompt",
              "Which?")
    shown = r.stdout.decode()
    assert r.returncode == 0 and shown.count("<__media__>") == 1 and '<file name="n.txt">' in shown, r.stderr.decode()
    assert shown.index("<__media__>") < shown.index("<file") < shown.index("Which?")


def test_what_a_model_cannot_take_is_refused_in_one_line(quipu, vision, tmp_path, tiny_model):
    import wave

    with wave.open(str(tmp_path / "talk.wav"), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\x00\x01" * 1600)
    Image.open(vision / "red.png").save(tmp_path / "red.webp")
    damaged = bytearray((vision / "red.png").read_bytes())
    damaged[40:60] = bytes(20)  # (its header whole, its pixels not)
    (tmp_path / "damaged.png").write_bytes(bytes(damaged))
    two = tmp_path / "two"
    two.mkdir()
    shutil.copy(vision / "tiny.gguf", two / "tiny.gguf")
    for name in ("mmproj-f16.gguf", "mmproj-f32.gguf"):
        shutil.copy(vision / "mmproj-tiny.gguf", two / name)
    cases = [
        ((vision / "tiny.gguf", "-a", tmp_path / "talk.wav"), 2,
         "this model cannot hear audio (its projector mmproj-tiny.gguf takes images)"),
        ((tiny_model, "-a", vision / "red.png"), 2, "this model cannot see images (no projector beside tiny.gguf; "
                                                   "--mmproj FILE gives one)"),
        ((two / "tiny.gguf", "-a", vision / "red.png"), 2, "no projector beside tiny.gguf"),  # (two: which one?)
        ((vision / "tiny.gguf", "-a", vision / "red.png", "--raw"), 2, "with --raw"),
        ((vision / "tiny.gguf", "-a", tmp_path / "red.webp"), 2,
         "llama.cpp reads PNG, JPEG, GIF, BMP, WAV, MP3 and FLAC files, not WebP; convert it (to PNG, say)"),
        ((vision / "tiny.gguf", "-a", tmp_path / "damaged.png"), 2, "cannot attach damaged.png [image: PNG, 50x40, "
                                                                     "128 B]: llama.cpp could not decode it"),
        ((vision / "tiny.gguf", "-a", vision / "red.png", "--mmproj", tmp_path / "none.gguf"), 2, "is not a file"),
        ((vision / "tiny.gguf", "-a", vision / "red.png", "--mmproj", vision / "tiny.gguf"), 1,
         "cannot be used: llama.cpp could not load it"),
    ]
    for (model, *args), code, said in cases:
        r = quipu("run", "-m", model, *args, "-n", "2", "hi")
        err = r.stderr.decode()
        assert r.returncode == code and said in err and "Traceback" not in err, err
        assert len([line for line in err.splitlines() if line.startswith("quipu:")]) == 1, err


@pytest.fixture(scope="module")
def vision_server(vision, tmp_path_factory):
    """llama-cpp-python's own server on the tiny model with the tiny projector (its mtmd chat
    handler), on loopback: a chat API that sees images."""
    import sys

    from servers import free_port, serve, stop

    pytest.importorskip("uvicorn", reason="llama-cpp-python[server] is in the test extras")
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "log.txt"
    proc = serve([sys.executable, "-m", "llama_cpp.server", "--model", str(vision / "tiny.gguf"), "--clip_model_path",
                  str(vision / "mmproj-tiny.gguf"), "--chat_format", "llava-1-5", "--host", "127.0.0.1", "--port",
                  str(port), "--n_ctx", "1024", "--n_threads", "2"], "/v1/models", port, log)
    yield f"http://127.0.0.1:{port}"
    stop(proc)


def test_a_chat_api_server_is_sent_the_image_as_a_content_part_and_sees_it(quipu, vision, vision_server):
    def on_server(*args):
        r = quipu("run", "--url", vision_server, "-t", "0", "-n", "8", "--json", *args)
        assert r.returncode == 0, r.stderr.decode()
        return json.loads(r.stdout)["text"]

    red = on_server("-a", vision / "red.png", "What is it?")
    assert red != on_server("-a", vision / "blue.png", "What is it?")
    assert red != on_server("What is it?")
    assert red == on_server("-a", vision / "red-copy.png", "What is it?")
    # A JPEG goes as one (its media type named in the data URL): the server decodes it alike.
    assert on_server("-a", vision / "red-again.jpg", "What is it?") != on_server("What is it?")


def test_the_parts_a_chat_api_is_sent_are_the_image_then_the_text(quipu, vision, fake, tmp_path):
    import base64

    (tmp_path / "n.txt").write_text("notes\n")
    r = quipu("run", "--url", fake.url, "-a", vision / "red-again.jpg", "-a", tmp_path / "n.txt", "What is it?")
    assert r.returncode == 0, r.stderr.decode()
    parts = fake.requests[-1][0]["messages"][-1]["content"]
    assert [p["type"] for p in parts] == ["image_url", "text"]
    url = parts[0]["image_url"]["url"]
    assert url.startswith("data:image/jpeg;base64,")
    assert base64.b64decode(url.split(",", 1)[1]) == (vision / "red-again.jpg").read_bytes()
    assert parts[1]["text"] == '<file name="n.txt">\nnotes\n</file>\n\nWhat is it?'
    r = quipu("run", "--url", fake.url, "-a", vision / "red.png", "-S", "s", "hi")
    assert r.returncode == 2 and "in a session on a server: such a session keeps text files alone" in r.stderr.decode()


def test_models_say_which_see_and_a_linked_model_finds_its_projector(quipu, vision):
    info = quipu("models", "info", vision / "tiny.gguf", "--json")
    data = json.loads(info.stdout)
    assert data["media"] == ["image"] and data["projector"] == str(vision / "mmproj-tiny.gguf")
    assert quipu("models", "add", vision / "tiny.gguf", "--name", "seer").returncode == 0
    listed = {r["name"]: r for r in json.loads(quipu("models", "list", "--json").stdout)}
    assert listed["seer"]["media"] == ["image"]
    assert "takes" in quipu("models", "list").stdout.decode()
    r = quipu("run", "-m", "seer", "-t", "0", "-n", "12", "--json", "-a", vision / "red.png", "What is it?")
    assert r.returncode == 0, r.stderr.decode()
    assert json.loads(r.stdout)["text"] == answer(quipu, vision, "-a", vision / "red.png", "What is it?")["text"]


# ---- sessions ------------------------------------------------------------------------------------

def chat(home, vision, lines: str, *args, model=None) -> list[str]:
    """A piped chat on the tiny vision model (or `model`): its replies, one a line."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    env["QUIPU_HOME"] = str(home)
    r = subprocess.run([sys.executable, "-m", "quipu", "chat", "-m", str(model or vision / "tiny.gguf"), "-t", "0", "-n",
                        "12", *args], input=lines.encode(), capture_output=True, env=env, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr.decode(), r.stderr.decode()
    assert "error" not in r.stderr.decode(), r.stderr.decode()
    return r.stdout.decode().split("\n")  # (a reply a line: a form feed in one is no line break)


def session_files(home):
    return next(home.rglob("sessions"))


def test_a_session_with_an_image_resumes_exactly_in_a_new_process(quipu, vision, home):
    def turn(*args):
        r = quipu("run", "-m", vision / "tiny.gguf", "-t", "0", "-n", "12", "--json", *args)
        assert r.returncode == 0, r.stderr.decode()
        return json.loads(r.stdout)

    first = turn("-S", "look", "-a", vision / "red.png", "What is it?")
    second = turn("-S", "look", "And now?")
    # The second process restored the context (the image's positions with it), read none of it again.
    assert second["usage"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    # As one chat that never stopped: the same replies.
    one = chat(home, vision, f"/attach {vision / 'red.png'}\nWhat is it?\nAnd now?\n", "-S", "whole")
    assert one[:2] == [first["text"], second["text"]]
    # With its state gone, the session is read again from its transcript, the image from the
    # media folder: the same answer again.
    folder = session_files(home)
    turn("-S", "look", "-a", vision / "blue.png", "What is this one?")
    for path in folder.glob("look.kv*"):
        path.unlink()
    reread = quipu("run", "-m", vision / "tiny.gguf", "-t", "0", "-n", "12", "--json", "-S", "look", "More?")
    kept = quipu("run", "-m", vision / "tiny.gguf", "-t", "0", "-n", "12", "--json", "-S", "look", "More?")
    assert reread.returncode == 0 and "re-reading its context" in reread.stderr.decode()
    # (each More? goes on from its own context: the first one's answer is the reference)
    assert json.loads(reread.stdout)["usage"]["cached_tokens"] == 0
    assert json.loads(kept.stdout)["usage"]["cached_tokens"] > 0
    record = json.loads((folder / "look.json").read_text())
    assert [m["name"] for m in record["media"]] == ["red.png", "blue.png"]
    assert record["model"]["projector"] == str(vision / "mmproj-tiny.gguf")
    assert oct((folder / "media").stat().st_mode & 0o777) == "0o700"
    for m in record["media"]:
        assert oct((folder / "media" / m["sha256"]).stat().st_mode & 0o777) == "0o600"
    # An image gone from the media folder, or changed, is one line; the transcript stays as it was.
    kept = (folder / "media" / record["media"][0]["sha256"])
    data = kept.read_bytes()
    for change, said in ((kept.unlink, "is missing"), (lambda: kept.write_bytes(data[:-1]), "is damaged")):
        change()
        r = quipu("run", "-m", vision / "tiny.gguf", "-S", "look", "Still there?")
        err = r.stderr.decode()
        assert r.returncode == 1 and err.startswith(f"quipu: error: session 'look': a medium it holds {said}"), err
        assert len(err.strip().splitlines()) == 1 and json.loads((folder / "look.json").read_text()) == record


def test_undo_over_an_image_is_exact_and_the_image_goes_with_the_last_session(quipu, vision, home):
    import os

    fresh = chat(home, vision, f"/attach {vision / 'blue.png'}\nWhat is it?\n", "-S", "fresh")
    undone = chat(home, vision, f"/attach {vision / 'red.png'}\nWhat is it?\n/undo\n/attach {vision / 'blue.png'}\n"
                                "What is it?\n", "-S", "undo")
    assert undone[-1] == fresh[-1]
    shown = json.loads(quipu("sessions", "export", "undo", "--format", "json").stdout)
    users = [m for m in shown["messages"] if m["role"] == "user"]
    assert users[0]["content"] == "[image: blue.png]\nWhat is it?"
    assert users[0]["media"][0]["name"] == "blue.png" and len(users[0]["media"][0]["sha256"]) == 64
    assert "[image: blue.png]" in quipu("sessions", "export", "undo", "--format", "markdown").stdout.decode()
    # A fork holds the same image; it goes on alike.
    assert quipu("sessions", "fork", "undo", "copy").returncode == 0
    a = quipu("run", "-m", vision / "tiny.gguf", "-t", "0", "-n", "8", "-S", "undo", "Again?").stdout
    b = quipu("run", "-m", vision / "tiny.gguf", "-t", "0", "-n", "8", "-S", "copy", "Again?").stdout
    assert a == b and a.strip()
    media = session_files(home) / "media"
    for path in media.iterdir():
        os.utime(path, (1, 1))  # (an old file: a prune leaves one just written, that a save may be naming)
    blue, red = (media / json.loads((session_files(home) / f"{n}.json").read_text())["media"][0]["sha256"]
                 for n in ("fresh", "undo"))
    assert quipu("sessions", "rm", "fresh", "undo").returncode == 0
    assert blue.exists()  # (the fork still names it)
    assert quipu("sessions", "rm", "copy").returncode == 0
    assert not blue.exists() and not any(media.iterdir())


def test_an_image_an_mcp_tool_returns_goes_to_a_model_that_sees_as_an_image(quipu, vision, home):
    import sys
    from pathlib import Path

    server = {"command": sys.executable, "args": [str(Path(__file__).parent / "mcp_server.py")]}
    config = home / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"demo": server}}))
    template = Path(__file__).parent / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
    r = quipu("run", "-m", vision / "tiny.gguf", "--chat-template", template, "--mcp", "demo", "--mcp-config", config,
              "--tool-choice", "demo_picture", "--yes", "--json", "-S", "tools", "-n", "200", "--ctx", "4096",
              "-t", "1.0", "--seed", "2", "Show me.")
    assert r.returncode == 0, r.stderr.decode()
    call = json.loads(r.stdout)["tool_calls"][0]
    assert call["result"].startswith("[image: PNG, ")  # (--json reports the note)
    record = json.loads((session_files(home) / "tools.json").read_text())
    assert [m["name"] for m in record["media"]] == ["demo_picture result"]
    assert any(t >= 1 << 30 for t in record["tokens"])  # the image's positions are in the context
    told = [m for m in json.loads(quipu("sessions", "export", "tools", "--format", "json").stdout)["messages"]
            if m["role"] == "tool"][0]
    assert told["content"] == "[image: demo_picture result]" and told["media"][0]["format"] == "PNG"


@pytest.fixture(scope="module")
def vision_llama_server(vision, tmp_path_factory):
    """llama.cpp's own llama-server on the tiny model with the tiny projector (--mmproj)."""
    from servers import free_port, llama_server_program, serve, stop

    exe = llama_server_program()
    port = free_port()
    base = tmp_path_factory.mktemp("vision-llama-server")
    proc = serve([str(exe), "-m", str(vision / "tiny.gguf"), "--mmproj", str(vision / "mmproj-tiny.gguf"), "--host",
                  "127.0.0.1", "--port", str(port), "-c", "1024", "-t", "2", "--no-webui"], "/health", port,
                 base / "log.txt")
    yield f"http://127.0.0.1:{port}"
    stop(proc)


def test_llama_server_is_given_an_image_through_its_chat_api(quipu, vision, vision_llama_server):
    def on_server(*args):
        r = quipu("run", "--url", vision_llama_server, "-t", "0", "-n", "12", "--json", *args)
        assert r.returncode == 0, r.stderr.decode()
        return json.loads(r.stdout)["text"], r.stderr.decode()

    red, blue = (on_server("-a", vision / f"{name}.png", "What is it?")[0] for name in ("red", "blue"))
    assert red != blue and red == on_server("-a", vision / "red-copy.png", "What is it?")[0]
    said = on_server("-a", vision / "red.png", "--verbose", "What?")[1]
    assert "given this turn's media through its chat API" in said
    r = quipu("run", "--url", vision_llama_server, "-a", vision / "red.png", "-S", "s", "hi")
    assert r.returncode == 2 and "in a session on a server" in r.stderr.decode()


def test_the_media_of_sessions_count_in_their_disk_budget(quipu, vision, home, tmp_path):
    import numpy as np

    noise = np.random.default_rng(1).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    Image.fromarray(noise).save(tmp_path / "noise.png")  # (about 900 KB: it does not compress)
    run = ["run", "-m", vision / "tiny.gguf", "-t", "0", "-n", "4"]
    assert quipu(*run, "-S", "a", "-a", tmp_path / "noise.png", "What?").returncode == 0
    assert quipu(*run, "-S", "b", "Hi.").returncode == 0
    folder = session_files(home)
    states = sum(p.stat().st_size for p in folder.glob("*.kv*"))
    media = sum(p.stat().st_size for p in (folder / "media").iterdir())
    assert media > states + 200_000
    # Room for the states and what b's next turn adds, not for the image as well.
    config = home / "config" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(f"[sessions]\nmax_state_bytes = {states + 100_000}\n")
    r = quipu(*run, "-S", "b", "Again.")
    assert r.returncode == 0 and "session 'a' lost its saved context to the disk budget" in r.stderr.decode()
    assert not (folder / "a.kv").exists() and (folder / "b.kv").exists()
    # What a lost: its snapshot, not its image; it is read again, the image with it.
    again = quipu(*run, "-S", "a", "--json", "More?")
    assert again.returncode == 0 and "re-reading its context" in again.stderr.decode()


def test_the_prompt_cache_keys_an_image_by_its_bytes_and_answers_as_without_it(quipu, vision):
    doc = "the sky is blue and the world is hello " * 20  # (a beginning long enough for the cache: 2 steps)

    def ask(image, question, *more):
        r = quipu("run", "-m", vision / "tiny.gguf", "-t", "0", "-n", "8", "--json", "--ctx", "2048",
                  "-a", vision / image, *more, question, input=doc)
        assert r.returncode == 0, r.stderr.decode()
        return json.loads(r.stdout)

    ask("red.png", "First question?")
    again = ask("red-copy.png", "Second question?")  # (the same bytes: the same image)
    assert again["usage"]["cached_tokens"] >= 256
    assert again["text"] == ask("red.png", "Second question?", "--no-cache")["text"]
    other = ask("blue.png", "Second question?")  # another image early in the prompt: little of it is held
    assert other["usage"]["cached_tokens"] < 64
    assert other["text"] == ask("blue.png", "Second question?", "--no-cache")["text"]
    # The same image through another projector is another context: what the first made of it is not taken.
    write_tiny_projector(vision.parent / "mmproj-other.gguf", seed=7)
    through = ("--mmproj", vision.parent / "mmproj-other.gguf")
    elsewhere = ask("red.png", "Second question?", *through)
    assert elsewhere["usage"]["cached_tokens"] < 64
    assert elsewhere["text"] == ask("red.png", "Second question?", "--no-cache", *through)["text"]


@pytest.fixture(scope="module")
def hearing(tmp_path_factory):
    """The tiny model with a tiny audio projector beside it, and two tones to hear."""
    import math
    import struct
    import wave

    folder = tmp_path_factory.mktemp("hearing")
    write_tiny_gguf(folder / "tiny.gguf")
    write_tiny_audio_projector(folder / "mmproj-audio.gguf")
    for name, pitch in (("low", 220), ("high", 3000)):
        with wave.open(str(folder / f"{name}.wav"), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(16000)
            w.writeframes(b"".join(struct.pack("<h", int(12000 * math.sin(2 * math.pi * pitch * i / 16000)))
                                   for i in range(16000)))
    return folder


def test_the_model_hears_an_attached_recording_and_a_session_keeps_it(quipu, hearing, home):
    def hear(*args):
        r = quipu("run", "-m", hearing / "tiny.gguf", "-t", "0", "-n", "8", "--json", *args)
        assert r.returncode == 0, r.stderr.decode()
        return json.loads(r.stdout)

    low, high = (hear("-a", hearing / f"{n}.wav", "What is it?") for n in ("low", "high"))
    assert low["text"] != high["text"] and low["usage"]["prompt_tokens"] > 750  # (a second: one 30 s piece)
    first = hear("-S", "ears", "-a", hearing / "low.wav", "What is it?")
    assert first["text"] == low["text"]
    second = hear("-S", "ears", "And now?")
    assert second["usage"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    # Its state dropped, the session is read again, the recording encoded again: as a copy that kept it.
    assert quipu("sessions", "fork", "ears", "copy").returncode == 0
    for path in session_files(home).glob("ears.kv*"):
        path.unlink()
    kept = json.loads((session_files(home) / "ears.json").read_text())
    assert [(m["kind"], m["format"]) for m in kept["media"]] == [("audio", "WAV")]
    reread = quipu("run", "-m", hearing / "tiny.gguf", "-t", "0", "-n", "8", "-S", "ears", "More?")
    assert reread.returncode == 0 and "re-reading its context" in reread.stderr.decode()
    assert reread.stdout == hear("-S", "copy", "More?")["text"].encode() + b"\n"
    Image.new("RGB", (8, 8)).save(home / "dot.png")
    r = quipu("run", "-m", hearing / "tiny.gguf", "-a", home / "dot.png", "hi")
    assert r.returncode == 2 and "this model cannot see images (its projector mmproj-audio.gguf takes audio)" \
        in r.stderr.decode()


def test_a_messages_file_s_image_parts_are_seen_as_an_attached_image(quipu, vision, tmp_path, fake):
    import base64

    data = base64.b64encode((vision / "red.png").read_bytes()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
                                             {"type": "text", "text": "What is it?"}]}]
    (tmp_path / "m.json").write_text(json.dumps(messages))
    assert answer(quipu, vision, "--messages", tmp_path / "m.json")["text"] == \
        answer(quipu, vision, "-a", vision / "red.png", "What is it?")["text"]
    # On a chat API, the part goes on as a part.
    r = quipu("run", "--url", fake.url, "--messages", tmp_path / "m.json")
    assert r.returncode == 0, r.stderr.decode()
    sent = fake.requests[-1][0]["messages"][-1]["content"]
    assert [p["type"] for p in sent] == ["image_url", "text"] and sent[0]["image_url"]["url"].endswith(data)
    # What is not an image is said where it is.
    messages[0]["content"][0]["image_url"]["url"] = "data:image/png;base64,@@@"
    (tmp_path / "bad.json").write_text(json.dumps(messages))
    r = quipu("run", "-m", vision / "tiny.gguf", "--messages", tmp_path / "bad.json")
    assert r.returncode == 2 and "messages[0].content[0].image_url is neither an http(s) URL nor base64 data" in \
        r.stderr.decode()


def test_a_session_keeps_the_projector_it_was_given_for_the_images_that_come_later(quipu, vision, tmp_path):
    import shutil

    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(vision / "tiny.gguf", alone / "tiny.gguf")  # (no projector beside it)
    run = ["run", "-m", alone / "tiny.gguf", "-t", "0", "-n", "12", "--json"]
    assert quipu(*run, "-S", "later", "--mmproj", vision / "mmproj-tiny.gguf", "Hello.").returncode == 0
    r = quipu(*run, "-S", "later", "-a", vision / "red.png", "What is it?")
    assert r.returncode == 0, r.stderr.decode()
    seen = json.loads(r.stdout)["usage"]["prompt_tokens"]
    assert seen > json.loads(quipu(*run, "-S", "blind", "Hello.").stdout)["usage"]["prompt_tokens"] + 4
    r = quipu(*run, "--mmproj", tmp_path / "none.gguf", "Hello.")
    assert r.returncode == 2 and "the projector" in r.stderr.decode() and "is not a file" in r.stderr.decode()


@pytest.fixture(scope="module")
def mrope(tmp_path_factory):
    """A tiny M-RoPE pair, as Qwen2-VL is: a text model of architecture qwen2vl, and its projector."""
    from tinymodel import write_tiny_mrope_projector

    folder = tmp_path_factory.mktemp("mrope")
    write_tiny_gguf(folder / "tiny-vl.gguf", architecture="qwen2vl", rope_sections=[4, 6, 6, 0])
    write_tiny_mrope_projector(folder / "mmproj-vl.gguf")
    return folder


def llama_cpp_reads(model, projector, image, text: str) -> list[float]:
    """The logits after llama.cpp's own helper reads `text` with `image` at its marker
    (`mtmd_helper_eval_chunks`, as llama-mtmd-cli does), on a fresh context."""
    import ctypes

    from quipu.engine.native import lc, load_mtmd

    m = load_mtmd()
    mp = lc.llama_model_default_params()
    llm = lc.llama_model_load_from_file(str(model).encode(), mp)
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 1024, 256, 256, 2, 2
    cp.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED  # (as quipu computes attention on the CPU)
    ctx = lc.llama_init_from_model(llm, cp)
    params = m.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.warmup = False, 2, False
    mctx = m.mtmd_init_from_file(str(projector).encode(), llm, params)
    data = image.read_bytes()
    bitmap = m.mtmd_helper_bitmap_init_from_buf(mctx, (ctypes.c_ubyte * len(data)).from_buffer_copy(data), len(data),
                                                False)
    chunks = m.mtmd_input_chunks_init()
    raw = text.replace("<IMAGE>", m.mtmd_default_marker().decode()).encode()
    given = m.mtmd_input_text(raw, len(raw), True, True)
    assert m.mtmd_tokenize(mctx, chunks, ctypes.byref(given), (m.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
    done = lc.llama_pos(0)
    assert m.mtmd_helper_eval_chunks(mctx, ctx, chunks, 0, 0, 256, True, ctypes.byref(done)) == 0
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(llm))
    logits = lc.llama_get_logits_ith(ctx, -1)
    out = [logits[i] for i in range(n_vocab)]
    m.mtmd_input_chunks_free(chunks)
    m.mtmd_bitmap_free(bitmap)
    m.mtmd_free(mctx)
    lc.llama_free(ctx)
    lc.llama_model_free(llm)
    return out


@pytest.mark.parametrize("pair", ["gemma3", "mrope"])
def test_a_prompt_with_an_image_is_read_as_llama_cpp_reads_it(pair, vision, mrope):
    from quipu.engine.settings import ContextSettings
    from quipu.engine.llama import LlamaBackend
    from quipu.sessions.prompt import Rendered

    model, projector = ((vision / "tiny.gguf", vision / "mmproj-tiny.gguf") if pair == "gemma3"
                        else (mrope / "tiny-vl.gguf", mrope / "mmproj-vl.gguf"))
    text = "<|im_start|>user\n<IMAGE>What is it?<|im_end|>\n<|im_start|>assistant\n"
    theirs = llama_cpp_reads(model, projector, vision / "red.png", text)
    with LlamaBackend(model, ContextSettings(n_ctx=1024, n_threads=2)) as backend:
        backend.media.open_projector(projector)
        mark = backend.media.media_mark((vision / "red.png").read_bytes())
        tokens = [backend.vocab.bos_token()] + Rendered([(text.replace("<IMAGE>", mark), False)]).tokenize_from(backend.vocab, 0)
        backend.prefill(tokens, 0)
        from quipu.engine.native import lc

        row = lc.llama_get_logits_ith(backend.native.ptr, -1)  # (the context's own logits, as llama.cpp's above)
        ours = [row[i] for i in range(backend.n_vocab)]
        assert backend.memory.positions() == len(tokens)
        assert ours == theirs  # (the same positions, the same numbers: bit for bit)


def test_an_m_rope_session_resumes_and_is_read_again_alike_and_its_cache_answers_as_without(quipu, mrope, vision,
                                                                                              home):
    def turn(*args, stdin=None):
        r = quipu("run", "-m", mrope / "tiny-vl.gguf", "-t", "0", "-n", "12", "--json", *args, input=stdin)
        assert r.returncode == 0, r.stderr.decode()
        return json.loads(r.stdout)

    first = turn("-S", "a", "-a", vision / "red.png", "What is it?")
    kept = turn("-S", "a", "And now?")
    assert kept["usage"]["cached_tokens"] >= first["usage"]["prompt_tokens"]  # (restored, image and all)
    assert turn("-S", "b", "-a", vision / "red.png", "What is it?")["text"] == first["text"]
    for path in session_files(home).glob("b.kv*"):
        path.unlink()
    assert turn("-S", "b", "And now?")["text"] == kept["text"]  # (read again: the image's positions alike)
    doc = "the sky is blue and the world is hello " * 20
    turn("-a", vision / "red.png", "First?", stdin=doc)
    cached = turn("-a", vision / "red.png", "Second?", stdin=doc)
    assert cached["usage"]["cached_tokens"] >= 256
    assert cached["text"] == turn("-a", vision / "red.png", "Second?", "--no-cache", stdin=doc)["text"]
    # /undo over the image's turn: the context goes back, and a turn with another image is a fresh one's.
    model = mrope / "tiny-vl.gguf"
    fresh = chat(home, vision, f"/attach {vision / 'blue.png'}\nWhat is it?\n", "-S", "m-fresh", model=model)
    undone = chat(home, vision, f"/attach {vision / 'red.png'}\nWhat is it?\n/undo\n/attach {vision / 'blue.png'}\n"
                                "What is it?\n", "-S", "m-undo", model=model)
    assert undone[-1] == fresh[-1]


IMAGES_FIRST = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
                "{% else %}{% for p in m.content %}{% if p.type == 'image' %}<image>{% endif %}{% endfor %}"
                "{% for p in m.content %}{% if p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_an_image_goes_where_the_chat_template_puts_an_image_part(quipu, vision, tmp_path):
    import base64

    from quipu.sessions.template import ChatTemplate

    templates = Path(__file__).parent / "templates"
    # What a template writes for an image part, found by rendering one: the model's own placeholder.
    assert ChatTemplate((templates / "Qwen3.5-4B.jinja").read_text()).image_placeholder == \
        "<|vision_start|><|image_pad|><|vision_end|>"
    assert ChatTemplate((templates / "Mistral-Small-3.2-24B-Instruct-2506.jinja").read_text()).image_placeholder == \
        "[IMG]"
    assert ChatTemplate(None).image_placeholder is None  # (ChatML reads text alone: the marker stays in it)
    (tmp_path / "first.jinja").write_text(IMAGES_FIRST)
    data = base64.b64encode((vision / "red.png").read_bytes()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look: "},
                                             {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}]}]
    (tmp_path / "m.json").write_text(json.dumps(messages))
    shown = {}
    for name, template in (("placed", tmp_path / "first.jinja"), ("joined", None)):
        r = quipu("run", "-m", vision / "tiny.gguf", "--messages", tmp_path / "m.json", "--show-prompt",
                  *(("--chat-template", template) if template else ()))
        assert r.returncode == 0, r.stderr.decode()
        shown[name] = r.stdout.decode()
    assert shown["placed"].index("<__media__>") < shown["placed"].index("Look:")  # (the template puts images first)
    assert shown["joined"].index("Look:") < shown["joined"].index("<__media__>")  # (ChatML: where the part was)
    assert "<image>" not in shown["placed"]
    # A template's own placeholder is not written beside the projector's wrapping.
    r = quipu("run", "-m", vision / "tiny.gguf", "--chat-template", templates / "Qwen3.5-4B.jinja", "--ctx", "8192",
              "-a", vision / "red.png", "--show-prompt", "What is it?")
    assert r.returncode == 0 and "<__media__>" in r.stdout.decode() and "image_pad" not in r.stdout.decode()


@pytest.mark.parametrize("kind", ["image", "audio", "mrope"])
@pytest.mark.parametrize("sampling", [("-t", "0"), ("-t", "0.9", "--seed", "5")])
def test_a_reply_cut_in_a_turn_with_a_medium_goes_on_as_the_uninterrupted_one(quipu, vision, hearing, mrope, kind,
                                                                                sampling):
    model, medium = {"image": (vision / "tiny.gguf", vision / "red.png"),
                     "audio": (hearing / "tiny.gguf", hearing / "low.wav"),
                     "mrope": (mrope / "tiny-vl.gguf", vision / "red.png")}[kind]

    def turn(*args):
        r = quipu("run", "-m", model, *sampling, "--json", *args)
        assert r.returncode == 0, r.stderr.decode()
        return json.loads(r.stdout)

    whole = turn("-S", "whole", "-a", medium, "-n", "16", "What is it?")
    cut = turn("-S", "cut", "-a", medium, "-n", "5", "What is it?")
    more = turn("-S", "cut", "--continue", "-n", "11")  # (a new process: the session restored)
    assert cut["text"] + more["text"] == whole["text"]
    assert more["usage"]["cached_tokens"] == more["usage"]["prompt_tokens"] - 1  # (nothing read again)


def test_an_image_stays_while_a_branch_names_it_and_leaves_with_the_last_session(quipu, vision, home):
    red = vision / "red.png"
    one = chat(home, vision, f"/attach {red}\nWhat is it?\n/undo\nhello\n", "-S", "undone")
    assert len([line for line in one if line]) == 2
    folder = session_files(home)
    record = json.loads((folder / "undone.json").read_text())
    # The current branch holds none; the exchange /undo took back is a branch, which holds it.
    assert record["media"] == []
    assert [m["name"] for b in record["tree"]["branches"] for m in b.get("media", [])] == ["red.png"]
    assert len(list((folder / "media").iterdir())) == 1
    # The current branch made a session of its own, the original removed: nothing names it (an
    # hour later: a medium written in the last minutes may be a turn's still saving).
    assert quipu("sessions", "fork", "undone", "plain", "--branch", record["tree"]["current"]["id"]).returncode == 0
    for path in (folder / "media").iterdir():
        os.utime(path, (path.stat().st_atime - 3600, path.stat().st_mtime - 3600))
    assert quipu("sessions", "rm", "undone").returncode == 0
    assert not list((folder / "media").iterdir())
    r = quipu("run", "-m", vision / "tiny.gguf", "-t", "0", "-n", "4", "--json", "-S", "plain", "-a", red, "And?")
    assert r.returncode == 0, r.stderr.decode()
    assert [m["name"] for m in json.loads((folder / "plain.json").read_text())["media"]] == ["red.png"]
