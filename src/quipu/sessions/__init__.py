"""The session layer proper: what a user thinks of as a conversation, in memory.

- `inference.py`: `InferenceSession` feeds prompts, infers the next token, runs a generation
  with a per-token callback, keeps stats, and snapshots or restores itself (`Snapshot`).
- `batch.py`: `BatchSession`, many prompts decoded side by side on one context, each row with
  its own seed (continuous batching; a shared beginning read once).
- `conversation.py`: `Conversation` and `Message`: turns as the model's chat template renders
  them, fed incrementally; undo, retry, continue, drop the oldest exchanges.
- `served.py`: `ServedSession` and `ServedConversation`: a conversation's exact tokens on
  llama.cpp's llama-server (an `engine.ServedBackend`), one request a reply, seeded per draw.
- `template.py`: `ChatTemplate`, the model's Jinja template in a sandbox, rendered as
  transformers renders it.
- `prompt.py`: rendered text to context tokens, as the reference tokenizes it, keeping a
  user's spelling of a control token as text and the tokens the context already holds.
- `thinking.py`: a thinking model's reasoning apart from its answer.
- `params.py`: `SamplingParams`, validated, and the per-draw seeds that make resuming exact.
- `stops.py`: stop strings, held back while they could still match.

It drives an `engine.Backend` (or a `ServedBackend`) and knows no terminal and no files: saving a session is the
job of `quipu.app` with `quipu.store`.
"""
