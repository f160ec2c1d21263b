"""A real MCP server for the tests, written with the `mcp` package and run over stdio:
`add` answers, `crash` ends the process mid-call, `stall` never answers, `environment` names
the environment variables the server was given."""

import json
import os
import time

from mcp.server.mcpserver import MCPServer

app = MCPServer("quipu-test")


@app.tool()
def add(a: int, b: int) -> int:
    """Add two whole numbers."""
    return a + b


@app.tool()
def crash(reason: str) -> str:
    """Ends the server in the middle of the call."""
    os._exit(3)


@app.tool()
def stall(seconds: int) -> str:
    """Never answers."""
    time.sleep(3600)
    return "late"


@app.tool()
def environment() -> str:
    """The names of the server's environment variables."""
    return json.dumps(sorted(os.environ))


if __name__ == "__main__":
    app.run()
