"""What the commands do, on top of the session layer and the store; the CLI calls these.

- `environment.py`: `Environment` (directories, environment variables, the config file;
  built once per command) and `TurnOptions` turned into settings: sampling parameters,
  context settings, the backend.
- `named.py`: `NamedSession`, a conversation bound to a name in the store: opened (created,
  restored or re-read) and saved; `open_session` for a fresh one.
- `turns.py`: one turn of `quipu run`, with or without a session (`TurnResult`).
- `remote.py`: `quipu run --url` and `quipu chat --url`: turns on a model behind a server,
  sessions kept as transcripts.
- `batch.py`: `quipu run --batch`: rows read, planned and answered side by side, in order.
- `chat.py`: `ChatSession`, the library side of `quipu chat`: saved after every turn.
- `manage.py`: `quipu sessions ...` over the store.
- `embed.py`: `quipu embed`.
- `templates.py`: what a model's chat template does (`quipu models info --template`).
- `cache.py`: `quipu cache info|clear` (the prompt cache itself is used by `turns.py`).
"""
