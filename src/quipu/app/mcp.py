"""MCP servers as tools (`--mcp NAME`): each server is started over stdio with the official
`mcp` package, its tools listed and offered to the model as `NAME_tool`, and its calls made on
an event loop of the server's own, in a thread, so that the tool loop stays plain code.

A server comes from the config (`[mcp.NAME]`: command, args, env, env_pass, timeout) or from a JSON file
in the `mcpServers` shape other tools use (`--mcp-config FILE`). One that fails to start is a
one-line error naming it; one that dies or never answers gives the call an error, which goes
back to the model as the call's result. Imported only when a server is asked for."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from quipu.app.user_files import read_json_file
from quipu.app.tooldefs import Runner, Tool, ToolFailure, ToolOutput, never
from quipu.config import MCP_KEYS, check_mcp_server
from quipu.errors import Interrupted, QuipuError, UsageError
from quipu.sessions.toolspec import ToolSpec

if TYPE_CHECKING:
    from mcp import ClientSession

START_TIMEOUT = 30.0  # seconds a server may take to start and list its tools
POLL_S = 0.05  # how often a wait looks whether the user stopped it


class McpError(QuipuError):
    """An MCP server could not be started."""


def servers_from_file(path: str) -> dict[str, dict[str, Any]]:
    """`{"mcpServers": {NAME: {"command", "args", "env"}}}`, checked."""
    file = Path(path).expanduser()
    data = read_json_file(path, "MCP config")
    servers = data.get("mcpServers") if isinstance(data, dict) else None
    if not isinstance(servers, dict) or not all(isinstance(v, dict) for v in servers.values()):
        raise UsageError(f"the MCP config {file} has no mcpServers object ({{\"mcpServers\": {{NAME: "
                         "{\"command\": ...}}}})")
    out = {}
    for name, server in servers.items():
        server = {k: v for k, v in server.items() if k in MCP_KEYS}
        out[name] = check_mcp_server(server, lambda message: UsageError(f"{file}: {message}"), f"server {name!r}")
    return out


def tool_name(server: str, tool: str, prefix: str | None = None) -> str:
    """A server's tool as the model is told of it: `SERVER_tool`, or the config's own prefix."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{server}_{tool}" if prefix is None else f"{prefix}{tool}")[:64] or "_"


def server_environment(definition: dict[str, Any]) -> dict[str, str]:
    """What a server's process is given of the environment: the `mcp` package's few safe names
    (HOME, PATH, USER, ...), those its definition passes by name (`env_pass`), and what it sets
    (`env`). Never the rest: a token or a cloud credential goes only to a server asked to have it."""
    from mcp.client.stdio import get_default_environment

    passed = {name: os.environ[name] for name in definition.get("env_pass", ()) if name in os.environ}
    return {**get_default_environment(), **passed, **definition.get("env", {})}


