"""/metrics sums over worker processes (prometheus_client multiprocess mode), with real processes.

The app is ``tests.collectors.test_tracking_app:app_from_env`` under ``uvicorn --workers 2`` with
``PROMETHEUS_MULTIPROC_DIR`` set in the environment, as a deployment would do it. Every process we
start is killed by PID at the end (workers too, should the master die first).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from collectors import catalog
from collectors.recorder import FlightRecorder
from collectors.records import RequestTiming
from collectors.tracking.series import FLUSH_INTERVAL_S

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _kill(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@contextlib.contextmanager
def workers(tmp_path: Path, n: int, **env: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = _free_port()
    full_env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom"),
        "LLMDIAG_TEST_RECORDER": str(tmp_path / "rec.db"),
        **env,
    }
    full_env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    (tmp_path / "prom").mkdir()
    argv = [sys.executable, "-m", "uvicorn", "--factory", "tests.collectors.test_tracking_app:app_from_env",
            "--host", "127.0.0.1", "--port", str(port), "--workers", str(n), "--log-level", "warning",
            "--no-access-log"]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=ROOT, env=full_env)
    known: set[int] = set()
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            known.update(_children(proc.pid))
            try:
                if httpx.get(base + "/health", timeout=2).status_code in (200, 503):
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("uvicorn workers did not come up")
            time.sleep(0.2)
        yield base, proc
    finally:
        known.update(_children(proc.pid))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        _kill(sorted(known), signal.SIGKILL)  # no orphans, whatever happened to the master


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    out = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out.append((sample.labels, sample.value))
    return out


@pytest.mark.process
def test_metrics_sum_over_two_worker_processes(tmp_path: Path) -> None:
    with workers(tmp_path, 2, LLMDIAG_TEST_MAX_CONCURRENCY="3", LLMDIAG_TEST_QUEUE_SIZE="5") as (base, _proc):
        sent = 0
        pids: set[int] = set()
        # fresh connections so the kernel spreads them over both workers' accept() calls
        while sent < 40 or (len(pids) < 2 and sent < 400):
            response = httpx.get(base + "/work?ms=1", headers={"connection": "close"})
            assert response.status_code == 200
            pids.add(response.json()["pid"])
            sent += 1
        assert len(pids) == 2, "both workers must have served requests"
        # Each worker writes its counts to the shared files at least every FLUSH_INTERVAL_S (and before it renders
        # /metrics itself): the scraped worker is exact at once, the other within that interval.
        deadline = time.monotonic() + 10 * FLUSH_INTERVAL_S
        while True:
            text = httpx.get(base + "/metrics", headers={"connection": "close"}).text
            if sum(v for _, v in _samples(text, catalog.REQUESTS.name)) == sent or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    requests = _samples(text, catalog.REQUESTS.name)
    assert sum(v for _, v in requests) == sent
    assert sum(v for labels, v in requests if labels["outcome"] == "ok") == sent
    assert sum(v for _, v in _samples(text, catalog.REQUEST_E2E.name + "_count")) == sent
    # gauges: livesum over live workers -> 3 slots + 3 slots
    assert sum(v for _, v in _samples(text, catalog.ADMISSION_MAX_CONCURRENCY.name)) == 6
    assert sum(v for _, v in _samples(text, catalog.ACTIVE_INFERENCES.name)) == 0
    with FlightRecorder(tmp_path / "rec.db") as rec:
        rows = [r for r in rec.read(["request"]) if isinstance(r, RequestTiming)]
    assert len(rows) == sent  # both workers wrote to the one recorder
    assert {r.pid for r in rows} == pids


@pytest.mark.process
def test_dead_workers_live_gauges_are_swept(tmp_path: Path) -> None:
    """A worker killed without cleanup (OOM kill) must not keep reporting its last queue depth."""
    prom = tmp_path / "prom"
    prom.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(prom), "PYTHONPATH": str(ROOT)}
    script = textwrap.dedent(
        """
        import os, signal
        from prometheus_client import CollectorRegistry
        from collectors.tracking import RequestTracker
        from collectors.tracking.metrics import flush_metrics
        t = RequestTracker("w", recorder=False, registry=CollectorRegistry())
        for _ in range(5): t.recording.series_for("/x").queued()   # a worker with 5 queued requests ...
        for _ in range(2): t.recording.series_for("/x").finished("ok", False, 0.1, 0.1, 0.2, None)
        flush_metrics()                         # a flush interval passes (the flusher thread's or a scrape's) ...
        os.kill(os.getpid(), signal.SIGKILL)    # ... then it is killed without any cleanup
        """
    )
    dead = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT)
    assert dead.returncode == -signal.SIGKILL
    alive = subprocess.run(
        [sys.executable, "-c", script.replace("os.kill(os.getpid(), signal.SIGKILL)", "pass")
         .replace("range(5)", "range(1)") + "\nfrom collectors.tracking import metrics_response\n"
         "import sys; sys.stdout.buffer.write(metrics_response()[0])"],
        env=env, cwd=ROOT, capture_output=True, check=True,
    )  # fmt: skip
    text = alive.stdout.decode()
    # the dead worker's queue depth is gone; its counter (history) is kept; the live one's depth is there
    assert sum(v for _, v in _samples(text, catalog.QUEUE_DEPTH.name)) == 1
    assert sum(v for labels, v in _samples(text, catalog.REQUESTS.name) if labels["outcome"] == "ok") == 4


@pytest.mark.process
def test_a_worker_that_exits_between_two_forwards_loses_no_row(tmp_path: Path) -> None:
    """The buffer forwards rows once a second; a worker that exits normally in between (uvicorn and gunicorn
    workers end this way on SIGTERM, without closing the tracker) writes them at exit."""
    script = textwrap.dedent(
        """
        import asyncio, sys
        from collectors.tracking import RequestTracker
        t = RequestTracker("w", recorder=sys.argv[1])
        async def one():
            async with t.request(route="/x") as req:
                await req.acquire()
        for _ in range(7):
            asyncio.run(one())
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "rec.db")], env=env, cwd=ROOT, check=True, timeout=60)
    with FlightRecorder(tmp_path / "rec.db") as rec:
        rows = [r for r in rec.read(["request"]) if isinstance(r, RequestTiming)]
    assert len(rows) == 7


@pytest.mark.process
def test_workers_stopped_right_after_their_requests_lose_no_row(tmp_path: Path) -> None:
    """SIGTERM to uvicorn at once after the last response: each worker's last rows are still in its buffer (it
    forwards once a second) and uvicorn ends the worker by re-raising the signal, so no ``atexit`` runs -- the
    rows are flushed at the lifespan's shutdown (measured before: 7 to 22 of 40 rows kept)."""
    with workers(tmp_path, 2) as (base, _proc):
        for _ in range(40):
            assert httpx.get(base + "/work?ms=1", headers={"connection": "close"}).status_code == 200
    with FlightRecorder(tmp_path / "rec.db") as rec:
        rows = [r for r in rec.read(["request"]) if isinstance(r, RequestTiming)]
    assert len(rows) == 40
