"""Tools from the user's Python files (`--functions FILE.py`), run in a process of their own
(`function_worker.py`), one for a run or a chat, reused from call to call.

A functions file is the user's code: it is imported only when the command line (or the config)
names it, never because a session file does, and never in quipu's own process. What it prints
never reaches quipu's stdout (a call's stdout is kept with its result; its stderr is handed to
`on_output`, which the CLI shows dimmed); a process that dies (`os._exit`, a signal, a crash)
gives the call an error result and is started again for the next call; one that does not answer
within the timeout, at import or in a call, is killed, and so is one whose run is stopped
(Ctrl-C, SIGTERM: `stopped()` is asked as it is waited for)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from quipu.app.tooldefs import DEFAULT_TIMEOUT, Tool, ToolFailure, ToolOutput, never
from quipu.errors import Interrupted, QuipuError, UsageError
from quipu.sessions.toolspec import ToolSpec

REPLY_MAX = 32 << 20  # bytes of one line from the process (its results are cut well below this)
POLL_S = 0.05  # how often a wait looks at `stopped()`


class WorkerGone(Exception):
    """The process ended, or was ended, before it answered."""


class FunctionWorker:
    """The process the functions files run in, and the one way to talk to it."""

    def __init__(self, files: list[str], timeout: float = DEFAULT_TIMEOUT,
                 stopped: Callable[[], bool] = never, on_output: Callable[[str], None] | None = None):
        self.files = files
        self.timeout = timeout  # for the import
        self.stopped = stopped  # asked while the import is waited for (a call has its own)
        self.on_output = on_output
        self.notices: list[str] = []  # what went wrong with the process, for the front end to say
        self._proc: subprocess.Popen[bytes] | None = None
        self._buffer = b""
        self._errors = b""

    def start(self) -> list[dict[str, Any]]:
        """Starts the process and imports the files; what it says of their functions. An import
        that fails or does not finish in time is a one-line UsageError."""
        try:
            told = self._spawn(self.stopped)
        except WorkerGone as exc:
            raise UsageError(f"the functions file{'s' if len(self.files) > 1 else ''} "
                             f"{', '.join(self.files)} did not load: {exc}") from None
        return told

    def _spawn(self, stopped: Callable[[], bool]) -> list[dict[str, Any]]:
        files = [str(Path(f).expanduser()) for f in self.files]
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "quipu.app.function_worker", str(os.getpid()), *files],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)  # (its own process group: a Ctrl-C is quipu's to pass on, or not)
        self._buffer = self._errors = b""
        first = self._reply(self.timeout, "import", stopped)
        if "error" in first:
            self.kill()
            raise UsageError(str(first["error"]))
        tools = first.get("tools")
        if not isinstance(tools, list):
            self.kill()
            raise WorkerGone("it said nothing quipu can read")
        return tools

    def call(self, file: int, name: str, arguments: dict[str, Any], timeout: float,
             stopped: Callable[[], bool]) -> dict[str, Any]:
        """One call: `{"result", "size", "stdout"}` or `{"error", "stdout"}`. A process that died
        before is started again first."""
        if self._proc is None or self._proc.poll() is not None:
            try:
                self._spawn(stopped)
            except (UsageError, WorkerGone) as exc:
                raise ToolFailure(f"the functions file could not be imported again: {exc}") from None
        assert self._proc is not None and self._proc.stdin is not None
        request = json.dumps({"file": file, "name": name, "arguments": arguments}, ensure_ascii=False)
        try:
            self._proc.stdin.write(request.encode("utf-8", "replace") + b"\n")
            self._proc.stdin.flush()
        except OSError:
            self._died("before the call")
        try:
            return self._reply(timeout, "call", stopped)
        except WorkerGone as exc:
            raise ToolFailure(str(exc)) from None

    def _reply(self, timeout: float, what: str, stopped: Callable[[], bool]) -> dict[str, Any]:
        """The next line the process writes, waited for at most `timeout` seconds."""
        proc = self._proc
        assert proc is not None and proc.stdout is not None and proc.stderr is not None
        out, err = proc.stdout.fileno(), proc.stderr.fileno()
        deadline = time.monotonic() + timeout
        try:
            while b"\n" not in self._buffer:
                if stopped():
                    self.kill()
                    raise Interrupted(f"stopped during the {what} of a functions file")
                left = deadline - time.monotonic()
                if left <= 0:
                    self.kill()
                    raise WorkerGone(f"the tool did not answer within {timeout:g} s; its process was ended" if what == "call"
                                     else f"the import did not finish within {timeout:g} s")
                ready, _, _ = select.select([out, err], [], [], min(POLL_S, left))
                if err in ready:
                    self._said(os.read(err, 65536))
                if out in ready:
                    data = os.read(out, 1 << 20)
                    if not data:
                        self._died(f"during the {what}")
                    self._buffer += data
                    if len(self._buffer) > REPLY_MAX:
                        self.kill()
                        raise WorkerGone(f"it wrote more than {REPLY_MAX >> 20} MB in one answer, and was stopped")
        except BaseException:
            self.kill()  # (a Ctrl-C while waiting: the process goes with it)
            raise
        line, self._buffer = self._buffer.split(b"\n", 1)
        self._drain_errors()
        try:
            reply = json.loads(line)
        except ValueError:
            self.kill()
            raise WorkerGone("it said something quipu cannot read, and was stopped") from None
        if not isinstance(reply, dict):
            raise WorkerGone("it said something quipu cannot read")
        return reply

    def _said(self, data: bytes) -> None:
        """What the user's code wrote on stderr, handed on line by line."""
        if not data:
            return
        self._errors += data
        *lines, self._errors = self._errors.split(b"\n")
        if self.on_output is not None:
            for line in lines:
                self.on_output(line.decode("utf-8", "replace").rstrip("\r"))
        if len(self._errors) > 65536:  # a line without an end is cut
            self._said(b"\n")

    def _drain_errors(self) -> None:
        proc = self._proc
        if proc is None or proc.stderr is None:
            return
        fd = proc.stderr.fileno()
        while select.select([fd], [], [], 0)[0]:
            data = os.read(fd, 65536)
            if not data:
                break
            self._said(data)

    def _died(self, when: str) -> None:
        proc = self._proc
        assert proc is not None
        try:
            code = proc.wait(5)
        except subprocess.TimeoutExpired:
            self.kill()
            code = proc.returncode
        self._drain_errors()
        if self._errors:  # (its last words, though they end no line)
            self._said(b"\n")
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with {code}"
        self.notices.append(f"the process of the functions file {how} {when}; it starts again for the next call")
        self._proc = None
        raise WorkerGone(f"the functions file's process {how} {when}")

    def kill(self) -> None:
        """Ends the process (and whatever it started) at once."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass

    def said(self) -> list[str]:
        """What went wrong with it since last asked."""
        out, self.notices = self.notices, []
        return out

    def close(self) -> None:
        """Ends the process: its stdin closed, then killed if it does not end at once."""
        proc = self._proc
        if proc is not None and proc.poll() is None and proc.stdin is not None:
            try:
                proc.stdin.close()
                proc.wait(0.5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


def functions_from_files(files: list[str], timeout: float = DEFAULT_TIMEOUT, stopped: Callable[[], bool] = never,
                         on_output: Callable[[str], None] | None = None) -> tuple[list[Tool], list[str], FunctionWorker]:
    """Each public function of the files, as a tool that runs in the worker; notices (parameters
    taken as strings for want of a type hint); and the worker (close it when done)."""
    for path in files:
        file = Path(path).expanduser()
        if not file.is_file():
            raise UsageError(f"the functions file {file} does not exist")
    worker = FunctionWorker(files, timeout, stopped, on_output)
    try:
        told = worker.start()
        tools, notices = [], []
        for entry in told:
            tool, said = _tool(entry, worker, files)
            tools.append(tool)
            notices += said
    except BaseException:
        worker.close()
        raise
    return tools, notices, worker


def _tool(entry: Any, worker: FunctionWorker, files: list[str]) -> tuple[Tool, list[str]]:
    try:
        index, name, doc, schema = entry["file"], entry["name"], entry["description"], entry["parameters"]
        untyped = [str(p) for p in entry.get("untyped", [])]
        source = Path(files[index]).name
    except (KeyError, TypeError, IndexError):
        raise QuipuError("the process of the functions file said something quipu cannot read") from None
    if not isinstance(name, str) or not isinstance(schema, dict):
        raise QuipuError("the process of the functions file said something quipu cannot read")

    def run(arguments: dict[str, Any], timeout: float, stopped: Callable[[], bool]) -> ToolOutput:
        reply = worker.call(index, name, arguments, timeout, stopped)
        stdout = str(reply.get("stdout") or "")
        if "error" in reply:
            raise ToolFailure(str(reply["error"]), stdout)
        text = str(reply.get("result") or "")
        size = reply.get("size")
        return ToolOutput(text, size if isinstance(size, int) and size >= len(text) else len(text), stdout)

    notices = [f"{source}: {name}({p}) has no type hint; the model gives it as a string" for p in untyped]
    return Tool(ToolSpec(name, str(doc or ""), schema), run, source), notices
