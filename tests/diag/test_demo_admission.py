"""Admission on the real demo server: a queue that grows behind one slot, 429s at a full queue, the memory guard.

Real server subprocess on loopback (see test_demo_serve.py); figures come from the flight recorder
(``RequestTiming``) and ``/metrics``, the same evidence the diagnosis rules read.
"""

from __future__ import annotations

import collections
import statistics
import time
from pathlib import Path

import httpx
import pytest

from collectors import catalog
from collectors.recorder import FlightRecorder
from collectors.records import RequestTiming
from diag.demo.harness import post_all, sample_sum, scrape, start_demo

pytestmark = pytest.mark.process

RID = catalog.REQUESTS.name
REJECTIONS = catalog.ADMISSION_REJECTIONS.name


@pytest.fixture(scope="module")
def wdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("weights")


def _timings(path: Path) -> list[RequestTiming]:
    with FlightRecorder(path, readonly=True) as fr:
        return [r for r in fr.read(["request"]) if isinstance(r, RequestTiming)]


def test_one_slot_queue_wait_grows_with_load_while_inference_stays_flat(tmp_path: Path, wdir: Path) -> None:
    rec = tmp_path / "rec.db"
    srv = start_demo(
        ["--max-concurrency", "1", "--queue-size", "64", "--queue-timeout", "120"],
        weights_mb=16,
        weights_dir=wdir,
        log_dir=tmp_path,
        recorder=rec,
    )
    body = {"prompt": "a fairly ordinary prompt " * 12, "max_tokens": 24}
    try:
        post_all(srv.url, [body] * 2)  # warm-up
        t1 = time.time()
        one = post_all(srv.url, [body] * 10, concurrency=1)
        t8 = time.time()
        eight = post_all(srv.url, [body] * 32, concurrency=8)
    finally:
        srv.stop()
    assert {r.status_code for r in one + eight} == {200}

    rows = _timings(rec)
    phase1 = [r for r in rows if t1 <= r.arrival < t8]
    phase8 = [r for r in rows if r.arrival >= t8]
    assert (len(phase1), len(phase8)) == (10, 32)
    q1 = statistics.median(r.queue_wait_s or 0.0 for r in phase1)
    i1 = statistics.median(r.inference_s or 0.0 for r in phase1)
    q8 = statistics.median(r.queue_wait_s or 0.0 for r in phase8)
    i8 = statistics.median(r.inference_s or 0.0 for r in phase8)
    print(f"1 client: queue {q1 * 1e3:.1f} ms, inference {i1 * 1e3:.1f} ms; 8 clients: queue {q8 * 1e3:.1f} ms, "
          f"inference {i8 * 1e3:.1f} ms")  # fmt: skip
    assert q1 < i1  # alone, a request barely waits
    assert q8 > 2 * i8  # eight clients, one slot: latency is waiting, not working
    assert q8 > 5 * q1
    assert i8 < 3 * i1  # ...and each inference is about as fast as before (a backlog, not thrashing)


def test_full_queue_answers_429_and_counts_each_request_once(tmp_path: Path, wdir: Path) -> None:
    rec = tmp_path / "rec.db"
    srv = start_demo(
        ["--max-concurrency", "1", "--queue-size", "2", "--queue-timeout", "120"],
        weights_mb=16,
        weights_dir=wdir,
        log_dir=tmp_path,
        recorder=rec,
    )
    n = 24
    try:
        responses = post_all(srv.url, [{"prompt": "q" * 600, "max_tokens": 48}] * n, concurrency=n)
        metrics = scrape(srv.url)
    finally:
        srv.stop()
    statuses = collections.Counter(r.status_code for r in responses)
    assert set(statuses) == {200, 429} and statuses[429] >= 1
    for r in responses:
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"] == "queue_full"

    assert sample_sum(metrics, RID) == n
    assert sample_sum(metrics, RID, outcome="rejected") == statuses[429]
    assert sample_sum(metrics, RID, outcome="ok") == statuses[200]
    assert sample_sum(metrics, REJECTIONS, reason="queue_full") == statuses[429]

    rows = _timings(rec)
    assert len(rows) == n
    assert collections.Counter(r.outcome for r in rows) == {"ok": statuses[200], "rejected": statuses[429]}
    assert all(r.start is None for r in rows if r.outcome == "rejected")
    assert all(r.start is not None and r.output_tokens == 48 for r in rows if r.outcome == "ok")


def test_tiny_memory_guard_refuses_with_503_and_degrades_health(tmp_path: Path, wdir: Path) -> None:
    rec = tmp_path / "rec.db"
    srv = start_demo(["--memory-guard", "0.0001"], weights_mb=16, weights_dir=wdir, log_dir=tmp_path, recorder=rec)
    try:
        health = httpx.get(srv.url + "/healthz", timeout=5)
        responses = post_all(srv.url, [{"prompt": "hello", "max_tokens": 4}] * 3)
        metrics = scrape(srv.url)
    finally:
        srv.stop()
    assert health.status_code == 503
    assert health.json()["status"] == "degraded" and "memory_watermark" in health.json()["reasons"]
    assert [r.status_code for r in responses] == [503] * 3
    assert all(int(r.headers["Retry-After"]) >= 1 for r in responses)
    assert sample_sum(metrics, REJECTIONS, reason="memory_watermark") == 3
    assert [r.outcome for r in _timings(rec)] == ["rejected"] * 3
