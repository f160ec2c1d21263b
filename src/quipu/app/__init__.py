"""What the commands do, on top of the session layer and the store; the CLI calls these.

Every turn, named session and chat is written once, for every host a model can run on:

- `environment.py`: `Environment` (directories, environment variables, the config file;
  built once per command); `turn_options.py`: `TurnOptions`, what the user asked for, turned
  into settings (sampling parameters, context settings, the template's variables);
  `user_files.py`: the files the user names, read within bounds; `attachments.py`: the files
  a message carries (`-a`, `/attach`), known by their bytes.
- `hosts.py`: what a host is (`ModelHost`: it makes the `ModelSession` a conversation runs on;
  `Keeper`: what a named session keeps there besides its messages).
- `modes.py`: what each mode of a command refuses (each option's feature is the registry's,
  `quipu/options.py`), and the one check of the options against it and against what the host
  can do.
- `choose.py`: where the model runs, chosen once per command (`server_of`, `open_host`).
- `local.py`: a local model, and what its sessions keep besides their transcripts (`LocalKeeper`),
  each part by its job: `state_file.py`, the state file beside a transcript; `prompt_cache.py`,
  the prompt cache as a local session uses it (`PromptCache`); `local_media.py`, its images and recordings and
  their projector; `placing.py`, where it runs as the commands say it and a session keeps it.
- `llama_server.py`: llama.cpp's llama-server driven by tokens, a named session's context kept
  in a slot file between turns (`sessions.slot_file.SlotFile`).
- `chat_api.py`: any OpenAI-compatible chat API: sessions kept as transcripts alone.
- `named.py`: `NamedSession`, a conversation bound to a name in the store: opened (created,
  restored or re-read) on a host and saved.
- `turn.py`: `Turn`, one turn from its plan to its answer, written once: a one-shot's, a
  session's, a chat's, `--show-prompt`'s (a turn stopped before the model runs) and a batch
  row's; `answer.py`: `Answer`, the one record of a finished reply. `turns.py`: `quipu run`'s
  turn, one-shot or in a session, and its `--show-prompt`.
- `chat.py`: `ChatSession`, the library side of `quipu chat`: saved after every turn;
  `branches.py`, its branches as the tree a user sees, and what `/switch` takes; `compact.py`,
  room in a long conversation: a message that never fits refused, the older exchanges
  summarised into a branch of their own.
- `served.py`: a server's request (`quipu serve`, its package `quipu/serve/`) answered through
  the one turn path, on a slot of the model the server holds (`SlotHost`), as a one-shot or a
  named session's turn; `logprobs.py`: each drawn token's log probability, recorded as the reply
  is drawn and given with each piece; `responses.py`: the responses a server keeps, each beside
  the session its conversation goes on in.
- `batch.py`: `quipu run --batch`: rows read, planned and answered side by side, in order.
- `manage.py`: `quipu sessions ...` over the store.
- `embed.py`: `quipu embed`.
- `doctor.py`: `quipu doctor`: versions, backends, devices and files, how to get a GPU build,
  and where a model would run and what it would take.
- `tools.py`: the tools a command opens (`open_tools`) (`--functions FILE.py`, `--tools FILE.json`), their
  approval, and the loop that runs them and gives the results back; `tool_files.py`, tools and
  conversations read from the user's files (the schemas of functions from their type hints, tool
  definitions, `--messages`); `tooldefs.py`, what a tool is wherever it comes from; `functions.py`,
  the process the user's functions run in, and `function_worker.py`, what runs in it; `mcp.py`,
  MCP servers over stdio as tools (`--mcp NAME`).
- `hub.py`: models from the Hugging Face Hub (`quipu models pull|rm`, `-m hf:OWNER/REPO[:QUANT]`):
  their names, the files a pull chooses, the pulled models' records and their removal;
  `hub_pull.py`, a pull into the Hub's cache, resumed, checked against the Hub's checksums;
  `hub_search.py`, the Hub's search (`quipu models search`); `known_models.py`, the short
  names (`gemma3:1b`) and what each pulls.
- `launch.py`: `quipu launch AGENT`, a coding agent (Claude Code, Codex, opencode) run on a
  local model through `quipu serve`, pointed at it for that run alone.
- `templates.py`: what a model's chat template does (`quipu models info --template`).
- `cache.py`: `quipu cache info|clear` (the prompt cache itself is used by `prompt_cache.py`).
- `answer_log.py`: the log of answers, written after each answer, searched by `quipu logs`, and
  what a follow-up (`-F`, `--cid`) goes on with; `roles.py`: roles (`--role`, `quipu roles`), a
  system prompt, a model, a prompt and options kept under a name.
"""
