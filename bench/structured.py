"""Templates, structured output, tools and the functions process: what each costs on top of a plain reply."""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench.common import HERE, prompt_of, median


def bench_templates(model: str, threads: int) -> list[dict]:
    """Tokens a turn re-reads: only the new message under a template that renders earlier turns
    as they were generated; from the earlier reasoning on under one that drops it (Qwen3)."""
    from quipu.engine.settings import ContextSettings
    from quipu.engine.llama import LlamaBackend
    from quipu.sessions.conversation import Conversation, Message
    from quipu.sessions.inference import InferenceSession, common_prefix

    replies = ["<think>\nThe user says hello; greet back.\n</think>\n\nHello! How can I help?",
               "<think>\nThey want a river; the Tagus runs through Lisbon.\n</think>\n\nThe Tagus.",
               "<think>\nA short fact about it.\n</think>\n\nIt is the longest river of Iberia."]
    questions = ["Hi!", "Name a river.", "Tell me about it.", "Thanks!"]
    rows = []
    with LlamaBackend(model, ContextSettings(n_ctx=4096, n_threads=threads)) as backend:
        for label, source in (("ChatML (the model's own)", None),
                              ("Qwen3 (drops earlier reasoning)", (HERE.parent / "tests" / "templates" /
                                                                   "Qwen-Qwen3-0.6B.jinja").read_text())):
            conv = Conversation.start(InferenceSession(backend), template=source)
            reread = []
            for question, reply in zip(questions, replies + [None], strict=False):
                conv.messages.append(Message("user", question))
                new = conv.context_tokens()
                reread.append(len(new) - common_prefix(new, conv.session.tokens))
                if reply is None:
                    break
                # The context after the turn: the prompt, the reply as generated, its end token.
                end = backend.vocab.tokenize("<|im_end|>", add_special=False, parse_special=True)
                conv.session.tokens = new + backend.vocab.tokenize(reply, add_special=False, parse_special=True) + end
                conv.messages.append(Message("assistant", reply))
            rows.append({"what": f"tokens re-read per turn, {label}, turns 2-4",
                         "quipu": " / ".join(map(str, reread[1:]))})
    return rows

def bench_constrained(model: str, threads: int, repeats: int) -> list[dict]:
    """Constrained output (llguidance's masks on llama.cpp's logits) against free decoding:
    decode speed under a JSON Schema on the same prompt and seed, with the mask's own time per
    token; a batch of 32 rows under one schema against the same rows free; the time to the first
    token under a large schema; and what a Python logits processor costs per token."""
    import json as json_

    from quipu.engine.settings import ContextSettings
    from quipu.engine.constraint import Matcher
    from quipu.engine.grammar import schema_grammar
    from quipu.engine.llama import LlamaBackend
    from quipu.sessions.batch import BatchRow, BatchSession
    from quipu.sessions.inference import InferenceSession
    from quipu.sessions.params import SamplingParams

    schema = {"type": "array", "items": {"type": "object", "properties": {
        "city": {"type": "string"}, "country": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "country", "population"]}, "minItems": 40}
    hot = SamplingParams(temperature=0.8, seed=1)
    grammar = schema_grammar(json_.dumps(schema))
    n = 128
    rows = []
    mask_times: list[float] = []
    original_apply = Matcher.apply

    def timed_apply(self, logits):
        started = time.perf_counter()
        original_apply(self, logits)
        mask_times.append(time.perf_counter() - started)

    with LlamaBackend(model, ContextSettings(n_ctx=2048, n_threads=threads)) as backend:
        prompt = backend.vocab.tokenize("A list of the world's cities as JSON: [", add_special=True, parse_special=False)

        def run(params, processors=()):
            session = InferenceSession(backend, params)
            session.logits_processors.extend(processors)
            gen = session.complete(prompt, n)
            return session.stats.decode_tok_s, len(gen.tokens)

        free, bound, shaped = [], [], []

        def nothing(tokens, logits):
            logits[0] += 0.0  # touches the logits, as any processor does

        run(hot.replace(grammar=grammar))  # (the vocabulary's trie, built once per model)
        Matcher.apply = timed_apply
        try:
            for _ in range(repeats):
                free.append(run(hot)[0])
                bound.append(run(hot.replace(grammar=grammar))[0])
                shaped.append(run(hot, [nothing])[0])
        finally:
            Matcher.apply = original_apply
        f, b, p = median(free), median(bound), median(shaped)
        ordered = sorted(mask_times)
        rows.append({"what": f"decode tok/s under a JSON Schema ({n} tokens) vs free", "quipu": round(b, 1),
                     "plain ctypes loop": round(f, 1), "ratio": round(b / f, 3)})
        rows.append({"what": "the schema's mask per token: median, p99 (µs)",
                     "quipu": f"{ordered[len(ordered) // 2] * 1e6:.0f}, {ordered[int(len(ordered) * 0.99)] * 1e6:.0f}"})
        rows.append({"what": "a Python logits processor: decode tok/s, and cost per token (ms)",
                     "quipu": f"{p:.1f}, {max(0.0, 1000 / p - 1000 / f):.2f} ms", "plain ctypes loop": round(f, 1),
                     "ratio": round(p / f, 3)})

        # The first token under a large schema (300 properties, nested $defs) against none.
        defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"} if i < 9 else
                                                           {"type": "integer"}, "b": {"type": "string"}}}
                for i in range(10)}
        large = schema_grammar(json_.dumps({"type": "object", "$defs": defs, "properties": {
            f"field_{i}": ({"$ref": f"#/$defs/d{i % 10}"} if i % 3 == 0 else
                           {"type": ["integer", "string", "boolean"][i % 3], "description": f"field {i}"})
            for i in range(300)}}))

        def first_token(params):
            from quipu.engine.constraint import compile_grammar

            compile_grammar.cache_clear()
            started = time.perf_counter()
            session = InferenceSession(backend, params)
            session.complete(prompt, 1)
            return time.perf_counter() - started

        plain_first = median([first_token(hot) for _ in range(repeats)])
        large_first = median([first_token(hot.replace(grammar=large)) for _ in range(repeats)])
        rows.append({"what": "time to the first token under a 300-property schema vs none (ms)",
                     "quipu": round(large_first * 1000, 1), "plain ctypes loop": round(plain_first * 1000, 1),
                     "ratio": round(large_first / plain_first, 2)})

    # A batch: 32 rows under one schema against the same rows free, 8 sequences side by side.
    with LlamaBackend(model, ContextSettings(n_ctx=8 * 256, n_threads=threads, n_seq=8)) as backend:
        prompts = [backend.vocab.tokenize(f"City number {i} as JSON: ", add_special=True, parse_special=False)
                   for i in range(32)]

        def batch_rate(params):
            made = [0]
            started = time.perf_counter()
            BatchSession(backend).run([BatchRow(t, params.replace(seed=i), 64) for i, t in enumerate(prompts)],
                                      on_done=lambda row, gen, stats: made.__setitem__(0, made[0] + len(gen.tokens)))
            return made[0] / (time.perf_counter() - started)

        free_rate = median([batch_rate(hot) for _ in range(repeats)])
        bound_rate = median([batch_rate(hot.replace(grammar=grammar)) for _ in range(repeats)])
        rows.append({"what": "--batch: 32 rows under a JSON Schema, 8 side by side, tok/s vs free",
                     "quipu": round(bound_rate, 1), "plain ctypes loop": round(free_rate, 1),
                     "ratio": round(bound_rate / free_rate, 3)})
    return rows

