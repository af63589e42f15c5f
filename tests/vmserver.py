"""A real single-node VictoriaMetrics on 127.0.0.1 for tests: free port, temporary storage, stopped by PID.

Why a real one: long-term stores speak Prometheus's query API with their own semantics -- VictoriaMetrics'
``rate`` does not extrapolate, its lookback follows the scrape interval rather than 5 minutes, and it refuses
queries past its ``-search.max*`` limits with a 422 and its own error text. A fake would only repeat our
assumptions about all that. The Debian package ``victoria-metrics`` (1.79 in bookworm) provides the binary;
its service is never started, we run our own. Without the binary the test is skipped with the reason.

Series go in through the import API (``/api/v1/import/prometheus``: the exposition format with millisecond
timestamps), from the same OpenMetrics documents the Prometheus tests backfill with promtool, and are
flushed (``/internal/force_flush``) before the first query.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.promserver import free_port

BINARY = "victoria-metrics"


def require_victoria_metrics() -> str:
    path = shutil.which(BINARY)
    if path is None:
        pytest.skip("the victoria-metrics binary is not installed (Debian package 'victoria-metrics'; "
                    "`make system-deps` installs it)")  # fmt: skip
    return path


@dataclass
class VmServer:
    url: str
    pid: int
    folder: Path

    def log_tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return (self.folder / "vm.log").read_text(errors="replace")[-n:]
        return ""

    def import_openmetrics(self, path: Path, chunk_lines: int = 200_000) -> int:
        """Import an OpenMetrics file's samples (seconds -> milliseconds); the number of samples sent.

        NaN samples are what the recording's converter writes where Prometheus would write a staleness marker
        (a series that vanished); the exposition format cannot carry a staleness marker, and VictoriaMetrics
        drops a plain NaN on import, so they are left out here and the lookback closes the series instead.
        """
        sent = 0
        batch: list[str] = []

        def flush() -> None:
            if batch:
                r = httpx.post(f"{self.url}/api/v1/import/prometheus", content="\n".join(batch) + "\n", timeout=120,
                               trust_env=False)  # fmt: skip
                if r.status_code >= 300:
                    raise RuntimeError(f"import refused: HTTP {r.status_code}: {r.text[:300]}")
                batch.clear()

        with path.open() as lines:
            for line in lines:
                line = line.rstrip("\n")
                if not line or line.startswith("#"):
                    continue
                series, value, ts = line.rsplit(" ", 2)
                if value == "NaN":
                    continue
                batch.append(f"{series} {value} {round(float(ts) * 1000)}")
                sent += 1
                if len(batch) >= chunk_lines:
                    flush()
        flush()
        httpx.get(f"{self.url}/internal/force_flush", timeout=60, trust_env=False).raise_for_status()
        return sent


@contextlib.contextmanager
def victoria_metrics(flags: Sequence[str] = (), ready_timeout_s: float = 20.0) -> Iterator[VmServer]:
    """Run VictoriaMetrics with ``flags`` (e.g. ``-search.maxUniqueTimeseries=10``); killed by PID, data removed.

    ``-search.disableCache``: the rollup cache assumes data arrives in time order; backfilled samples would
    otherwise be hidden behind cached empty answers. ``-retentionPeriod=100y``: any imported time is kept."""
    binary = require_victoria_metrics()
    folder = Path(tempfile.mkdtemp(prefix="llmdiag-vm-"))
    proc: subprocess.Popen[bytes] | None = None
    try:
        port = free_port()
        with (folder / "vm.log").open("wb") as log:
            proc = subprocess.Popen(
                [binary, f"-storageDataPath={folder / 'data'}", f"-httpListenAddr=127.0.0.1:{port}",
                 "-retentionPeriod=100y", "-search.disableCache", "-loggerLevel=WARN", *flags],
                stdout=log, stderr=subprocess.STDOUT, cwd=folder,
            )  # fmt: skip
        server = VmServer(f"http://127.0.0.1:{port}", proc.pid, folder)
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"victoria-metrics exited with {proc.returncode}: {server.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{server.url}/health", timeout=1.0, trust_env=False).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"victoria-metrics not ready after {ready_timeout_s} s: {server.log_tail()}")
            time.sleep(0.05)
        yield server
    finally:
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)
