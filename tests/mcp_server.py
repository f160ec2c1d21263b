"""A real MCP server for the tests, written with the `mcp` package and run over stdio:
`add` answers, `crash` ends the process mid-call, `stall` never answers, `environment` names
the environment variables the server was given, `picture` answers with an image."""

import json
import os
import time

from mcp.server.mcpserver import Image, MCPServer

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


@app.tool()
def picture() -> Image:
    """A small picture (PNG, 8x6 pixels)."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    rows = b"".join(b"\x00" + b"\xc8\x1e\x5a" * 8 for _ in range(6))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 8, 6, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
    return Image(data=png, format="png")


if __name__ == "__main__":
    app.run()
