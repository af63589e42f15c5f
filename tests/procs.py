"""Process helpers the live stacks share (tests/dashboards/livestack.py, tests/alerts/livestack.py,
tests/diag/test_prometheus_loader.py): stop by PID, wait for a server to answer, find the agent's port.

Every wait polls a condition with a short sleep and gives up at a deadline with the process' own
words (its log tail), so a slow start under load costs only its own time and a failed one says why.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

AGENT_URL_RE = re.compile(r"http://(127\.0\.0\.1:(\d+))/metrics")


def _tail(log: Path | None, n: int = 2000) -> str:
    if log is None:
        return ""
    with contextlib.suppress(OSError):
        return ": " + log.read_text(errors="replace")[-n:]
    return ""


def poll_until(check: Callable[[], object], timeout_s: float, every_s: float = 0.1) -> bool:
    """Poll ``check`` until it is truthy (True) or the deadline passes (False): the wait instead of a fixed sleep."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() >= deadline:
            return False
        time.sleep(every_s)
    return True


def wait_for(check: Callable[[], Any], what: str, timeout_s: float = 60.0, every_s: float = 0.2) -> Any:
    """Poll ``check`` until it returns something truthy, and return that; fail the test naming ``what`` at the
    deadline. ``poll_until`` for a test that needs the value, or only a message when it never comes."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


def stop(proc: subprocess.Popen, term_timeout_s: float = 15.0) -> None:  # type: ignore[type-arg]
    """SIGTERM by PID, SIGKILL when it does not exit within ``term_timeout_s``; reaped either way."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=term_timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 30.0, log: Path | None = None) -> None:  # type: ignore[type-arg]
    """Poll ``url`` until it answers 200; fail early when ``proc`` exits, late at the deadline (with ``log``'s tail)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}{_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0, trust_env=False).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} not up after {timeout_s} s{_tail(log)}")


def agent_address(log: Path, proc: subprocess.Popen, timeout_s: float = 60.0) -> str:  # type: ignore[type-arg]
    """``host:port`` of a ``diag collect --listen 127.0.0.1:0``, read from the line it logs when it listens."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = AGENT_URL_RE.search(log.read_text(errors="replace"))
        if m:
            return m.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"the agent exited with {proc.returncode}{_tail(log)}")
        time.sleep(0.1)
    raise RuntimeError(f"the agent did not start within {timeout_s} s{_tail(log)}")


def agent_port(log: Path, proc: subprocess.Popen, timeout_s: float = 60.0) -> int:  # type: ignore[type-arg]
    return int(agent_address(log, proc, timeout_s).rsplit(":", 1)[1])
