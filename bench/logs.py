"""The log of answers: what logging costs a short one-shot run, and a search over 100,000 records.

- Cost: `quipu run` of 16 tokens with the log and with `--no-log`, in pairs whose order turns
  round each repetition (a row is the median of the pairs' ratios), and the log's own write (open,
  one record, close) timed in one process against the run's whole time.
- Search: a log of 100,000 records (prompts and answers made of a vocabulary of 5,000 words, the
  sizes of real ones), searched for single words, two words and a phrase (`Logbook.find`, best
  match first, 10 answers), the last 10 answers, and `quipu logs -q` as a whole command.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from bench.common import median, quipu_cmd

N_RECORDS = 100_000


def bench_logs(model: str, threads: int, repeats: int, home: str) -> list[dict]:
    return _cost(model, threads, repeats, home) + _search(home)


def _cost(model: str, threads: int, repeats: int, home: str) -> list[dict]:
    from quipu.app.answer_log import log_answer
    from quipu.app.environment import Environment
    from quipu.app.turn_options import TurnOptions
    from quipu.app.answer import Answer
    from quipu.paths import dirs

    env_vars = {"QUIPU_HOME": home + "/logcost"}
    args = ["run", "-m", model, "-n", "16", "-t", "0", "--threads", str(threads), "--no-cache",
            "Why is the sky blue?"]
    quipu_cmd(*args, env=env_vars)  # (the page cache warmed for both)
    logged, unlogged, ratios = [], [], []
    for rep in range(repeats):
        pair = {}
        for with_log in ((True, False) if rep % 2 == 0 else (False, True)):
            elapsed, _ = quipu_cmd(*args, *([] if with_log else ["--no-log"]), env=env_vars)
            pair[with_log] = elapsed
        logged.append(pair[True])
        unlogged.append(pair[False])
        ratios.append(pair[True] / pair[False])
    env = Environment(dirs({"QUIPU_HOME": home + "/logcost"}), {})
    result = Answer("The sky is blue because " * 4, "length", "SmolLM2-135M-Instruct", 1, None)
    writes = []
    for _ in range(max(20, repeats)):
        started = time.perf_counter()
        log_answer(env, TurnOptions(max_tokens=16).logged, "run", "Why is the sky blue?", result)
        writes.append(time.perf_counter() - started)
    write = median(writes)
    return [{"what": "a 16-token quipu run, logged vs --no-log, whole process (s)", "quipu": round(median(logged), 3),
             "re-read from scratch": f"{median(unlogged):.3f} (--no-log)", "ratio": round(median(ratios), 4)},
            {"what": "the log's own write of one answer (open, insert, close) (s), against that run's whole time",
             "quipu": round(write, 5), "ratio": round(write / median(unlogged), 4)}]


def _search(home: str) -> list[dict]:
    from quipu.store.logbook import Logbook, Record

    rng = random.Random(7)
    words = [f"{rng.choice('bcdfghklmnprstvz')}{rng.choice('aeiou')}{rng.choice('lmnrst')}"
             f"{rng.choice('aeiou')}{rng.choice('bcdfgklmnprstvz')}{i % 97}" for i in range(5000)]
    path = Path(home) / "search" / "data" / "logs.db"  # (where `quipu logs` finds it under QUIPU_HOME=home/search)
    book = Logbook(path)
    db = book._open()
    started = time.perf_counter()
    db.execute("BEGIN")
    now = time.time()
    rows = []
    for i in range(N_RECORDS):
        prompt = " ".join(rng.choices(words, k=rng.randint(8, 40)))
        answer = " ".join(rng.choices(words, k=rng.randint(40, 250)))
        rows.append(Record(prompt=prompt, answer=answer, model="bench-model", conversation=str(i + 1),
                           at=now - (N_RECORDS - i)).row())
    columns = list(rows[0])
    db.executemany(f"INSERT INTO answers ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                   [list(r.values()) for r in rows])
    db.execute("COMMIT")
    fill = time.perf_counter() - started
    size = path.stat().st_size
    queries = {"one word": [rng.choice(words) for _ in range(20)],
               "two words (both)": [f"{rng.choice(words)} {rng.choice(words)}" for _ in range(20)],
               "a phrase": [f'"{rng.choice(words)} {rng.choice(words)}"' for _ in range(20)]}
    out = []
    for name, asked in queries.items():
        times = []
        for q in asked:
            t = time.perf_counter()
            book.find(query=q, limit=10)
            times.append(time.perf_counter() - t)
        out.append({"what": f"search of a {N_RECORDS:,}-record log ({size / 2**20:.0f} MB, filled in {fill:.0f} s): "
                            f"{name}, best 10 (s, median of 20; the slowest {max(times):.3f}; ratio: against 0.1 s)",
                    "quipu": round(median(times), 4), "ratio": round(median(times) / 0.1, 3)})
    t = time.perf_counter()
    book.find(limit=10)
    out.append({"what": f"the last 10 answers of the {N_RECORDS:,}-record log (s)", "quipu": round(time.perf_counter() - t, 4)})
    book.close()
    elapsed, _ = quipu_cmd("logs", "-q", asked[0], env={"QUIPU_HOME": str(Path(home) / "search")})
    out.append({"what": f"`quipu logs -q WORD` as a whole command on the {N_RECORDS:,}-record log (s)",
                "quipu": round(elapsed, 3)})
    return out
