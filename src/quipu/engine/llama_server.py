"""llama.cpp's llama-server driven by tokens: `/completion` with token arrays, so that a
session's context is exactly the tokens it was given and the model generated.

`LlamaServerModel` is the engine's side of a session kept on a llama-server slot: it tokenizes
(`/tokenize`) and spells tokens (`/detokenize`) with the server's own vocabulary, gives the
server's chat template and special tokens, and streams a completion of a token array from a
seed, returning the generated token ids. The server shows no text for a token that ends
inside a character, nor its id; such ids are recovered by tokenizing the character the next
event completes, and checked against the bytes they must spell (`Completion.exact` says when
that failed, so the reply's text is read again on the next turn instead of trusted).

A prompt may be sent as token ids followed by text (llama-server tokenizes the text as its
`/tokenize` does, special tokens parsed), so a turn's new text costs no round trip before the
first token; the session asks for its ids after the reply.

Its slots' contexts can be saved to a file in the server's --slot-save-path and restored
(`slot_file`), which a named session on the server keeps between turns.

A user's spelling of a control token must stay text, and only the server knows its control
tokens: a text is checked by tokenizing it with and without special tokens parsed. Every
control token of the vocabularies llama.cpp runs is spelled with one of `<>[]|` or the wide
`｜` (`<|im_end|>`, `[INST]`, `<｜end▁of▁sentence｜>`, `|||IP_ADDRESS|||`), so a text with
none of them is not sent to be checked, and no text is checked twice.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Callable, Sequence

from quipu.engine.base import CHAIN, CallConstraint, Completion, SamplerSettings, Sink
from quipu.engine.http import ServerClient, ServerError, count_of
from quipu.engine.grammar import Grammar, check_grammar_depth, check_schema
from quipu.errors import CapabilityError
from quipu.options import SERVER



FINISH = {"eos": "stop", "word": "stop_sequence", "limit": "length"}
# The most tokens the server may hold back before a character is whole (one a byte, before the last).
MAX_HIDDEN = 3
# What every control token's spelling has one of (see the module's notes).
CONTROL_MARKS = re.compile("[<>\\[\\]|\uff5c]")


def llama_server_props(remote: ServerClient) -> dict[str, Any] | None:
    """llama.cpp's llama-server's `/props` (its slots, context, chat template, special tokens);
    None for any other server."""
    try:
        props = remote.request_json("GET", "/props")
    except ServerError:
        return None
    return props if isinstance(props, dict) and isinstance(props.get("default_generation_settings"), dict) else None


class LlamaServerModel:
    """A model on llama.cpp's llama-server, as the session layer drives it by tokens: the context
    is the token array each request sends, and the server keeps what it can of it in a slot."""

    def __init__(self, remote: ServerClient, props: dict[str, Any]):
        self.remote = remote
        self.props = props
        settings = props.get("default_generation_settings") or {}
        self.n_ctx = int(settings.get("n_ctx") or 0)  # a slot's share of the server's context
        path = str(props.get("model_path") or "")
        name = str(props.get("model_alias") or path or "llama-server").rsplit("/", 1)[-1]
        self.name = name[:-5] if name.endswith(".gguf") else name
        self.build = str(props.get("build_info") or "")
        self._bos: list[int] | None = None
        self._spelled: dict[int, str] = {}
        self._specials: dict[str, int | None] = {}
        self._controls_in: dict[str, list[str]] = {}
        self._model_meta: dict[str, Any] | None = None

    def _meta(self) -> dict[str, Any]:
        if self._model_meta is None:
            self._model_meta = {}
            for m in self.remote.models():
                if isinstance(m.get("meta"), dict):
                    self._model_meta = m["meta"]
                    break
        return self._model_meta

    @property
    def identity(self) -> str:
        """What a session's token ids are only valid under: the model the server runs."""
        meta = self._meta()
        fields = (self.props.get("model_path"), meta.get("n_vocab"), meta.get("n_params"), meta.get("size"))
        return "|".join(str(f) for f in fields)

    @property
    def n_vocab(self) -> int:
        n = self._meta().get("n_vocab")
        if not isinstance(n, int) or n <= 0:
            raise ServerError(f"{self.remote.where()} does not say the size of its model's vocabulary")
        return n

    def close(self) -> None:
        self.remote.close()

    # ---- slots whose context can be saved to a file and restored -----------------------------

    def slots(self) -> int:
        """How many slots the server has."""
        total = self.props.get("total_slots")
        return total if isinstance(total, int) and total > 0 else 0

    def slot_look(self, slot: int) -> tuple[Any, ...] | None:
        """What tells a slot's context changed (its last task, its prompt's size); None when the
        server does not say (`/slots` turned off)."""
        try:
            data = self.remote.request_json("GET", "/slots")
        except ServerError:
            return None
        for item in data if isinstance(data, list) else ():
            if isinstance(item, dict) and item.get("id") == slot and item.get("id_task") is not None:
                return item.get("id_task"), item.get("n_prompt_tokens")
        return None

    def slot_file(self, slot: int, action: str, filename: str) -> int:
        """Saves a slot's context to `filename` (in the server's --slot-save-path) or restores it;
        the number of tokens saved or restored."""
        data = self.remote.request_json("POST", f"/slots/{slot}?action={action}", {"filename": filename})
        count = data.get("n_saved" if action == "save" else "n_restored") if isinstance(data, dict) else None
        if not isinstance(count, int):
            raise ServerError(f"{self.remote.where()} answered a slot {action} with something unexpected")
        return count

    # ---- the vocabulary, the server's --------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return [t for t, _ in self._pieces(text, add_special, parse_special)]

    def _pieces(self, text: str, add_special: bool, parse_special: bool) -> list[tuple[int, bytes]]:
        data = self.remote.request_json("POST", "/tokenize", {"content": text, "add_special": add_special,
                                                      "parse_special": parse_special, "with_pieces": True})
        items = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(items, list):
            raise ServerError(f"{self.remote.where()} answered /tokenize with something unexpected")
        out = []
        for item in items:
            piece = item.get("piece") if isinstance(item, dict) else None
            if not isinstance(item.get("id") if isinstance(item, dict) else None, int):
                raise ServerError(f"{self.remote.where()} answered /tokenize with something unexpected")
            out.append((item["id"], piece.encode("utf-8") if isinstance(piece, str) else bytes(piece or [])))
        return out

    def detokenize(self, tokens: Sequence[int]) -> str:
        """The tokens' text, control tokens written out."""
        if not tokens:
            return ""
        data = self.remote.request_json("POST", "/detokenize", {"tokens": list(tokens)})
        text = data.get("content") if isinstance(data, dict) else None
        if not isinstance(text, str):
            raise ServerError(f"{self.remote.where()} answered /detokenize with something unexpected")
        return text

    def spell(self, token: int) -> str:
        if token not in self._spelled:
            self._spelled[token] = self.detokenize([token])
        return self._spelled[token]

    def bos_token(self) -> int | None:
        if self._bos is None:
            self._bos = self.tokenize("", add_special=True, parse_special=False)
        return self._bos[0] if self._bos else None

    def chat_template(self) -> str | None:
        return self.props.get("chat_template") or None

    def special_token_text(self, which: str) -> str:
        return str(self.props.get(f"{which}_token") or "")

    def media_tokens(self, k: int) -> list[int]:
        raise LookupError("a medium reaches llama-server in its own request, not as tokens")

    def special_token(self, text: str) -> int | None:
        """The id of the one special token `text` spells (None: it spells none)."""
        if text not in self._specials:
            parsed = self._pieces(text, False, True)
            self._specials[text] = parsed[0][0] if len(parsed) == 1 and \
                [t for t, _ in self._pieces(text, False, False)] != [parsed[0][0]] else None
        return self._specials[text]

    def control_spellings(self, texts: Sequence[str]) -> list[str]:
        """The control tokens `texts` spell (`<|im_end|>`, ...), which a user's text must keep as
        text, longest first: found by tokenizing the texts not seen before with and without
        special tokens parsed (see the module's notes)."""
        new = [t for t in dict.fromkeys(texts) if t not in self._controls_in]
        asked = [t for t in new if CONTROL_MARKS.search(t)]
        found: set[str] = set()
        if asked:
            joined = "\n".join(asked)
            parsed = self._pieces(joined, False, True)
            plain = {t for t, _ in self._pieces(joined, False, False)}
            found = {piece.decode("utf-8", "replace") for t, piece in parsed if t not in plain and len(piece) > 1}
        for text in new:
            self._controls_in[text] = [s for s in found if s in text]
        spelled = {s for text in texts for s in self._controls_in[text]}
        return sorted(spelled, key=len, reverse=True)

    # ---- generation --------------------------------------------------------------------------

    def complete(self, prompt: Sequence[int | str], sampler: SamplerSettings, seed: int, max_tokens: int,
                 stop: Sequence[str] = (), slot: int = -1, sink: Sink | None = None,
                 constraint: CallConstraint | None = None) -> Completion:
        """Streams what follows `prompt` (reusing what the slot holds of it) into `sink`, which may stop it.
        The prompt is token ids, then maybe text, which the server tokenizes with special tokens
        parsed (a leading text gets the model's BOS); `Completion.prompt_tokens` says how many
        tokens it made in all."""
        body = {"prompt": list(prompt), "stream": True, "n_predict": max_tokens, "cache_prompt": True,
                "return_tokens": True, "seed": seed, "samplers": list(CHAIN), "stop": list(stop),
                **{named: getattr(sampler, name) for name, named in SERVER.items()}}
        if sampler.grammar is not None:
            body.update(server_grammar(sampler.grammar))
        elif constraint is not None:
            body["grammar"] = constraint.gbnf
            if constraint.lazy:  # (type 3: a pattern matching the whole text so far)
                body.update(grammar_lazy=True, grammar_triggers=[{"type": 3, "value": constraint.trigger}])
        if sampler.logit_bias:  # JSON has no -inf: the server's way to ban a token is `false`
            body["logit_bias"] = [[t, False if b == float("-inf") else b] for t, b in sampler.logit_bias]
        if slot >= 0:
            body["id_slot"] = slot
        stream = CompletionStream(self.remote.where(), time.perf_counter(), sink, self._pieces, self.spell)
        response = self.remote.request("POST", "/completion", body, stream=True)
        try:
            events = self.remote.events(response, stream.completion, lambda event: event.get("stop") is True)
            for event in events:
                if stream.take(event) is False:
                    break
        finally:
            response.close()
        return stream.completion()


