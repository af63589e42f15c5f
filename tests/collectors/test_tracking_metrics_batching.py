"""Multiprocess mode: the per-request values are batched in memory and flushed to prometheus_client's shared files.

What the batching promises (``collectors/tracking/series.py``): nothing of a request reaches the shared files
before a flush; after one, the files hold exactly what prometheus_client's own per-observation writes would
(counts, buckets, sums, the gauges' levels), and a second flush adds only what came since; the flusher thread
writes without being asked; a normal interpreter exit flushes; a forked child does not write its parent's
pending values a second time.

Each case runs in a fresh interpreter with ``PROMETHEUS_MULTIPROC_DIR`` set in its environment (prometheus_client
reads it at import), and reads the shared files with ``MultiProcessCollector``, as a scrape of any worker does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from collectors import catalog

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = """
import json, os, sys
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from collectors.tracking import series
series.FLUSH_INTERVAL_S = float(os.environ["FLUSH_S"])  # read by the flusher at every wait
from collectors.tracking import RequestTracker
from collectors.tracking.metrics import flush_metrics
t = RequestTracker("m", recorder=False, registry=CollectorRegistry())
s = t.recording.series_for("/x")

def shared():
    reg = CollectorRegistry()
    MultiProcessCollector(reg)
    return generate_latest(reg).decode()

def emit(label):
    print(json.dumps({label: shared()}), flush=True)
"""


def _run(tmp_path: Path, body: str, flush_s: float = 3600.0) -> dict[str, str]:
    prom = tmp_path / "prom"
    prom.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PROMETHEUS_MULTIPROC_DIR": str(prom), "FLUSH_S": str(flush_s)}
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    out = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-3000:]
    found: dict[str, str] = {}
    for line in out.stdout.splitlines():
        found.update(json.loads(line))
    return found


def _files_now(tmp_path: Path) -> str:
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(tmp_path / "prom"))
    return generate_latest(reg).decode()


def _value(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


@pytest.mark.process
def test_values_reach_the_shared_files_at_a_flush_and_only_once(tmp_path: Path) -> None:
    got = _run(
        tmp_path,
        """
        for _ in range(3): s.started()
        s.finished("ok", True, 0.0004, 0.3, 0.3004, 0.05)     # queue wait in the 0.0005 bucket
        s.finished("error", True, 0.002, 200.0, 200.002, None)  # inference past the last bound: +Inf
        s.queued(); s.rejected("queue_full")
        emit("before")
        flush_metrics()
        emit("first")
        s.finished("ok", True, 0.0004, 0.3, 0.3004, None)
        flush_metrics()
        flush_metrics()  # nothing new: adds nothing
        emit("second")
        """,
    )
    before, first, second = got["before"], got["first"], got["second"]
    assert _value(before, catalog.REQUESTS.name) == 0
    assert _value(before, catalog.REQUEST_E2E.name + "_count") == 0

    assert _value(first, catalog.REQUESTS.name, outcome="ok") == 1
    assert _value(first, catalog.REQUESTS.name, outcome="error") == 1
    assert _value(first, catalog.ADMISSION_REJECTIONS.name, reason="queue_full") == 1
    wait = catalog.REQUEST_QUEUE_WAIT.name
    assert _value(first, wait + "_bucket", le="0.0005") == 1  # cumulative: only the 0.0004 wait
    assert _value(first, wait + "_count") == 2
    assert abs(_value(first, wait + "_sum") - 0.0024) < 1e-12
    inference = catalog.REQUEST_INFERENCE.name
    assert _value(first, inference + "_bucket", le="+Inf") == 2
    assert _value(first, inference + "_count") == 2
    assert abs(_value(first, inference + "_sum") - 200.3) < 1e-9
    assert _value(first, catalog.REQUEST_TTFT.name + "_count") == 1
    assert _value(first, catalog.ACTIVE_INFERENCES.name) == 1  # 3 started, 2 released
    assert _value(first, catalog.QUEUE_DEPTH.name) == 1

    assert _value(second, catalog.REQUESTS.name, outcome="ok") == 2
    assert _value(second, catalog.REQUEST_E2E.name + "_count") == 3
    assert _value(second, wait + "_bucket", le="0.0005") == 2
    assert _value(second, catalog.ACTIVE_INFERENCES.name) == 0


@pytest.mark.process
def test_the_flusher_thread_writes_without_being_asked(tmp_path: Path) -> None:
    got = _run(
        tmp_path,
        """
        import time
        for _ in range(4): s.finished("ok", False, 0.01, 0.1, 0.11, None)
        deadline = time.monotonic() + 30
        while 'llmdiag_requests_total{model="m",outcome="ok",route="/x"} 4.0' not in shared():
            assert time.monotonic() < deadline, "nothing flushed within 30 s"
            time.sleep(0.02)
        emit("flushed")
        """,
        flush_s=0.05,
    )
    assert _value(got["flushed"], catalog.REQUESTS.name, outcome="ok") == 4


@pytest.mark.process
def test_a_normal_exit_flushes(tmp_path: Path) -> None:
    _run(tmp_path, """for _ in range(5): s.finished("ok", False, 0.01, 0.1, 0.11, None)""")  # no flush, no close
    text = _files_now(tmp_path)
    assert _value(text, catalog.REQUESTS.name, outcome="ok") == 5
    assert _value(text, catalog.REQUEST_E2E.name + "_count") == 5


@pytest.mark.process
def test_a_forked_child_does_not_write_its_parents_pending_values(tmp_path: Path) -> None:
    _run(
        tmp_path,
        """
        for _ in range(5): s.finished("ok", False, 0.01, 0.1, 0.11, None)   # pending in the parent
        pid = os.fork()
        if pid == 0:
            s.finished("ok", False, 0.01, 0.1, 0.11, None)   # the child's own request
            flush_metrics()
            os._exit(0)
        os.waitpid(pid, 0)
        flush_metrics()
        """,
    )
    text = _files_now(tmp_path)
    assert _value(text, catalog.REQUESTS.name, outcome="ok") == 6  # 5 of the parent's + 1 of the child's
