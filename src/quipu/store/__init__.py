"""Files on disk, and nothing above them: formats that are written atomically, checksummed,
locked, and never pickled.

- `store.py`: `SessionStore`, the sessions folder: names, locks, saving, listing, the disk
  budget; `files.py`, how every file here is written: atomically, locked, copied, and what a
  killed writer left cleaned away.
- `transcript.py`: the transcript format (`NAME.json`), the truth of a session; `branches.py`,
  its other branches, each kept as what it adds to the current one.
- `statefile.py`: the state file format (`NAME.kv`), the verified KV bytes of a context (and of
  a recurrent state kept apart: `NAME.kvr0`, `NAME.kvr1`).
- `chain.py`: what a state file and the pieces of its log (`NAME.kvlog`) hold of a transcript's
  tokens, read from their metadata.
- `cache.py`: `CacheEntries`, context states of earlier prompts, reused by later ones.
- `pulled.py`: `PulledRecord`, the models quipu pulled from the Hugging Face Hub.
- `media.py`: `MediaStore`, the images and recordings sessions hold, each kept once by its hash.
- `fingerprints.py`: `Fingerprints`, model files' fingerprints remembered across runs.
- `logbook.py`: `Logbook`, the log of answers: a SQLite database (WAL, full-text search).
- `responses.py`: `ResponseStore`, the responses a server keeps (the Responses API's `store`).

This package imports neither `quipu.sessions` nor `quipu.app`.
"""
