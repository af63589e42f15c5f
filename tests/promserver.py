"""A real Prometheus on 127.0.0.1 for tests: free port, generated config, started and stopped by PID.

Why a real one: the Prometheus loader's behaviour is decided by what the server does -- lookback
and staleness in range queries, ``rate()`` windows, ``histogram_quantile`` over real buckets, error
replies -- and a fake would only repeat our assumptions. The Debian package ``prometheus`` (2.42)
provides the binary; its service is never started, we run our own. Without the binary the test is
skipped with the reason (``make test`` installs it).

Timing (measured with Prometheus 2.42 on a 2-core host): ``/-/ready`` after ~0.1 s, but the first scraped sample is
queryable only ~5-6 s after that even with ``scrape_interval: 1s`` -- poll with :meth:`PromServer.wait_for`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

BINARY = "prometheus"


def wait_ready(proc: subprocess.Popen[bytes], url: str, name: str, timeout_s: float, log_tail: Callable[[], str]) -> None:
    """Poll ``url`` until it answers 200 (a server we started); its exit or the deadline is an error with its log's tail."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}: {log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0, trust_env=False).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} not ready after {timeout_s} s: {log_tail()}")
        time.sleep(0.05)


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    """End a server we started, by its PID: SIGTERM, then SIGKILL if it has not exited within 10 s."""
    if proc is not None and proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def free_port() -> int:
    """A port nobody listens on right now (bound and released; the race is harmless on loopback in tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def require_prometheus() -> str:
    path = shutil.which(BINARY)
    if path is None:
        pytest.skip("the prometheus binary is not installed (Debian package 'prometheus'; `make test` installs it)")
    return path


@dataclass
class ScrapeJob:
    """One scrape job: static targets (``host:port``), optional extra target labels and relabelling of instance."""

    name: str
    targets: Sequence[str]
    labels: Mapping[str, str] | None = None
    instance: str | None = None  # replace the instance label (pretend the target is another machine)


@dataclass
class PromServer:
    url: str
    pid: int
    folder: Path

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query; the result list (empty on any error, so it can be polled)."""
        try:
            r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=5.0, trust_env=False)
            body = r.json()
        except (httpx.HTTPError, ValueError):
            return []
        return list(body.get("data", {}).get("result", [])) if body.get("status") == "success" else []

    def wait_for(self, expr: str, ok: Callable[[list[dict[str, Any]]], bool], timeout_s: float = 30.0) -> bool:
        """Poll ``expr`` every 0.25 s until ``ok(result)``; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ok(self.query(expr)):
                return True
            time.sleep(0.25)
        return False

    def log_tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return (self.folder / "prometheus.log").read_text(errors="replace")[-n:]
        return ""


def rules_evaluated_after(url: str, since: float, *, alerting_only: bool = False) -> bool:
    """Whether every rule group of the Prometheus at ``url`` has been evaluated after ``since`` (epoch seconds).

    What a test waits for instead of sleeping "a few evaluation cycles": once each group ran after the
    moment of interest, the recording rules and alert states reflect it. ``alerting_only``: only the groups
    holding an alerting rule (the long-window recording groups may evaluate only every few minutes)."""
    try:
        body = httpx.get(f"{url}/api/v1/rules", timeout=5.0, trust_env=False).json()
    except (httpx.HTTPError, ValueError):
        return False
    groups = body.get("data", {}).get("groups", []) if body.get("status") == "success" else []
    if alerting_only:
        groups = [g for g in groups if any(r.get("type") == "alerting" for r in g.get("rules", []))]
    return bool(groups) and all(_epoch(g.get("lastEvaluation", "")) > since for g in groups)


def _epoch(stamp: str) -> float:
    """RFC 3339 with nanoseconds, as Prometheus writes it (``2026-01-02T03:04:05.123456789Z``), to epoch seconds."""
    match = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", stamp)
    if match is None:
        return 0.0
    whole = datetime.fromisoformat(match[1] + ("+00:00" if match[3] == "Z" else match[3]))
    return whole.timestamp() + float(f"0.{match[2] or 0}")


def _config(jobs: Sequence[ScrapeJob], interval: str) -> str:
    """YAML by hand (flow style where short): no PyYAML dependency for one small file."""
    lines = ["global:", f"  scrape_interval: {interval}", f"  evaluation_interval: {interval}", "scrape_configs:"]
    for job in jobs:
        lines += [f"  - job_name: {job.name!r}", f"    scrape_interval: {interval}", "    static_configs:"]
        lines.append(f"      - targets: [{', '.join(repr(t) for t in job.targets)}]")
        if job.labels:
            lines.append("        labels: {" + ", ".join(f"{k!r}: {v!r}" for k, v in job.labels.items()) + "}")
        if job.instance:
            lines += ["    relabel_configs:", f"      - {{target_label: instance, replacement: {job.instance!r}}}"]
    return "\n".join(lines).replace("'", '"') + "\n"


@contextlib.contextmanager
def prometheus(
    jobs: Sequence[ScrapeJob],
    interval: str = "1s",
    ready_timeout_s: float = 15.0,
    *,
    config: str | None = None,
    backfill: Sequence[Path] = (),
) -> Iterator[PromServer]:
    """Run Prometheus scraping ``jobs`` every ``interval``; killed by PID and its data removed on exit.

    ``config``: a whole prometheus.yml to run instead (e.g. a shipped example with its targets rewritten).
    ``backfill``: OpenMetrics files written into the TSDB first (``promtool tsdb create-blocks-from openmetrics``)."""
    binary = require_prometheus()
    folder = Path(tempfile.mkdtemp(prefix="llmdiag-prom-"))
    proc: subprocess.Popen[bytes] | None = None
    try:
        if backfill:
            promtool = shutil.which("promtool")
            if promtool is None:
                pytest.skip("promtool is not installed (Debian package 'prometheus'; `make test` installs it)")
            for path in backfill:
                subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", str(path), str(folder / "data")],
                               check=True, capture_output=True, timeout=120)  # fmt: skip
        (folder / "prometheus.yml").write_text(config if config is not None else _config(jobs, interval))
        port = free_port()
        with (folder / "prometheus.log").open("wb") as log:
            proc = subprocess.Popen(
                [binary, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, cwd=folder,
            )  # fmt: skip
        server = PromServer(f"http://127.0.0.1:{port}", proc.pid, folder)
        wait_ready(proc, f"{server.url}/-/ready", "prometheus", ready_timeout_s, server.log_tail)
        yield server
    finally:
        stop(proc)
        shutil.rmtree(folder, ignore_errors=True)
