"""`quipu serve` against llama.cpp's llama-server (built from the vendored sources), the same
model and context, each asked by the same bare HTTP client (httpx, the chat API, streamed): one
stream's decode, a new request's first token, eight streams at once, a long conversation's next
turn after each server is restarted, and resident memory."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from bench.common import HERE, context_text, median

CTX = 4096
DECODE = 128


def stream(url: str, messages: list[dict], n: int) -> dict:
    """One streamed chat request: seconds to its first piece of text, and its decode rate."""
    import httpx

    body = {"model": "", "messages": messages, "stream": True, "max_tokens": n, "temperature": 0, "seed": 1}
    stamps: list[float] = []
    started = time.perf_counter()
    with httpx.Client(timeout=600) as client, client.stream("POST", url + "/v1/chat/completions",
                                                            json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: [DONE]"):
                break
            if line.startswith("data:"):
                event = json.loads(line[5:])
                if any((c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
                    stamps.append(time.perf_counter())
    if len(stamps) < 2:
        raise RuntimeError(f"{url} answered {len(stamps)} pieces")
    return {"ttft": stamps[0] - started, "tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
            "pieces": len(stamps)}


def at_once(url: str, n_streams: int, n: int, question: Callable[[int], str]) -> float:
    """Total pieces a second, `n_streams` streams asked at once (from the first request to the last piece)."""
    counts = [0] * n_streams
    failures: list[BaseException] = []

    def one(i: int) -> None:
        try:
            counts[i] = stream(url, [{"role": "user", "content": question(i)}], n)["pieces"]
        except BaseException as exc:  # (said below: a bench run fails loudly)
            failures.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n_streams)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    return sum(counts) / (time.perf_counter() - started)


def forty(url: str, clients: int = 40) -> dict:
    """`clients` requests at once, half streamed: how many were answered whole, refused with 503
    before any body, or failed another way (an error inside a 200 among them); and the slowest
    `/health` poll meanwhile (s)."""
    import httpx

    kinds: list[str] = []
    polls: list[float] = []
    done = threading.Event()
    body = {"model": "", "messages": [{"role": "user", "content": "Tell me about rivers."}], "max_tokens": 48}

    def one(i: int) -> None:
        try:
            with httpx.Client(timeout=600) as client, client.stream(
                    "POST", url + "/v1/chat/completions", json={**body, "stream": i % 2 == 0}) as r:
                text = r.read().decode()
            ok = r.status_code == 200 and '"error"' not in text
            kinds.append("whole" if ok else "503" if r.status_code == 503 and r.headers.get("retry-after") else "other")
        except httpx.HTTPError:
            kinds.append("other")

    def health() -> None:
        with httpx.Client(timeout=60) as client:
            while not done.is_set():
                started = time.perf_counter()
                client.get(url + "/health")
                polls.append(time.perf_counter() - started)
                done.wait(0.02)

    poller = threading.Thread(target=health)
    poller.start()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    poller.join()
    return {"whole": kinds.count("whole"), "refused": kinds.count("503"), "other": kinds.count("other"),
            "health": max(polls)}


def exit_after_sigterm(proc: subprocess.Popen, url: str) -> float:
    """Seconds from SIGTERM, sent while two long replies stream, to the process's exit."""
    import signal

    import httpx

    going = threading.Barrier(3)

    def reply() -> None:
        body = {"model": "", "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 2000,
                "stream": True}
        try:
            with httpx.Client(timeout=600) as client, client.stream("POST", url + "/v1/chat/completions",
                                                                    json=body) as r:
                lines = r.iter_lines()
                next(lines)
                going.wait()
                for _ in lines:
                    pass
        except (httpx.HTTPError, StopIteration):
            pass

    threads = [threading.Thread(target=reply) for _ in range(2)]
    for t in threads:
        t.start()
    going.wait()
    started = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    proc.wait()
    took = time.perf_counter() - started
    for t in threads:
        t.join()
    return took


