"""The compute core: the `Backend` protocol (`base.py`), the settings of a context and of where it
runs (`settings.py`), and the llama.cpp implementation:
`LlamaModel` owns a loaded model and its vocabulary (`model.py`), `LlamaBackend` a context on
one (`llama.py`), a facade over the native context it owns (`llama_context.py`: the context, its
memory, its batch, a sequence's state bytes; or one sequence of a context several requests share,
`llama_shared.py`), the one scheduler of a context's sequences, for a batch's rows and a server's
requests (`scheduler.py`), and the parts built on it, each
owning its own state:
the vocabulary as the context's history spells it, `vocabulary.py`;
sampling, `sampler.py`, whose `SamplerChain` is the native sampler chain of one stream of tokens;
state bytes, `llama_state.py`; what the context holds of its history and how it goes back, its
checkpoints and pieces, `llama_memory.py` (a plain cache, a sliding window's ring, a recurrent state); the rows of a batch, `llama_rows.py`; embeddings, `embeddings.py`;
images and audio through a projector and llama.cpp's mtmd, and where each token sits in the
context, `media.py`; a projector file checked before clip.cpp trusts it,
`projector_check.py`). Where a model runs: the devices and backends this llama.cpp
sees, through ggml's own functions (`devices.py`), and the layers placed on them, fitted to their
free memory (`placement.py`), and the threads it computes with, which follow the machine's load
where quipu chooses them (`threads.py`). Beside them: llama-cpp-python's ctypes layer, loaded without its high-level API
(`native.py`), llama.cpp's log (`logs.py`), incremental UTF-8 decoding of token pieces
(`text.py`), grammars as the user gives them (JSON Schema, GBNF, Lark, regular expressions),
checked before any engine sees them (`grammar.py`), and the constraint engine that keeps a
local reply to one, llguidance's token masks on llama.cpp's logits (`constraint.py`); a tool
call's grammar as GBNF, for a server that samples its own tokens (`gbnf.py`); the layout of
llama.cpp's sequence state as far as a session's saves rely on it (`kvstate.py`), and a
sliding-window model's window cache as a ring laid out as an uninterrupted read leaves it
(`ring.py`), and the checkpoints a rewind goes back to where the memory cannot go back a token,
a ring's or a hybrid model's recurrent state, and how a snapshot carries them (`checkpoints.py`).
Apart from
them, models on servers: the HTTP plumbing every server request goes through (`http.py`,
`ServerClient`), any server's OpenAI chat API (`chat_api.py`, `ChatApiModel`), and llama.cpp's
llama-server driven by token arrays, with its slots (`llama_server.py`, `LlamaServerModel`).

Nothing here imports anything above it.
"""
