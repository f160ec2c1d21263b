"""A stand-in MCP server that answers each request it reads (not a notification) with the next
scripted line (JSON, or text as it is), with the request's id, another id, or none, and ends when
the script does: what the fuzzing of MCP servers feeds quipu's client (tests/fuzz_worker.py).
`python scripted_server.py SCRIPT.json`."""

import json
import sys

script = json.loads(open(sys.argv[1], encoding="utf-8").read())
for answer, ident in script:
    asked = None
    while asked is None:
        line = sys.stdin.readline()
        if not line:
            sys.exit(0)
        try:
            asked = json.loads(line).get("id")
        except (ValueError, AttributeError):
            asked = None
    if isinstance(answer, dict):
        if ident == "same":
            answer = {**answer, "id": asked}
        elif ident == "other":
            answer = {**answer, "id": 987654}
        out = json.dumps(answer)
    else:
        out = answer if isinstance(answer, str) else json.dumps(answer)
    sys.stdout.write(out.replace("\n", " ") + "\n")
    sys.stdout.flush()