def rss_peak(pid: int) -> int:
    """A process's peak resident memory, in bytes (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def bench_serve(model: str, threads: int, repeats: int) -> list[dict]:
    from bench import llamacpp

    exe = llamacpp.program("llama-server")
    if exe is None:
        return [{"what": "llama-server not built (python -m bench.llamacpp llama-server); serve not measured",
                 "quipu": ""}]
    sys.path.insert(0, str(HERE.parent / "tests"))
    from servers import free_port, serve, stop

    doc = context_text(model, 3000)
    turn1 = [{"role": "system", "content": "Answer in one short sentence."},
             {"role": "user", "content": "Read this.\n\n" + doc}]
    following = turn1 + [{"role": "assistant", "content": "It is a passage about rivers."},
                         {"role": "user", "content": "Say more."}]
    figures: dict[str, dict[str, list[float]]] = {"quipu": {}, "llama.cpp": {}}

    def put(who: str, key: str, value: float) -> None:
        figures[who].setdefault(key, []).append(value)

    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"

        def start(who: str, parallel: int = 1) -> tuple[subprocess.Popen, str]:
            port = free_port()
            if who == "quipu":
                cmd = [sys.executable, "-m", "quipu", "serve", "-m", model, "--port", str(port), "--ctx", str(CTX),
                       "--threads", str(threads), "--parallel", str(parallel), "--no-log"]
                env_home = ["env", f"QUIPU_HOME={home}"]
                proc = serve(env_home + cmd, "/health", port, Path(tmp) / f"{who}-{port}.log")
            else:
                proc = serve([str(exe), "-m", model, "--host", "127.0.0.1", "--port", str(port), "-c",
                              str(CTX * parallel), "-np", str(parallel), "-t", str(threads), "--no-webui"],
                             "/health", port, Path(tmp) / f"{who}-{port}.log")
            return proc, f"http://127.0.0.1:{port}"

        for who in ("quipu", "llama.cpp"):
            proc, url = start(who)
            try:
                stream(url, [{"role": "user", "content": "Hello."}], 4)  # (loaded, and warm)
                for r in range(repeats):
                    got = stream(url, [{"role": "user", "content": f"Question {r} of {who}: write a long story "
                                                                   "about a river."}], DECODE)
                    put(who, "tok_s", got["tok_s"])
                    put(who, "ttft", stream(url, [{"role": "user", "content": f"A new question, {r}, {who}: what "
                                                                              "is a lake?"}], 8)["ttft"])
                put(who, "rss", rss_peak(proc.pid))
                # the long conversation's first turn: its context kept (quipu: on disk; llama-server: in RAM)
                first = stream(url, turn1, 16)
                put(who, "turn1", first["ttft"])
                if who == "llama.cpp":  # (its next turn with nothing restarted: the floor, the new tokens read)
                    put(who, "floor", stream(url, following, 8)["ttft"])
            finally:
                stop(proc)
            for _ in range(repeats):  # the next turn, each time after a restart of the server
                proc, url = start(who)
                try:
                    put(who, "resume", stream(url, following, 8)["ttft"])
                finally:
                    stop(proc)
        for who in ("quipu", "llama.cpp"):
            proc, url = start(who, parallel=8)
            try:
                stream(url, [{"role": "user", "content": "Hello."}], 4)
                for r in range(repeats):
                    put(who, "eight", at_once(url, 8, 64, lambda i, r=r, who=who: f"Story {r}.{i} of {who}: a "
                                                                                    "river."))
                put(who, "rss8", rss_peak(proc.pid))
            finally:
                stop(proc)
        loads: dict[str, dict] = {}
        for who in ("quipu", "llama.cpp"):
            proc, url = start(who, parallel=2)
            try:
                stream(url, [{"role": "user", "content": "Hello."}], 4)
                loads[who] = forty(url)
                put(who, "health", loads[who]["health"])
                put(who, "sigterm", exit_after_sigterm(proc, url))
            finally:
                if proc.poll() is None:
                    stop(proc)

    def m(who: str, key: str) -> float:
        return median(figures[who][key])

    def row(what: str, key: str, higher_better: bool, digits: int = 3) -> dict:
        q, b = m("quipu", key), m("llama.cpp", key)
        return {"what": what, "quipu": round(q, digits), "llama.cpp": round(b, digits),
                "ratio": round(q / b, 3) if b else ""}

    return [
        row(f"quipu serve vs llama-server, one stream, {DECODE} tokens: decode tok/s (goal >= 0.95)", "tok_s", True),
        row("quipu serve vs llama-server, a new request: time to first token (s) (goal <= 1.1)", "ttft", False),
        row("quipu serve --parallel 8 vs llama-server --parallel 8, eight streams at once, 64 tokens each: total "
            "tok/s (goal >= 0.9)", "eight", True),
        row("quipu serve vs llama-server, a ~3,000-token conversation's next turn after each server is restarted: "
            "time to first token (s) (goal <= 0.05; llama-server reads it again)", "resume", False),
        {"what": "quipu serve, a ~3,000-token conversation's next turn after a restart, vs llama-server's same turn "
                 "with nothing restarted (its floor: the new tokens read at that depth): time to first token (s) "
                 "(goal <= 1.2)", "quipu": round(m("quipu", "resume"), 3), "llama.cpp": round(m("llama.cpp", "floor"), 3),
         "ratio": round(m("quipu", "resume") / m("llama.cpp", "floor"), 3)},
        {**row("quipu serve vs llama-server, peak resident memory after the one-stream runs (MB), same context "
               "(goal <= 1.15)", "rss", False, 0),
         "quipu": round(m("quipu", "rss") / 2**20), "llama.cpp": round(m("llama.cpp", "rss") / 2**20)},
        {**row(f"quipu serve vs llama-server, peak resident memory after the eight streams (MB), --parallel 8 and "
               f"{CTX} tokens a conversation (goal <= 1.15)", "rss8", False, 0),
         "quipu": round(m("quipu", "rss8") / 2**20), "llama.cpp": round(m("llama.cpp", "rss8") / 2**20)},
        {"what": "40 clients at once against --parallel 2 (half streamed): answered whole / refused 503 before any "
                 "body / other (an error inside a 200 among them)",
         **{who: "{whole} / {refused} / {other}".format(**loads[who]) for who in ("quipu", "llama.cpp")}},
        row("40 clients at once against --parallel 2: the slowest /health poll meanwhile (s) (goal < 0.5)", "health",
            False),
        row("SIGTERM while two replies stream: seconds to exit (goal < 2)", "sigterm", False),
    ]
