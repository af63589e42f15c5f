"""Start tests/gate/stub.py as a process on a free loopback port, and end it by its PID (tests and bench/gate.py)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tests.paths import REPO


@dataclass
class Stub:
    proc: subprocess.Popen[str]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/stats", timeout=10) as resp:
            return json.loads(resp.read())


@contextlib.contextmanager
def stub_server(*args: str) -> Iterator[Stub]:
    """``with stub_server("--delay", "0.2") as stub:`` -- the port is read from its first line; always ended."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.gate.stub", *args], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the stub prints its port once listening, or exits (EOF) on an error
        if not line.strip().isdigit():
            raise RuntimeError(f"stub server did not start (exit {proc.poll()})")
        yield Stub(proc, int(line))
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
