"""The session layer proper: what a user thinks of as a conversation, in memory.

- `base.py`: the `ModelSession` protocol every session implements, wherever its model runs
  (reply, rewind, close, its capabilities), and `TokenSession`, what a session that holds its
  context's exact tokens does besides (its template, tokenizer, tokens; a plain completion),
  reached by that declared capability (`holding_tokens`);
  `Capabilities` (what a kind of session can do, and every refusal's words); `ReplySink`
  (where a reply goes as it is generated, and the one way to stop it); `Message`,
  `TurnPrompt`, `Generation`, `Stats`.
- `inference.py`: `InferenceSession`, a local llama.cpp context: feeds prompts, infers the next
  token, keeps stats, and snapshots or restores itself (`snapshot.py`: `Snapshot`); how its
  context moves within its history, `context_moves.py`; `reply_watch.py`, what
  watches its reply as it comes (a reasoning budget, a call's trigger); `marks.py`, where a
  prompt is marked for a later one to part from it (a hybrid model's checkpoints).
- `llama_server.py`: `LlamaServerSession`, a conversation's exact tokens on llama.cpp's
  llama-server (an `engine.llama_server.LlamaServerModel`), one request a reply, seeded per draw;
  `slot_file.py`, a named session's context kept in a slot file of the server's between turns.
- `chat_api.py`: `ChatApiSession`, a server's OpenAI chat API, whose context is the message list.
- `conversation.py`: `Conversation`, one for every session: turns as the model's chat template
  renders them, fed incrementally; undo (back to any message), retry, continue; what a
  turn is given besides the messages (`TurnSettings`: tools, reasoning budget, the template's
  variables) and its calls offered and read, `tool_turns.py`; the oldest exchanges dropped
  from a full context, `trim.py`.
- `batch.py`: `BatchSession`, many prompts decoded side by side on one context, each row with
  its own seed (continuous batching; a shared beginning read once).
- `template.py`: `ChatTemplate`, the model's Jinja template in a sandbox, rendered as
  transformers renders it.
- `prompt.py`: rendered text to context tokens, as the reference tokenizes it, keeping a
  user's spelling of a control token as text and the tokens the context already holds.
- `reasoning.py`: the one table of reasoning formats (tag pairs, harmony's channels), and a
  reply split into its reasoning and its answer as it streams (`Splitter`);
  `reasoning_sink.py`: `ReasoningSink`, which passes the two on as they stream;
  `reasoning_found.py`: a template's format found by rendering it.
- `params.py`: `SamplingParams`, validated, and the per-draw seeds that make resuming exact.
- `stops.py`: stop strings, held back while they could still match, and a reply's text as its
  tokens come (`ReplyText`).
- `tools.py`: the one table of tool-call formats, an entry a family (`Format`: how its template
  is known, the texts that begin a call, its call's grammar, its parser), and replies read into
  content, reasoning and calls (`parse_reply`); `call_grammars.py`: each family's grammar of a
  call, once its trigger is written; `call_parsers.py`: each family's parser; `toolspec.py`:
  the values they share (`ToolSpec`, `ToolCall`).
- `calls.py`: a reply that may make calls, as it streams: where a call begins, the text shown
  up to there, and the grammar a server holds the call to.

It drives the engine and knows no terminal and no files: saving a session is the job of
`quipu.app` with `quipu.store`.
"""
