"""What the commands do, on top of the session layer and the store; the CLI calls these.

- `environment.py`: `Environment` (directories, environment variables, the config file;
  built once per command) and `TurnOptions` turned into settings: sampling parameters,
  context settings, the backend.
- `named.py`: `NamedSession`, a conversation bound to a name in the store: opened (created,
  restored or re-read) and saved; `open_session` for a fresh one.
- `turns.py`: one turn of `quipu run`, with or without a session (`TurnResult`).
- `remote.py`: `quipu run --url` and `quipu chat --url`: llama-server goes to `served.py`;
  any other server through its chat API, sessions kept as transcripts.
- `served.py`: turns and named sessions on llama-server, driven by tokens through the same
  `Conversation` and `ChatSession` as a local model (`ServedNamedSession`), the context kept
  in a slot file between turns (`SlotKeeper`).
- `batch.py`: `quipu run --batch`: rows read, planned and answered side by side, in order.
- `chat.py`: `ChatSession`, the library side of `quipu chat`: saved after every turn.
- `manage.py`: `quipu sessions ...` over the store.
- `embed.py`: `quipu embed`.
- `templates.py`: what a model's chat template does (`quipu models info --template`).
- `cache.py`: `quipu cache info|clear` (the prompt cache itself is used by `turns.py`).
"""
