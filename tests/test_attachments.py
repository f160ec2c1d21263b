"""Files attached to a message: known by their bytes, measured from their headers, refused in one
line when they are not what they claim or more than quipu takes; text given to the model with its
name, in `run -a` and a chat's `/attach`."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import wave

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from quipu.app.attachments import (MAX_ATTACHMENT_BYTES, MAX_IMAGE_PIXELS, attachment_of, message_with,
                                   read_attachment)
from quipu.errors import QuipuError, UsageError


def picture(fmt: str, size=(37, 23), mode="RGB", **save) -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, (200, 30, 90) if mode == "RGB" else (200, 30, 90, 128)).save(out, fmt, **save)
    return out.getvalue()


@pytest.mark.parametrize("name, data, fmt", [
    ("a.png", picture("PNG"), "PNG"),
    ("a.jpg", picture("JPEG"), "JPEG"),
    ("a.jpg", picture("JPEG", progressive=True), "JPEG"),
    ("a.webp", picture("WEBP"), "WebP"),
    ("a.webp", picture("WEBP", lossless=True), "WebP"),
    ("a.webp", picture("WEBP", mode="RGBA"), "WebP"),  # (the extended header, for its alpha)
    ("a.gif", picture("GIF"), "GIF"),
    ("a.bmp", picture("BMP"), "BMP"),
    ("picture", picture("PNG"), "PNG"),  # no ending: the bytes say it
])
def test_an_image_is_known_by_its_bytes_with_its_size_from_the_header(name, data, fmt):
    found = attachment_of(name, data)
    assert (found.kind.kind, found.kind.format, found.pixels) == ("image", fmt, (37, 23))
    assert found.describe().startswith(f"[image: {fmt}, 37x23, ")


def wav_bytes() -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\x00\x01" * 1600)
    return out.getvalue()


@pytest.mark.parametrize("name, data, fmt", [
    ("a.wav", wav_bytes(), "WAV"),
    ("a.mp3", b"ID3\x04\x00\x00\x00\x00\x00\x00" + b"\xff\xfb\x90\x64" + bytes(400), "MP3"),
    ("a.mp3", b"\xff\xfb\x90\x64" + bytes(400), "MP3"),  # (a bare MPEG frame, no tag)
    ("a.flac", b"fLaC\x80\x00\x00\x22" + bytes(10) + (16000 << 44 | 15 << 36 | 16000).to_bytes(8, "big") + bytes(16),
     "FLAC"),  # (STREAMINFO: a second at 16 kHz)
])
def test_a_recording_is_known_by_its_bytes(name, data, fmt):
    found = attachment_of(name, data)
    assert (found.kind.kind, found.kind.format, found.pixels) == ("audio", fmt, None)


def test_text_is_utf8_without_nul_and_goes_before_the_message_with_its_name():
    notes = attachment_of("notes.md", "# Plan\nñandú — 3 steps\n".encode())
    other = attachment_of("data.csv", b"\xef\xbb\xbfa,b\n1,2\n")  # (a byte-order mark is not text of the file)
    assert notes.kind.kind == "text" and notes.describe() == f"[text: {len(notes.data)} B]"
    assert message_with("What now?", [notes, other]) == (
        '<file name="notes.md">\n# Plan\nñandú — 3 steps\n</file>\n\n<file name="data.csv">\na,b\n1,2\n</file>'
        "\n\nWhat now?")


@pytest.mark.parametrize("name, data, said", [
    ("photo.png", b"just some text\n", "its name says PNG, but its bytes are UTF-8 text"),
    ("photo.png", picture("JPEG"), "its name says PNG, but its bytes are JPEG"),
    ("notes.txt", picture("PNG"), "its name says UTF-8 text, but its bytes are PNG"),
    ("blob.bin", b"\x00\x01\x02\x03\xfe", "neither UTF-8 text nor a kind of image or audio"),
    ("latin.txt", "café".encode("latin-1"), "its name says UTF-8 text, but its bytes are not UTF-8 text"),
    ("empty.txt", b"  \n", "it is empty"),
    ("cut.png", picture("PNG")[:18], "its PNG header is damaged or cut short"),
    ("cut.jpg", picture("JPEG")[:40], "its JPEG header is damaged or cut short"),
    ("zero.gif", b"GIF89a\x00\x00\x10\x00" + bytes(20), "its GIF header is damaged or cut short"),
])
def test_what_is_not_what_it_claims_is_refused_in_one_line(name, data, said):
    with pytest.raises(UsageError) as refused:
        attachment_of(name, data)
    assert said in str(refused.value) and "\n" not in str(refused.value)
    assert str(refused.value).startswith(f"cannot attach {name}: ")


def claiming(fmt: str, width: int, height: int) -> bytes:
    """A real small image whose header is changed to claim another size (a decompression bomb's
    trick: a few bytes that would decode to gigabytes)."""
    data = bytearray(picture(fmt))
    if fmt == "PNG":
        data[16:24] = struct.pack(">II", width, height)
    elif fmt == "JPEG":
        at = next(i for i in range(2, len(data) - 9) if data[i] == 0xFF and data[i + 1] == 0xC0)
        data[at + 5:at + 9] = struct.pack(">HH", height, width)
    elif fmt == "GIF":
        data[6:10] = struct.pack("<HH", width, height)
    elif fmt == "BMP":
        data[18:26] = struct.pack("<ii", width, -height)
    elif fmt == "WEBP":
        assert data[12:16] == b"VP8 "  # (the plain lossy form: 14 bits a side)
        data[26:30] = struct.pack("<HH", width, height)
    return bytes(data)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "BMP", "WEBP"])
def test_an_image_whose_header_claims_too_many_pixels_is_refused_before_it_is_decoded(fmt):
    side = 16383 if fmt == "WEBP" else 65535
    with pytest.raises(UsageError, match=rf"its header claims {side}x{side} pixels, more than the 40 million"):
        attachment_of(f"bomb.{fmt.lower()}", claiming(fmt, side, side))
    # (just under the bound is taken: the bound is the pixels, not the bytes)
    side = int(MAX_IMAGE_PIXELS ** 0.5)
    assert attachment_of(f"big.{fmt.lower()}", claiming(fmt, side, side)).pixels == (side, side)


@settings(max_examples=400 * int(os.environ.get("QUIPU_STRESS", "1")), deadline=None)
@given(st.sampled_from(["x", "x.png", "x.jpg", "x.webp", "x.gif", "x.bmp", "x.txt", "x.wav"]),
       st.sampled_from([b"", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", b"\xff\xd8\xff", b"RIFF\x00\x00\x00\x00WEBP",
                        b"GIF89a", b"BM", b"RIFF\x00\x00\x00\x00WAVE", b"fLaC", b"ID3", b"\xff\xfb"]),
       st.binary(max_size=64))
def test_any_bytes_attach_or_are_refused_in_one_line(name, head, tail):
    try:
        found = attachment_of(name, head + tail)
    except UsageError as exc:
        assert "\n" not in str(exc)
        return
    assert found.kind.kind in ("text", "image", "audio")
    if found.pixels is not None:
        assert found.pixels[0] * found.pixels[1] <= MAX_IMAGE_PIXELS


def test_a_file_too_large_a_folder_or_a_missing_one_is_refused(tmp_path):
    huge = tmp_path / "huge.txt"
    with open(huge, "wb") as f:
        f.truncate(MAX_ATTACHMENT_BYTES + 1)  # (sparse: nothing is written)
    for path, said in ((huge, f"larger than {MAX_ATTACHMENT_BYTES >> 20} MB"), (tmp_path, "it is a folder"),
                       (tmp_path / "gone.txt", "No such file")):
        with pytest.raises(UsageError, match=said):
            read_attachment(str(path))


# ---- on the command line -----------------------------------------------------------------------

def test_run_gives_the_model_each_attached_file_with_its_name_before_the_prompt(quipu, tiny_model, tmp_path):
    (tmp_path / "a.txt").write_text("alpha beta\n")
    (tmp_path / "b.md").write_text("gamma\n")
    r = quipu("run", "-m", tiny_model, "-a", tmp_path / "a.txt", "--attach", tmp_path / "b.md", "--show-prompt",
              "--json", "Which words?")
    assert r.returncode == 0, r.stderr.decode()
    text = json.loads(r.stdout)["text"]
    assert '<file name="a.txt">\nalpha beta\n</file>\n\n<file name="b.md">\ngamma\n</file>\n\nWhich words?' in text
    # A file alone is a message too; and the reply comes as for any prompt.
    r = quipu("run", "-m", tiny_model, "-a", tmp_path / "a.txt", "-n", "3", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["usage"]["completion_tokens"] == 3, r.stderr.decode()


def test_run_refuses_media_for_a_text_model_and_bad_files_in_one_line(quipu, tiny_model, tmp_path):
    (tmp_path / "photo.png").write_bytes(picture("PNG"))
    (tmp_path / "fake.png").write_text("not an image")
    (tmp_path / "talk.wav").write_bytes(wav_bytes())
    cases = [(tmp_path / "photo.png", "cannot attach photo.png [image: PNG, 37x23, "),
             (tmp_path / "talk.wav", "this model cannot hear audio (no projector beside tiny.gguf; --mmproj FILE "
                                     "gives one)"),
             (tmp_path / "fake.png", "its name says PNG, but its bytes are UTF-8 text"),
             (tmp_path / "missing.txt", "No such file")]
    for path, said in cases:
        r = quipu("run", "-m", tiny_model, "-a", path, "hi")
        err = r.stderr.decode()
        assert r.returncode == 2 and said in err and len(err.strip().splitlines()) == 1, err
    r = quipu("run", "-m", tiny_model, "-a", tmp_path / "photo.png", "--batch", "-", input="hi\n")
    assert r.returncode == 2 and "--attach cannot be used with --batch" in r.stderr.decode()


def test_a_session_keeps_an_attached_file_in_its_conversation(quipu, tiny_model, tmp_path):
    (tmp_path / "n.txt").write_text("the code is 4417\n")
    r = quipu("run", "-m", tiny_model, "-S", "files", "-a", tmp_path / "n.txt", "-n", "2", "What is the code?")
    assert r.returncode == 0, r.stderr.decode()
    shown = quipu("sessions", "export", "files", "--format", "json")
    assert shown.returncode == 0, shown.stderr.decode()
    users = [m["content"] for m in json.loads(shown.stdout)["messages"] if m["role"] == "user"]
    assert users == ['<file name="n.txt">\nthe code is 4417\n</file>\n\nWhat is the code?']


def test_chat_attach_gives_the_next_message_its_files_and_lists_what_waits(home, tiny_model, tmp_path):
    (tmp_path / "n.txt").write_text("the code is 4417\n")
    (tmp_path / "p.png").write_bytes(picture("PNG"))
    lines = (f"/attach\n/attach {tmp_path / 'n.txt'}\n/attach\n/attach {tmp_path / 'p.png'}\n"
             f"/attach {tmp_path / 'nope.txt'}\nWhat is the code?\n/attach\nAnd now?\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    env["QUIPU_HOME"] = str(home)
    r = subprocess.run([sys.executable, "-m", "quipu", "chat", "-m", tiny_model, "-n", "2", "-S", "c"],
                       input=lines.encode(), capture_output=True, env=env, timeout=300)
    err = r.stderr.decode()
    assert r.returncode == 0, err
    said = [line for line in err.splitlines() if "attach" in line or "carries" in line]
    assert said == ["nothing is attached; /attach FILE gives your next message a file",
                    "attached n.txt [text: 17 B]; it goes with your next message",
                    "your next message carries: n.txt [text: 17 B]",
                    said[3], said[4],
                    "nothing is attached; /attach FILE gives your next message a file"], err
    assert said[3].startswith("quipu: error: cannot attach p.png [image: PNG, 37x23, ")
    assert said[3].endswith("this model cannot see images (no projector beside tiny.gguf; --mmproj FILE gives one)")
    assert said[4].startswith("quipu: error: cannot attach ") and "nope.txt: No such file" in said[4]
    shown = subprocess.run([sys.executable, "-m", "quipu", "sessions", "export", "c", "--format", "json"],
                           capture_output=True, env=env)
    users = [m["content"] for m in json.loads(shown.stdout)["messages"] if m["role"] == "user"]
    assert users == ['<file name="n.txt">\nthe code is 4417\n</file>\n\nWhat is the code?', "And now?"]


def test_a_file_waiting_in_a_chat_never_sticks(home, tiny_model, tmp_path):
    """What waits for the next message is dropped by /attach off and by /reset, and with a
    message it makes too long to ever fit: the next short message goes alone."""
    (tmp_path / "big.txt").write_text(" ".join(f"word{i}" for i in range(400)))
    (tmp_path / "n.txt").write_text("the code is 4417\n")
    big, small = tmp_path / "big.txt", tmp_path / "n.txt"
    lines = (f"/attach {big}\nhello\nthe sky\n/attach {small}\n/attach off\n/attach\nblue\n"
             f"/attach {small}\n/reset\ngreen\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    env["QUIPU_HOME"] = str(home)
    r = subprocess.run([sys.executable, "-m", "quipu", "chat", "-m", tiny_model, "-n", "2", "--ctx", "256", "-S", "s"],
                       input=lines.encode(), capture_output=True, env=env, timeout=300)
    err = r.stderr.decode()
    assert r.returncode == 0 and "Traceback" not in err, err
    refusals = [line for line in err.splitlines() if "cannot fit" in line]
    assert len(refusals) == 1 and "big.txt was dropped with it" in refusals[0], err
    assert "dropped n.txt; your next message carries no file" in err and "nothing is attached" in err
    record = json.loads((home / "data" / "sessions" / "s.json").read_text())
    assert [m["content"] for m in record["messages"] if m["role"] == "user"] == ["green"]  # (after /reset)


# ---- by URL --------------------------------------------------------------------------------------

class Web(str):
    """The server's address; `requested` is set when a client asks for /drip."""

    def __new__(cls, url: str, requested):
        made = super().__new__(cls, url)
        made.requested = requested
        return made


