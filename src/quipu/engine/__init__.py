"""The compute core: the `Backend` protocol (`base.py`) and its llama.cpp implementation:
`LlamaModel` owns a loaded model and its vocabulary (`model.py`), `LlamaBackend` a context on
one (`llama.py`), `SamplerChain` the native sampler chain of one stream of tokens
(`sampler.py`). Beside them: llama-cpp-python's ctypes layer, loaded without its high-level API
(`native.py`), llama.cpp's log (`logs.py`), incremental UTF-8 decoding of token pieces
(`text.py`), and grammars: GBNF, and JSON Schema turned into GBNF (`grammar.py`). Apart from
them, a model behind an OpenAI-compatible HTTP server (`remote.py`), and llama.cpp's
llama-server driven by tokens (`server.py`, a `ServedBackend`).

Nothing here imports anything above it.
"""
