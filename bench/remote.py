"""Servers: quipu on llama-server (by tokens, a slot kept between turns) and on the chat API, against the bare API."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import HERE, quipu_cmd, median, context_text, first_byte


REMOTE_CODE = """
import itertools, json, sys, tempfile, time
import httpx
from quipu.app.environment import Environment
from quipu.app.turn_options import TurnOptions
from quipu.app.llama_server import LlamaServerHost, open_llama_server
from quipu.engine.llama_server import LlamaServerModel, llama_server_props
from quipu.app.named import NamedSession, store_for
from quipu.app.turns import ReplySink
from quipu.engine.chat_api import ChatApiModel
from quipu.engine.http import ServerSettings
from quipu.sessions.conversation import Conversation
url, n, long_text = sys.argv[1], int(sys.argv[2]), sys.stdin.read()
home = tempfile.TemporaryDirectory()  # (removed at exit)
env = Environment.load({"QUIPU_HOME": home.name})
store, opts, names = store_for(env), TurnOptions.of(temperature=0, seed=1), itertools.count()
question = "Write a long story about a river."
params = {"temperature": 0, "seed": 1}
client = httpx.Client(timeout=600)


def idle():  # each timed request starts on an idle server (a slot is released a moment after its reply)
    while any(slot.get("is_processing") for slot in client.get(url + "/slots").json()):
        time.sleep(0.001)


