"""``python -m llama_cpp.server`` on a GGUF file, optionally inside a limited memory cgroup, cleaned up by PID.

Why a subprocess of llama-cpp-python's own server, not an in-process ``Llama``: the point is an engine
we did not write, attached from outside -- its FastAPI app, its two-level model lock (a real FIFO queue
in front of one model: anyio's locks serve waiters in order), its native threads, its mmap'd or mlock'd
weights -- all in a process the agent watches like any other.

The settings that shape memory and queueing are explicit (``use_mmap``, ``use_mlock``, ``n_ctx``, ``n_threads``,
``interrupt_requests``):
llama-cpp-python's own default for ``use_mlock`` depends on whether the host allows mlock, and a
scenario must not. The server binds port 0 and the harness reads the port uvicorn reports in its log,
so parallel runs never race for a port. Readiness is polled (the log for the port, then ``/v1/models``)
under a deadline that ends early, with the log's tail, when the process dies.

Cleanup is by PID only: a server in a group is killed with everything in the group
(``MemoryGroup.kill_all``, from the group's own ``cgroup.procs``); one outside a group is terminated,
then killed, by its own PID.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import httpx

from diag.demo.engine.model import EngineUnavailable
from diag.demo.scenarios.cgroups import MemoryGroup

PORT_RE = re.compile(r"Uvicorn running on https?://127\.0\.0\.1:(\d+)")
START_TIMEOUT_S = 60.0
# Waits for one byte (or EOF) on stdin, then becomes the server: ``os.execv`` keeps the PID and the group.
_GATE = "import os, sys; sys.stdin.buffer.read(1); os.execv(sys.argv[1], sys.argv[1:])"


def unavailable_reason() -> str | None:
    """Why llama-cpp-python's server cannot run here (the ``engines`` extra is missing), or None."""
    import importlib.util

    for module in ("llama_cpp", "gguf", "sse_starlette", "starlette_context", "pydantic_settings"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed: the engine needs the extra (pip install -c constraints.txt '.[engines]')"
    return None


@dataclass(frozen=True)
class EngineSettings:
    """The server's settings that matter to a scenario; every one is passed explicitly."""

    model: Path
    n_ctx: int = 512
    n_threads: int = 1
    use_mmap: bool = True
    use_mlock: bool = False
    n_batch: int = 64
    # llama-cpp-python's default (true) ends a streamed answer after its current token as soon as another request
    # waits for the model lock: under concurrency every stream but the last is cut to one token, so the queue is
    # emptied by truncation instead of waited through. Off here, as a server meant to answer in full runs.
    interrupt_requests: bool = False

    def argv(self) -> list[str]:
        def flag(value: bool) -> str:
            return "true" if value else "false"

        return [
            sys.executable, "-m", "llama_cpp.server",
            "--model", str(self.model),
            "--host", "127.0.0.1", "--port", "0",
            "--n_ctx", str(self.n_ctx),
            "--n_batch", str(self.n_batch),
            "--n_threads", str(self.n_threads), "--n_threads_batch", str(self.n_threads),
            "--use_mmap", flag(self.use_mmap), "--use_mlock", flag(self.use_mlock),
            "--interrupt_requests", flag(self.interrupt_requests),
            "--verbose", "false",
        ]  # fmt: skip


class EngineStartError(RuntimeError):
    """The server did not become ready; the message carries its log's tail."""


class EngineServer:
    """One running llama-cpp-python server: its process, URL and log. A context manager: exit stops it by PID."""

    def __init__(
        self, settings: EngineSettings, log_path: Path, group: MemoryGroup | None = None, *, wrap_recorder: Path | None = None
    ) -> None:
        """``wrap_recorder``: run the server under ``diag wrap`` (llm-diag's tracking applied from outside, the request
        rows written to that flight recorder); the server keeps the PID ``diag wrap`` started with (it execs)."""
        self.settings = settings
        self.log_path = log_path
        self.group = group
        self.wrap_recorder = wrap_recorder
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None
        self._log: TextIO | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the server is not started")
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("the server is not started")
        return self.proc.pid

    def start(self, timeout_s: float = START_TIMEOUT_S, on_spawn: Callable[[int], object] | None = None) -> EngineServer:
        """Spawn the server and wait until it serves.

        ``on_spawn(pid)``: the process is held at a gate (a Python that waits for one byte on stdin, then execs the
        server in place: same PID, same group) until ``on_spawn`` returns. A server that dies while it loads (an OOM
        kill at start-up, a second after exec) is then watched from its first moment: whatever ``on_spawn`` starts
        is running before the server is.
        """
        reason = unavailable_reason()
        if reason:
            raise EngineUnavailable(reason)
        if not self.settings.model.is_file():
            raise FileNotFoundError(f"no model file at {self.settings.model}")
        self._log = self.log_path.open("w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        argv = self.settings.argv()
        if self.wrap_recorder is not None:
            wrap = ["wrap", "--recorder", str(self.wrap_recorder), "--model", "engine", "--"]
            argv = [sys.executable, "-m", "diag.cli", *wrap, *argv]
        stdin = subprocess.DEVNULL
        if on_spawn is not None:
            argv, stdin = [sys.executable, "-c", _GATE, *argv], subprocess.PIPE
        kwargs = {"stdout": self._log, "stderr": subprocess.STDOUT, "stdin": stdin, "env": env}
        self.proc = self.group.spawn(argv, **kwargs) if self.group else subprocess.Popen(argv, **kwargs)
        try:
            if on_spawn is not None:
                assert self.proc.stdin is not None
                try:
                    on_spawn(self.proc.pid)
                finally:
                    with contextlib.suppress(OSError):
                        self.proc.stdin.write(b"\n")  # open the gate (also when on_spawn failed: stop() then ends it)
                        self.proc.stdin.close()
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def log_tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return ""

    def _wait_ready(self, timeout_s: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineStartError(f"llama_cpp.server exited with {self.proc.returncode}: {self.log_tail()}")
            if self.port is None:
                match = PORT_RE.search(self.log_tail(100_000))
                if match:
                    self.port = int(match.group(1))
            if self.port is not None:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{self.url}/v1/models", timeout=2.0).status_code == 200:
                        return
            time.sleep(0.1)
        raise EngineStartError(f"llama_cpp.server not ready after {timeout_s:.0f} s: {self.log_tail()}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server by PID (in a group: everything in the group, by PID); idempotent."""
        if self.proc is not None:
            if self.group is not None:
                self.group.kill_all(timeout=timeout_s)
            elif self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(timeout=timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> EngineServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