class CompletionStream:
    """A completion as its events come: what it holds so far, taken from each event (`take`),
    and the completion it makes (`completion`; where the stream faults, what came before)."""

    def __init__(self, where: str, started: float, sink: Sink | None,
                 pieces: Callable[[str, bool, bool], list[tuple[int, bytes]]], spell: Callable[[int], str]):
        self.where = where  # the server, as an error names it
        self.started = started
        self.sink = sink
        self.pieces = pieces  # the server's tokenizer: (id, bytes) of a text's tokens
        self.spell = spell  # a token's text, control tokens written out
        self.tokens: list[int] = []
        self.texts: list[str] = []
        self.finish_reason = ""
        self.exact = True
        self.prompt_tokens = self.cached_tokens = 0
        self.prefill_s = self.decode_s = self.first_token_s = 0.0

    def completion(self) -> Completion:
        return Completion(list(self.tokens), "".join(self.texts), self.finish_reason, self.exact, self.prompt_tokens,
                          self.cached_tokens, self.prefill_s, self.decode_s, self.first_token_s)

    def take(self, event: dict[str, Any]) -> bool | None:
        """Takes one event; False where the sink says to stop (the completion is then interrupted)."""
        if isinstance(event.get("tokens_evaluated"), int):
            self.prompt_tokens = event["tokens_evaluated"]
        if event.get("stop") is True:
            self.finish_reason = FINISH.get(str(event.get("stop_type")), "stop")
            timings = event["timings"] if isinstance(event.get("timings"), dict) else {}
            self.cached_tokens = count_of(timings.get("cache_n"))
            self.prefill_s = _ms(timings.get("prompt_ms")) / 1000
            self.decode_s = _ms(timings.get("predicted_ms")) / 1000
            return None
        tokens = event.get("tokens")
        if not isinstance(tokens, list) or len(tokens) != 1 or not isinstance(tokens[0], int):
            return None  # a progress event
        text = event["content"] if isinstance(event.get("content"), str) else ""
        token = tokens[0]
        count = event.get("tokens_predicted")
        if not self.tokens:
            self.first_token_s = time.perf_counter() - self.started
        missing = count - len(self.tokens) - 1 if isinstance(count, int) else 0
        if missing > MAX_HIDDEN:  # a character is at most 4 bytes: the count is not the reply's
            raise ServerError(f"{self.where} counted {count} tokens for a reply of {len(self.tokens)}",
                              partial=self.completion())
        if missing > 0:  # tokens inside a character: the server showed neither them nor their ids
            self.tokens += self._recover(missing, token, text)
        self.tokens.append(token)
        self.texts.append(text)
        if self.sink is None:
            return None
        if text:
            self.sink.text(text)
        elif not missing and event.get("stop") is not True:
            # A token that shows nothing: a control token, whose spelling is markup a reader of
            # the reply's format may need (asked once a token; a character's part spells U+FFFD).
            spelled = self.spell(token)
            if spelled and "\ufffd" not in spelled:
                self.sink.control(spelled)
        if self.sink.stopped():
            self.finish_reason = "interrupted"
            return False
        return None

    def _recover(self, missing: int, token: int, text: str) -> list[int]:
        """The ids of the `missing` tokens before `token`, which end in `text`: its last character
        tokenized, when that gives `token` last and pieces that spell the character."""
        for size in range(1, min(len(text), 4) + 1):
            tail = text[-size:]
            pieces = self.pieces(tail, False, False)
            if len(pieces) == missing + 1 and pieces[-1][0] == token:
                if b"".join(p for _, p in pieces) == tail.encode("utf-8"):
                    return [t for t, _ in pieces[:-1]]
        self.exact = False
        return [-1] * missing


def _ms(value: object) -> float:
    """A duration the server reported, in ms; what is not one counts as none."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else 0.0


def server_grammar(grammar: Grammar) -> dict[str, Any]:
    """The request fields that constrain a reply on llama-server, by its own engine: GBNF as
    `grammar`, a JSON Schema as `json_schema` (which the server turns into GBNF), each checked
    for what that engine would crash on or ignore. Lark and regular expressions are quipu's
    engine's (llguidance) alone: the server is built without it."""
    if grammar.kind == "gbnf":
        check_grammar_depth(grammar.text)  # (one nested too deep would crash the server's parser)
        return {"grammar": grammar.text}
    if grammar.kind == "json_schema":
        schema = json.loads(grammar.text)
        check_schema(schema, server=True)
        return {"json_schema": schema}
    raise CapabilityError(f"a {grammar.what} constrains a reply on a local model only; llama-server takes GBNF "
                          "(--grammar FILE.gbnf) and JSON Schema (--schema)")