class McpServer:
    """One MCP server over stdio, its session held open on an event loop in a thread of its own."""

    def __init__(self, name: str, definition: dict[str, Any], stopped: Callable[[], bool] = never):
        self.name = name
        self.stopped = stopped  # asked while the server is waited for to start (Ctrl-C, SIGTERM)
        self.notices: list[str] = []
        self.definition = definition
        self.timeout = definition.get("timeout", 60.0)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[Any] | None = None
        self._session: "ClientSession | None" = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._closed = threading.Event()  # (a server given up on before its loop ran never starts)
        self._failure: BaseException | None = None
        self._listed: list[Any] = []
        self.tools: list[Tool] = []
        self._errlog = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"mcp {name}")

    # ---- the server's thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # said to the waiting side, never lost in the thread
            self._failure = self._failure or exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        from mcp import ClientSession
        from mcp.client.stdio import StdioServerParameters, stdio_client

        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._stop = asyncio.Event()
        if self._closed.is_set():  # given up on while its thread was starting: no process is made
            return
        params = StdioServerParameters(command=self.definition["command"], args=self.definition["args"],
                                       env=server_environment(self.definition))
        async with stdio_client(params, errlog=self._errlog) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                listed = await session.list_tools()
                self._listed = list(listed.tools)
                self._session = session
                self._ready.set()
                await self._stop.wait()

    # ---- the caller's side ---------------------------------------------------------------------

    def start(self) -> list[Tool]:
        """Starts the server and lists its tools; a one-line McpError when it cannot."""
        # The package is imported here, before its thread runs: a close while that thread was
        # still importing it would import it a second time alongside, and get half of it.
        import mcp.client.stdio  # noqa: F401

        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not self._ready.wait(POLL_S):
            if self.stopped():
                self.close(at_once=True)
                raise Interrupted(f"stopped while the MCP server {self.name!r} started")
            if time.monotonic() > deadline:
                self.close(at_once=True)
                raise McpError(f"the MCP server {self.name!r} did not start within {START_TIMEOUT:g} s")
        if self._session is None:
            raise McpError(f"the MCP server {self.name!r} did not start: {self._why()}")
        tools = []
        for listed in self._listed:
            schema = getattr(listed, "input_schema", None) or getattr(listed, "inputSchema", None) or {
                "type": "object"}
            schema = {k: v for k, v in schema.items() if k != "title"}
            spec = ToolSpec(tool_name(self.name, listed.name, self.definition.get("prefix")), listed.description or "",
                            schema)
            tools.append(Tool(spec, self._caller(listed.name), f"MCP server {self.name}", self.timeout))
        self.tools = tools
        return tools

    def _why(self) -> str:
        self._errlog.seek(0)
        said = [line.strip() for line in self._errlog.read().splitlines() if line.strip()]
        failure = self._failure
        while isinstance(failure, BaseExceptionGroup) and failure.exceptions:  # (anyio's task groups wrap the cause)
            failure = failure.exceptions[0]
        if said:
            return said[-1][:300]
        if failure is not None:
            return f"{type(failure).__name__}: {failure}"[:300] if str(failure) else type(failure).__name__
        return "it ended before listing its tools"

    def _caller(self, tool: str) -> Runner:
        def call(arguments: dict[str, Any], timeout: float, stopped: Callable[[], bool]) -> ToolOutput:
            if self._session is None or self._loop is None or not self._thread.is_alive():
                raise ToolFailure(f"the MCP server {self.name!r} is no longer running")
            future = asyncio.run_coroutine_threadsafe(self._session.call_tool(tool, arguments), self._loop)
            deadline = time.monotonic() + timeout
            try:
                while True:
                    try:
                        result = future.result(POLL_S)
                        break
                    except concurrent.futures.TimeoutError:
                        if stopped():
                            future.cancel()
                            raise Interrupted(f"stopped during a call of the MCP server {self.name!r}") from None
                        if time.monotonic() > deadline:
                            future.cancel()
                            raise ToolFailure(f"the MCP server {self.name!r} did not answer within {timeout:g} s") \
                                from None
            except (ToolFailure, Interrupted):
                raise
            except Exception as exc:
                self._thread.join(1.0)
                if not self._thread.is_alive() or "closed" in str(exc).lower():
                    raise ToolFailure(f"the MCP server {self.name!r} died during the call") from None
                raise ToolFailure(str(exc) or type(exc).__name__) from None
            except BaseException:
                future.cancel()  # (a Ctrl-C while waiting)
                raise
            parts = [part_text(part) for part in (result.content or [])]
            text = "\n".join(note for note, _ in parts)
            if getattr(result, "is_error", False) or getattr(result, "isError", False):
                raise ToolFailure(text or "the tool failed")
            return ToolOutput(text, len(text), media=tuple((note, data) for note, data in parts if data is not None))

        return call

    def said(self) -> list[str]:
        """What went wrong with it since last asked."""
        out, self.notices = self.notices, []
        return out

    def close(self, at_once: bool = False) -> None:
        """Ends the session and the server: its stdin closed, and the `mcp` package's grace before
        it is killed; `at_once` (the user stopped quipu, or it never answered) with almost none."""
        if at_once:
            import mcp.client.stdio

            # (the package's own shutdown, with its waits cut short: quipu is leaving)
            mcp.client.stdio.PROCESS_TERMINATION_TIMEOUT = 0.1
            mcp.client.stdio.FORCE_KILL_TIMEOUT = 0.1
            mcp.client.stdio._WRITER_FLUSH_TIMEOUT = 0.05
        self._closed.set()  # (before the task is read: either it is cancelled, or it sees this and ends)
        if self._loop is not None and self._thread.is_alive():
            if self._session is not None and self._stop is not None and not at_once:
                self._loop.call_soon_threadsafe(self._stop.set)
            elif self._task is not None:
                self._loop.call_soon_threadsafe(self._task.cancel)
            self._thread.join(5)
        self._errlog.close()


def start_servers(names: Sequence[str], config_servers: dict[str, dict[str, Any]], config_file: str | None,
                  stopped: Callable[[], bool] = never) -> list[McpServer]:
    """The servers named, started (those already started are closed if one fails)."""
    known = dict(config_servers)
    if config_file:
        known.update(servers_from_file(config_file))
    started: list[McpServer] = []
    try:
        for name in names:
            if name not in known:
                listed = ", ".join(sorted(known)) or "none: add [mcp.NAME] to the config, or give --mcp-config FILE"
                raise UsageError(f"no MCP server named {name!r} (known: {listed})")
            server = McpServer(name, known[name], stopped)
            started.append(server)
            server.start()
    except BaseException as exc:
        for server in started:
            server.close(at_once=not isinstance(exc, QuipuError) or isinstance(exc, Interrupted))
        raise
    return started


def part_text(part: Any) -> tuple[str, bytes | None]:  # (a part of an MCP tool result)
    """A part of a tool's result as the model is given it, and its bytes where it is an image or
    a recording: text as it is; an image, a recording or a binary resource as a short note of
    what it is (`[image: PNG, 1.2 KB]`), never its base64 bytes; anything else as its JSON."""
    import base64
    import binascii

    from quipu.app.attachments import describe_bytes

    kind = getattr(part, "type", None)
    if kind == "text":
        return str(getattr(part, "text", "") or ""), None
    if kind in ("image", "audio"):
        try:
            data = base64.b64decode(str(getattr(part, "data", "") or ""), validate=True)
        except (binascii.Error, ValueError):
            return f"[{kind}: not valid base64]", None
        return describe_bytes(kind, data, str(getattr(part, "mimeType", "") or "")), data
    if kind == "resource":
        resource = getattr(part, "resource", None)
        text = getattr(resource, "text", None)
        if isinstance(text, str):
            return text, None
        blob = str(getattr(resource, "blob", "") or "")
        uri = getattr(resource, "uri", "")
        return f"[resource: {uri}, {getattr(resource, 'mimeType', None) or 'bytes'}, about {len(blob) * 3 // 4} B]", None
    if kind == "resource_link":
        return f"[resource: {getattr(part, 'uri', '')}]", None
    return json.dumps(part.model_dump(), default=str), None