@pytest.fixture(scope="module")
def web():
    """A web server on loopback, serving what a URL attachment may meet."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    png = picture("PNG")
    routes = {
        "/notes.txt": (200, "text/plain; charset=utf-8", b"web notes\n"),
        "/pic.png": (200, "image/png", png),
        "/download": (200, "application/octet-stream", png),
        "/lying.png": (200, "text/html", png),
        "/page": (200, "text/html", b"<html><body>a page</body></html>"),
    }

    import gzip
    import zlib

    def gzip_stream(chunks) -> bytes:
        packer = zlib.compressobj(9, zlib.DEFLATED, 31)
        return b"".join(packer.compress(c) for c in chunks) + packer.flush()

    zipped = {"/gzipped.txt": gzip.compress(b"squeezed notes\n"),
              "/bomb": gzip.compress(gzip_stream(bytes(1 << 20) for _ in range(256)))}  # 256 MB of zeros
    requested, done = threading.Event(), threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            if self.path in routes:
                status, kind, body = routes[self.path]
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            elif self.path in ("/gzipped.txt", "/bomb"):  # (once; twice, inflating past every bound)
                body = zipped[self.path]
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Encoding", "gzip" if self.path == "/gzipped.txt" else "gzip, gzip")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            elif self.path == "/drip":  # (a header a byte at a time, never done)
                requested.set()
                self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                try:
                    while not done.is_set():
                        self.wfile.write(b"X")
                        self.wfile.flush()
                        done.wait(0.2)
                except (BrokenPipeError, ConnectionResetError):
                    pass
            elif self.path in ("/moved", "/loop"):
                self.send_response(302)
                self.send_header("Location", "/notes.txt" if self.path == "/moved" else "/loop")
                self.end_headers()
            elif self.path == "/declared-huge":
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(MAX_ATTACHMENT_BYTES + 1))
                self.end_headers()
            elif self.path == "/streamed-huge":  # (no length said: the bound is counted as it comes)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                block = b"x" * (1 << 20)
                try:
                    for _ in range((MAX_ATTACHMENT_BYTES >> 20) + 2):
                        self.wfile.write(block)
                except (BrokenPipeError, ConnectionResetError):
                    pass
            else:
                self.send_error(404)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield Web(f"http://127.0.0.1:{server.server_address[1]}", requested)
    done.set()
    server.shutdown()
    server.server_close()


def test_a_url_is_fetched_and_known_by_its_bytes(web):
    notes = read_attachment(f"{web}/notes.txt")
    assert (notes.name, notes.text) == ("notes.txt", "web notes\n")
    assert read_attachment(f"{web}/moved").text == "web notes\n"  # (a redirect followed)
    assert read_attachment(f"{web}/pic.png").pixels == (37, 23)
    assert read_attachment(f"{web}/download").kind.format == "PNG"  # (a server that says only "bytes")
    assert read_attachment(f"{web}/page").kind.kind == "text"


@pytest.mark.parametrize("path, error, said", [
    ("/lying.png", UsageError, "its server says it is text/html, but its bytes are PNG"),
    ("/declared-huge", UsageError, f"larger than {MAX_ATTACHMENT_BYTES >> 20} MB"),
    ("/streamed-huge", UsageError, f"larger than {MAX_ATTACHMENT_BYTES >> 20} MB"),
    ("/missing.txt", QuipuError, "it answered 404 Not Found"),
    ("/loop", QuipuError, "it redirects more than five times"),
])
def test_a_url_that_cannot_be_attached_is_one_line(web, path, error, said):
    with pytest.raises(error) as refused:
        read_attachment(f"{web}{path}")
    assert said in str(refused.value) and "\n" not in str(refused.value)


def test_run_attaches_a_url(quipu, tiny_model, web):
    r = quipu("run", "-m", tiny_model, "-a", f"{web}/notes.txt", "--show-prompt", "What?")
    assert r.returncode == 0 and '<file name="notes.txt">\nweb notes\n</file>' in r.stdout.decode()
    r = quipu("run", "-m", tiny_model, "-a", "http://127.0.0.1:9/nothing.txt", "hi")  # (port 9: nothing listens)
    assert r.returncode == 1 and r.stderr.decode().strip() == (
        "quipu: error: cannot attach http://127.0.0.1:9/nothing.txt: connection refused")


TEMPLATES = __import__("pathlib").Path(__file__).parent / "templates"


@pytest.mark.parametrize("template, document", [
    ("ibm-granite-granite-3.3-2B-Instruct.jinja", 'document {"document_id": "n.txt"}<|end_of_role|>'),
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja", '"title": "n.txt", "text": "the code is 4417\\n"'),
])
def test_a_template_with_a_slot_for_documents_gets_the_files_there(quipu, tiny_model, tmp_path, template, document):
    (tmp_path / "n.txt").write_text("the code is 4417\n")
    (tmp_path / "m.txt").write_text("the door is red\n")
    r = quipu("run", "-m", tiny_model, "--chat-template", TEMPLATES / template, "-a", tmp_path / "n.txt",
              "--show-prompt", "What is the code?")
    shown = r.stdout.decode()
    assert r.returncode == 0 and document in shown, shown
    assert "<file" not in shown and shown.count("4417") == 1
    assert shown.index(document) <= shown.index("4417")  # (in the template's own place: Command R's after the question)
    # A session keeps its documents: a second file joins the first.
    for name, question in (("n.txt", "Code?"), ("m.txt", "Door?")):
        r = quipu("run", "-m", tiny_model, "--chat-template", TEMPLATES / template, "-S", "docs", "-n", "2",
                  "--ctx", "8192", "-a", tmp_path / name, question)  # (the tiny vocabulary spells these templates long)
        assert r.returncode == 0, r.stderr.decode()
    r = quipu("run", "-m", tiny_model, "-S", "docs", "--show-prompt", "And?")
    shown = r.stdout.decode()
    assert r.returncode == 0 and shown.count("4417") == 1 and shown.count("the door is red") == 1, shown
    assert "<file" not in shown


def test_a_compressed_body_is_read_and_one_that_inflates_past_the_bound_is_refused(web):
    from quipu.app.attachments import read_attachment

    assert read_attachment(f"{web}/gzipped.txt").data == b"squeezed notes\n"
    with pytest.raises(UsageError, match="larger than 32 MB"):
        read_attachment(f"{web}/bomb")  # (a few hundred KB sent, inflated a piece at a time)


def test_a_server_that_drips_its_headers_meets_the_deadline(web):
    from quipu.engine.http import ServerError, download

    with pytest.raises(ServerError, match="took more than 1 s"):
        download(f"{web}/drip", 1 << 20, timeout=1.0)


def test_sigterm_and_ctrl_c_are_acted_on_while_an_attachment_is_waited_for(home, tiny_model, web, tmp_path):
    import signal
    import threading

    environ = {k: v for k, v in os.environ.items() if not k.startswith("QUIPU_")}
    environ["QUIPU_HOME"] = str(home)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for source, signum in ((f"{web}/drip", signal.SIGTERM), (str(fifo), signal.SIGTERM), (str(fifo), signal.SIGINT)):
        web.requested.clear()
        p = subprocess.Popen([sys.executable, "-m", "quipu", "run", "-m", tiny_model, "-a", source, "hi"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=environ)
        writer: list[int] = []
        if source == str(fifo):  # (open for writing returns once quipu has it open, waiting to read)
            opened = threading.Thread(target=lambda held=writer: held.append(os.open(fifo, os.O_WRONLY)), daemon=True)
            opened.start()
            opened.join(120)
        else:
            assert web.requested.wait(120)
        p.send_signal(signum)
        out, err = p.communicate(timeout=60)
        for fd in writer:
            os.close(fd)
        assert p.returncode == 130 and b"Traceback" not in err and out == b"", (source, err.decode())