def figures(started, stamps):
    return {"ttft": stamps[0] - started, "tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0])}


def bare(messages, slot=-1):  # the chat API, streamed, nothing else
    body = {"model": "m", "messages": messages, "stream": True, "max_tokens": n, "id_slot": slot, **params}
    stamps = []
    idle()
    started = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: [DONE]"):
                break  # (read to its very end, the connection would be kept, and llama-server drops it)
            if line.startswith("data:"):
                event = json.loads(line[5:])
                if any((c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
                    stamps.append(time.perf_counter())
    return figures(started, stamps)


class Stamps(ReplySink):
    def __init__(self):
        self.at = []

    def text(self, piece):
        self.at.append(time.perf_counter())


def through_chat_api(remote, messages):  # how quipu asks any other server (its chat API client)
    stamps = Stamps()
    idle()
    started = time.perf_counter()
    remote.chat(messages, params=params, max_tokens=n, sink=stamps)
    return figures(started, stamps.at)


def by_tokens(conv, text):  # `quipu run -S` / `quipu chat` on llama-server: a turn of an open session
    stamps = Stamps()
    idle()
    started = time.perf_counter()
    conv.send(text, max_tokens=n, sink=stamps)
    return figures(started, stamps.at)


def one_shot(client, text):  # `quipu run --url` on llama-server: /props, the BOS, a new context, by tokens
    stamps = Stamps()
    idle()
    started = time.perf_counter()
    # (/props asked anew, as each process does; the client itself, like the bare one, made before)
    conv = Conversation.start(LlamaServerHost(LlamaServerModel(client, llama_server_props(client)), url)
                              .create(opts, env).session)
    conv.send(text, max_tokens=n, sink=stamps)
    return figures(started, stamps.at)


def conversation(host):  # a new named session, its context kept in its slot between turns
    return NamedSession.open(store, f"s{next(names)}", opts, env, host).conversation


out = {k: [] for k in ("bare", "chat_api", "one_shot", "tokens", "later_bare", "later_tokens")}
asked = [{"role": "user", "content": question}]
for slot in (0, 1):  # each slot has read the question once before anyone is timed
    bare(asked, slot)
remote = ChatApiModel(ServerSettings(url=url))
served = open_llama_server(ServerSettings(url=url))
for _ in range(3):  # each in turn, so that a moment's load falls on all of them alike
    out["bare"].append(bare(asked))
    out["chat_api"].append(through_chat_api(remote, asked))
    out["one_shot"].append(one_shot(remote, question))
    out["tokens"].append(by_tokens(conversation(served), question))
# A later turn of a long conversation, each client on a slot of its own (the session on its
# slot, the bare client on the other), each slot holding the conversation and the client's
# previous question, which the next one differs from in its first token.
conv = conversation(served)
conv.send(long_text, max_tokens=8)
so_far = [{"role": m.role, "content": m.content} for m in conv.messages]
other = 1 - conv.session.slot
bare(so_far + [{"role": "user", "content": "Go on."}], other)
by_tokens(conv, "Go on.")
conv.undo()
for i in range(3):
    out["later_bare"].append(bare(so_far + [{"role": "user", "content": f"{i}. Go on."}], other))
    out["later_tokens"].append(by_tokens(conv, f"{i}. Go on."))
    conv.undo()
print(json.dumps(out))
"""

def bench_remote(model: str, threads: int, repeats: int) -> list[dict]:
    """Through quipu against a bare HTTP client (httpx), the same request to the same
    llama-server on loopback: time to first token and decode rate, as seen by the client."""
    from bench import llamacpp

    exe = llamacpp.program("llama-server")
    if exe is None:
        return [{"what": "llama-server not built (python -m bench.llamacpp llama-server); remote not measured",
                 "quipu": ""}]
    sys.path.insert(0, str(HERE.parent / "tests"))
    from servers import free_port, serve, stop

    import urllib.request

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        slots = Path(tmp) / "slots"
        slots.mkdir()
        proc = serve([str(exe), "-m", model, "--host", "127.0.0.1", "--port", str(port), "-c", "8192", "-np", "2",
                      "-t", str(threads), "--no-webui", "--slot-save-path", str(slots)], "/health", port,
                     Path(tmp) / "log.txt")
        try:
            url = f"http://127.0.0.1:{port}"
            doc = context_text(model, 1400)
            got = [json.loads(subprocess.run([sys.executable, "-c", REMOTE_CODE, url, "128"], input=doc.encode(),
                                             capture_output=True, check=True).stdout) for _ in range(repeats)]
            for made in slots.glob("quipu-*.bin"):  # (the slot files of the sessions timed above)
                made.unlink()
            # A 1,400-token session resumed after the server's slot went to someone else: its slot
            # file restored, against the same turn with no file (the conversation read again).
            env = {"QUIPU_HOME": str(Path(tmp) / "home")}
            quipu_cmd("run", "--url", url, "-S", "long", "-n", "8", "-t", "0", "Read this.", stdin=doc.encode(), env=env)

            def erase() -> None:
                for slot in (0, 1):
                    request = urllib.request.Request(f"{url}/slots/{slot}?action=erase", data=b"{}", method="POST")
                    urllib.request.urlopen(request, timeout=30).close()

            restored, reread = [], []
            turn = [sys.executable, "-m", "quipu", "run", "--url", url, "-S", "long", "-n", "4", "-t", "0", "Go on."]
            for _ in range(repeats):
                erase()
                restored.append(first_byte(turn, env))
                [kept] = slots.glob("quipu-*.bin")
                data = kept.read_bytes()
                kept.unlink()
                erase()
                reread.append(first_byte(turn, env))  # (the turn saves a new file: put the old one back)
                for extra in slots.glob("quipu-*.bin"):
                    extra.unlink()
                kept.write_bytes(data)
        finally:
            stop(proc)
    rows = [{"what": "resume a ~1,400-token session on llama-server, first token, whole process: slot file "
                     "restored vs the conversation read again (s)",
             "quipu": round(median(restored), 3), "re-read from scratch": round(median(reread), 3),
             "ratio": round(median(restored) / median(reread), 3)}]
    # Above 1: quipu is the faster. The bare client sends the same conversation to the chat API.
    for mine, theirs, what in (
            ("chat_api", "bare", "quipu's chat API client (as other servers are asked), a new question"),
            ("one_shot", "bare", "`run --url` one-shot by tokens (/props and the BOS asked first), a new question"),
            ("tokens", "bare", "a session by tokens (`run -S`, `chat`), a new question"),
            ("later_tokens", "later_bare", "a session by tokens, a turn after a ~1,400-token one, a slot each")):
        for key, measure in (("ttft", "time to first token (s)"), ("tok_s", "decode tok/s")):
            q = median([f[key] for g in got for f in g[mine]])
            b = median([f[key] for g in got for f in g[theirs]])
            rows.append({"what": f"llama-server on loopback, 128 tokens, {what}: {measure}, quipu vs a bare "
                                 "httpx client", "quipu": round(q, 3), "llama.cpp": f"{b:.3f} (bare client)",
                         "ratio": round(b / q if key == "ttft" else q / b, 3)})
    return rows