def bench_tools(model: str, threads: int, repeats: int) -> list[dict]:
    """A tool round trip on a ~1,000-token conversation: the tokens read again once the result
    is added, and the time from the tool's return to the next token, against reading the whole
    conversation again."""
    from quipu.engine.settings import ContextSettings
    from quipu.engine.llama import LlamaBackend
    from quipu.sessions.conversation import Conversation
    from quipu.sessions.inference import InferenceSession
    from quipu.sessions.params import SamplingParams
    from quipu.sessions.toolspec import ToolSpec

    weather = ToolSpec("get_weather", "The weather in a city today.", {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False})
    system = "You answer questions about this text.\n\n" + prompt_of(900)
    rounds, fresh, reread = [], [], []
    with LlamaBackend(model, ContextSettings(n_ctx=4096, n_threads=threads)) as backend:
        for i in range(repeats):
            session = InferenceSession(backend, SamplingParams(seed=i, temperature=0.7))
            conv = Conversation.start(session, system)
            conv.update(tools=[weather], tool_choice="required")
            gen = conv.send("What is the weather in Paris?", max_tokens=60)
            if not gen.tool_calls:
                continue
            conv.add_tool_results([(gen.tool_calls[0], '{"temperature": 21, "sky": "clear"}')])
            conv.reply_to_tools(max_tokens=1, turn=conv.settings.but(tool_choice="auto"))
            stats = session.stats
            rounds.append(stats.ttft_s)
            reread.append(stats.prompt_tokens - stats.cached_tokens)
            whole = list(session.tokens[:stats.prompt_tokens])
            again = InferenceSession(backend.reopen(), SamplingParams(seed=i))
            again.complete(whole, 1)
            fresh.append(again.stats.ttft_s)
            again.close()
    if not rounds:
        return [{"what": "tool round trip", "quipu": "no call made"}]
    r, f = median(rounds), median(fresh)
    return [{"what": f"a tool round trip at ~{len(whole)} tokens: tokens read after the result; first token (s) "
                     "vs the conversation read again",
             "quipu": f"{int(median(reread))} tokens, {r:.3f}", "re-read from scratch": round(f, 3),
             "ratio": round(r / f, 3)}]

def bench_functions(repeats: int, home: str) -> list[dict]:
    """What running `--functions` in a process of its own costs: starting it (the import of a
    small file) and a call's round trip, against calling the function in quipu's process."""
    from quipu.app.functions import functions_from_files

    path = Path(home) / "bench_fns.py"
    path.write_text('def get_weather(city: str) -> dict:\n    """The weather."""\n'
                    '    return {"city": city, "temperature": 21}\n')
    starts, calls = [], []
    for _ in range(repeats):
        began = time.perf_counter()
        tools, _, worker = functions_from_files([str(path)])
        starts.append(time.perf_counter() - began)
        try:
            for _ in range(50):
                began = time.perf_counter()
                tools[0].run({"city": "Paris"}, 60, lambda: False)
                calls.append(time.perf_counter() - began)
        finally:
            worker.close()
    namespace: dict = {}
    exec(path.read_text(), namespace)
    began = time.perf_counter()
    for _ in range(1000):
        json.dumps(namespace["get_weather"]("Paris"))
    inline = (time.perf_counter() - began) / 1000
    return [{"what": "--functions in its own process: start and import (s); a call's round trip (ms), and the "
                     "same call in quipu's own process (ms)",
             "quipu": f"{median(starts):.3f} s; {median(calls) * 1000:.2f} ms (in-process {inline * 1000:.4f} ms)"}]
