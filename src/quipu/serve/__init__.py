"""`quipu serve`: the OpenAI API (chat completions and Responses), Anthropic's Messages API and
Ollama's over HTTP, on `app/` (it parses and renders, as the command line does), each request
through the one turn path (`app/served.py`).

- `http.py`: the routes, the door every request passes (Host, Origin, key), bodies read within
  bounds and off the event loop, every failure in the API's shape.
- `server.py`: uvicorn, with connections held within bounds and a stop that cuts every reply at
  its next token.
- `plan.py`: what a request asks, read into the turn's options through the registry of options
  (`quipu/options.py`) and checked before anything is loaded (`RequestError`).
- `pool.py`: admission (every request counted from arrival to its last byte, busy past the
  places), the models loaded and unloaded after their keep-alive, and their slots.
- `stream.py`: a request's reply as events from its turn's thread, through a bounded queue, made
  server-sent events or JSON lines.
- `apis.py`: each API a model answers through, a class each: how its request is read, and its
  reply and failures shaped, whole or streamed.
- `wire.py`: the OpenAI API's and Ollama's bodies, whole and in pieces, and their errors (a
  client's a 4xx); `anthropic.py` and `responses.py`, the Messages and Responses APIs' requests,
  replies and events (a response kept, going on from one).
"""
