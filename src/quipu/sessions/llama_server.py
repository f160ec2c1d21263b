"""A conversation kept as exact tokens on llama.cpp's llama-server.

`LlamaServerSession` is the `ModelSession` of a model on llama-server, driven by token
arrays, as `InferenceSession` is a local model's: it holds the
context's exact token history (replies keep the tokens the model generated) and asks the
server to continue it, one request a reply, seeded with the seed of its next draw, so a
session resumed in another process continues as it would have in the first. The server keeps
what it can of the context in the session's slot; what it kept is its own affair, each
request sending the whole token array.

The server's vocabulary is only reachable a request at a time, so instead of spelling every held token, the session keeps `marks`: places (k, n) where its
first k tokens spell the first n characters of `text`. The next turn keeps the tokens up to
the last mark its rendered text still begins with, and sends the rest as text: the server
tokenizes it as it reads it, so nothing waits on a round trip before the first token, and its
ids are asked for after the reply (they must add up to the server's count of the prompt, else
the turn's text is read again next time). A turn whose text might not leave room for the reply
is tokenized first, to be sure of its size.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Iterator, Mapping, Sequence

from quipu.engine.base import Completion
from quipu.engine.llama_server import LlamaServerModel, server_grammar
from quipu.errors import CapabilityError, ContextOverflow
from quipu.sessions.base import (LLAMA_SERVER, SILENT, Generation, ReplySink, Stats, ToolOffer, TurnPrompt,
                                 common_prefix)
from quipu.sessions.calls import TextCallSink, server_constraint
from quipu.sessions.params import SamplingParams, draw_seed
from quipu.sessions.prompt import HeldTokens, Rendered, reference_tokens
from quipu.sessions.reasoning import Thinking
from quipu.sessions.slot_file import SlotFile

# A token spells at most this many bytes (a generous bound): a longer text cannot fit, and is
# refused before it is sent to be tokenized.
MAX_TOKEN_BYTES = 256


class ServerSpecials(Mapping[str, int]):
    """The server's model's special tokens ({spelling: id}), asked for as they are needed."""

    def __init__(self, backend: LlamaServerModel):
        self.backend = backend

    def __getitem__(self, text: str) -> int:
        token = self.backend.special_token(text) if isinstance(text, str) else None
        if token is None:
            raise KeyError(text)
        return token

    def __iter__(self) -> Iterator[str]:
        return iter(())  # (not listed: there is no asking for them all)

    def __len__(self) -> int:
        return 0

    def within(self, text: str) -> dict[str, int]:
        """The special tokens `text` spells."""
        found = {}
        for spelling in self.backend.control_spellings([text]):
            token = self.backend.special_token(spelling)
            if token is not None:
                found[spelling] = token
        return found


class LlamaServerSession(HeldTokens):
    """A context on a llama-server slot: exact tokens, the text they spell, and the draw count."""

    capabilities = LLAMA_SERVER
    backend: LlamaServerModel

    def __init__(self, backend: LlamaServerModel, params: SamplingParams | None = None,
                 slot_file: SlotFile | None = None, draws: int = 0):
        super().__init__(backend, backend)
        self.params = SamplingParams().resolved()
        self.set_params(params or self.params)
        self.text = ""  # what `tokens` spell, control tokens written out
        self.marks: list[tuple[int, int]] = []  # (k, n): tokens[:k] spell text[:n]; a turn may go on from there
        self.draws = draws
        self.slot = -1  # the server's slot to use (-1: any)
        self.slot_file = slot_file  # keeps the session's slot between turns (a named session's)
        self._spelled = ""  # the last reply, control tokens spelled out
        self.stats = Stats()
        self._turn_started = 0.0

    @property
    def n_decoded(self) -> int:
        return len(self.tokens)

    def shift_out(self, start: int, end: int) -> bool:
        return False  # (the server's cells are its own to move: the rest is read again)

    def control_spellings(self, texts: Sequence[str]) -> list[str]:
        return self.backend.control_spellings(texts)

    def reused(self, tokens: Sequence[int]) -> int:
        return common_prefix(tokens, self.tokens)

    def spell(self, tokens: Sequence[int]) -> str:
        return self.backend.detokenize(tokens)

    checkpoints = False  # (the server's cells are its own)

    def special_tokens(self) -> "ServerSpecials":
        return ServerSpecials(self.backend)

    def close(self) -> None:
        pass  # the connection is the server's host's to close

    def set_params(self, params: SamplingParams) -> None:
        if params.grammar is not None:
            server_grammar(params.grammar)  # refused now, not at the next reply
        self.params = params.resolved()

    def restore(self, tokens: Sequence[int], text: str, marks: Sequence[tuple[int, int]]) -> None:
        """Takes a saved context (marks past the tokens or the text are dropped)."""
        self.tokens, self.text = list(tokens), text
        self.marks = [(k, n) for k, n in marks if 0 < k <= len(tokens) and 0 < n <= len(text)]

    def rewind(self, n_keep: int) -> None:
        """Forgets the tokens from `n_keep` on (and back to the last mark before it)."""
        self.marks = [m for m in self.marks if m[0] <= n_keep]
        k, n = self.marks[-1] if self.marks else (0, 0)
        del self.tokens[k:]
        self.text = self.text[:n]

    def begin_turn(self) -> None:
        self.stats = Stats()
        self._turn_started = time.perf_counter()

    def check_text_fits(self, text: str) -> None:
        if len(text.encode("utf-8")) > MAX_TOKEN_BYTES * self.n_ctx:
            raise ContextOverflow(self.n_ctx, self.n_ctx, at_least=True)

    def _kept(self, rendered: Rendered) -> tuple[int, int]:
        """The last mark (k, n) whose text `rendered` still begins with; (0, 0) when none."""
        for k, n in reversed(self.marks):
            if rendered.text.startswith(self.text[:n]):
                return k, n
        return 0, 0

    def context_for(self, rendered: Rendered) -> list[int]:
        """The context tokens for `rendered`: the held tokens up to the last mark its text still
        begins with, then the rest tokenized; all of it tokenized when no mark fits."""
        k, n = self._kept(rendered)
        if k == 0:
            return reference_tokens(self.backend, rendered)
        return self.tokens[:k] + rendered.tokenize_from(self.backend, n)

    def prompt_for(self, rendered: Rendered, max_tokens: int) -> list[int | str]:
        """What to send for `rendered`: the held tokens it begins with, then its new text (a
        user's spelling of a control token as tokens). All tokens when the new text might leave
        less than `max_tokens` of room, counting it generously as two tokens a byte (a token
        spells at least one byte, and SentencePiece may add a space before a piece)."""
        k, n = self._kept(rendered)
        if k + 1 + 2 * len(rendered.text[n:].encode("utf-8")) + len(rendered.parts) + max_tokens > self.n_ctx:
            return list(self.context_for(rendered))
        items: list[int | str] = list(self.tokens[:k])
        if k == 0:  # the model's BOS where it wants one, as `reference_tokens` puts it
            bos = self.backend.bos_token()
            if bos is not None:
                items.append(bos)
                spelled = self.backend.special_token_text("bos")
                text, plain = rendered.parts[0]
                if spelled and not plain and text.startswith(spelled):
                    n = len(spelled)  # the template wrote it
        at = 0
        for text, plain in rendered.parts:
            piece = text[max(0, n - at):]
            at += len(text)
            if not piece:
                continue
            if plain:
                items += self.backend.tokenize(piece, add_special=False, parse_special=False)
            else:
                items.append(piece)
        return items

    def _ids(self, prompt: Sequence[int | str], counted: int) -> list[int] | None:
        """The prompt's token ids, its text tokenized as the server did (a leading text gets the
        BOS); None when they cannot be known or do not add up to the server's `counted`."""
        ints = [item for item in prompt if isinstance(item, int)]
        if len(ints) == len(prompt):
            return ints
        ids: list[int] = []
        try:
            for i, item in enumerate(prompt):
                if isinstance(item, int):
                    ids.append(item)
                else:
                    ids += self.backend.tokenize(item, add_special=i == 0, parse_special=True)
        except Exception:  # the server gone after the reply: the text is read again next turn
            return None
        return ids if ids and len(ids) == counted else None

    def reply(self, prompt: TurnPrompt, max_tokens: int, stop: Sequence[str] = (),
              sink: ReplySink = SILENT) -> Generation:
        if prompt.tail and self.params.grammar:
            raise CapabilityError("a reply under a grammar cannot be continued on a server: its grammar would "
                                  "start over")
        self.begin_turn()
        rendered = prompt.template_text()
        gen = self.generate(self.prompt_for(rendered, max_tokens), rendered.text, max_tokens, stop, sink,
                            prompt.thinking(rendered.text), prompt.offer)
        return replace(gen, spelled=prompt.tail + self._spelled)

    def complete(self, tokens: Sequence[int], max_tokens: int, stop: Sequence[str] = (),
                 sink: ReplySink = SILENT) -> Generation:
        self.begin_turn()
        return self.generate(list(tokens), self.backend.detokenize(tokens), max_tokens, stop, sink)

    def generate(self, prompt: Sequence[int | str], prompt_text: str, max_tokens: int, stop: Sequence[str] = (),
                 sink: ReplySink = SILENT, thinking: Thinking | None = None,
                 offer: ToolOffer | None = None) -> Generation:
        """Continues `prompt` (token ids, then maybe text; it spells `prompt_text`) by up to
        `max_tokens` tokens; the context becomes the prompt and the reply. A failure mid-reply
        keeps what came (`Generation.error`)."""
        prompt = list(prompt)
        exact = all(isinstance(item, int) for item in prompt)
        if exact and len(prompt) >= self.n_ctx:
            raise ContextOverflow(len(prompt), self.n_ctx)
        if not self._turn_started:
            self.begin_turn()
        room = self.n_ctx - len(prompt) if exact else max_tokens  # (`prompt_for` made sure of it)
        if self.slot_file is not None:
            self.slot = self.slot_file.before(self.backend)
        sent = time.perf_counter()
        error = None
        constraint, calls = None, None
        shown_before_call = None
        if offer is not None and offer.grammar is not None:
            specials = self.special_tokens()
            thinking = thinking or Thinking()
            constraint = server_constraint(offer.grammar, offer.forced, thinking, specials.within)
            sink = calls = TextCallSink(sink, offer.grammar, thinking, offer.forced)
        try:
            done = self.backend.complete(prompt, self.params, draw_seed(self.params.draw_base, self.draws),
                                         min(max_tokens, room), stop, self.slot, sink, constraint)
        except Exception as exc:  # a server failing mid-reply: what came is kept, as after Ctrl-C
            partial = getattr(exc, "partial", None)
            if not isinstance(partial, Completion) or not partial.tokens:
                raise
            done, error = replace(partial, finish_reason="interrupted"), exc
        finally:
            if calls is not None:
                shown_before_call = calls.end()
        ids = self._ids(prompt, done.prompt_tokens)
        held = common_prefix(ids or [], self.tokens)
        finish = done.finish_reason or "stop"
        if finish == "length" and room < max_tokens and len(done.tokens) >= room:
            finish = "context_full"
        self._keep(prompt, ids, prompt_text, done, finish)
        if self.slot_file is not None and error is None:
            self.slot_file.after(self.backend, done.cached_tokens, held)
        self.draws += len(done.tokens)
        read = len(ids) if ids else done.prompt_tokens
        cached = min(done.cached_tokens, read)
        self.stats = replace(self.stats, prompt_tokens=read, completion_tokens=len(done.tokens), cached_tokens=cached,
                             prefill_tokens=read - cached, prefill_s=done.prefill_s, decode_s=done.decode_s,
                             ttft_s=sent - self._turn_started + done.first_token_s if done.tokens else
                             self.stats.ttft_s)
        self._turn_started = 0.0
        body = done.tokens[:-1] if finish == "stop" and done.tokens else list(done.tokens)
        self._spelled = self.backend.detokenize(body) if done.exact and body else done.text
        return Generation(done.text, list(done.tokens), finish, error, call_shown=shown_before_call)

    def reply_spelled(self) -> str:
        """The reply just generated, control tokens spelled out (its end-of-generation token not)."""
        return self._spelled

    def _keep(self, prompt: list[int | str], ids: list[int] | None, prompt_text: str, done: Completion, finish: str) -> None:
        """The context after a reply: the prompt, then the reply's tokens when all their ids are
        known. Without the prompt's ids, only its held tokens are kept (the rest is read again)."""
        if ids is None:
            held: list[int] = []
            for item in prompt:
                if not isinstance(item, int):
                    break
                held.append(item)
            self.rewind(common_prefix(held, self.tokens))
            return
        kept = common_prefix(ids, self.tokens)
        marks = [(k, n) for k, n in self.marks if k <= kept and prompt_text.startswith(self.text[:n])]
        self.tokens, self.text = ids, prompt_text
        self.marks = [m for m in marks if m[0] < len(ids)] + [(len(ids), len(prompt_text))]
        if not done.exact or not done.tokens:
            return  # the reply's text is tokenized again next turn
        eog = finish == "stop"
        body = done.tokens[:-1] if eog else list(done.tokens)
        self.tokens = ids + body
        self.text = prompt_text + self.backend.detokenize(body)
        self.marks.append((len(self.tokens), len(self.text)))
        if eog:
            self.tokens.append(done.tokens[-1])
            self.text += self.backend.spell(done.tokens[-1])
            self.marks.append((len(self.tokens), len(self.text)))
