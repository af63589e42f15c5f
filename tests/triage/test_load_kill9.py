"""5 000 deliveries (30 % duplicates and retries) at concurrency 32 to a real ``diag triage serve``, which is
``kill -9``'d mid-run and restarted: 0 lost alerts, 0 duplicate incidents, 0 duplicate external tickets.

The client behaves like Alertmanager: a delivery is retried (connection error or 5xx) until it gets a 2xx;
a 4xx is a failure of the test. Tickets go to a local HTTP server speaking GitHub's issue endpoints (GitHub
itself cannot run here), which counts every create it receives.
"""

from __future__ import annotations

import queue
import sqlite3
import threading
import time
from collections import defaultdict

import httpx
import pytest

from tests.triage.helpers import FakeTracker, ReceiverProcess
from tests.triage.loadplan import CONCURRENCY, GROUPS, TOTAL, plan

pytestmark = pytest.mark.process


@pytest.mark.slow
def test_5000_deliveries_kill9_restart_nothing_lost_nothing_duplicated(tmp_path):
    deliveries, expected = plan()
    tracker = FakeTracker()
    args = ("--no-diagnosis", "--hold-down", "1h", "--github-repo", "acme/incidents", "--github-url", tracker.url)
    env = {"GITHUB_TOKEN": "test-token"}
    rx = ReceiverProcess(tmp_path / "triage.db", *args, env=env).start()
    work: queue.Queue[dict | None] = queue.Queue()
    for d in deliveries:
        work.put(d)
    acked = 0
    retries = 0
    client_errors: list[str] = []
    lock = threading.Lock()

    def worker() -> None:
        nonlocal acked, retries
        with httpx.Client(timeout=30.0) as client:
            while True:
                try:
                    doc = work.get_nowait()
                except queue.Empty:
                    return
                while True:
                    try:
                        r = client.post(f"{rx.url}/webhook", json=doc)
                    except httpx.TransportError:
                        r = None
                    if r is not None and r.status_code < 300:
                        with lock:
                            acked += 1
                        break
                    if r is not None and r.status_code < 500:
                        client_errors.append(f"{r.status_code} {r.text[:200]}")
                        break
                    with lock:
                        retries += 1
                    time.sleep(0.05)

    threads = [threading.Thread(target=worker) for _ in range(CONCURRENCY)]
    started = time.monotonic()
    try:
        for t in threads:
            t.start()
        while acked < TOTAL * 0.4:
            time.sleep(0.01)
        rx.kill9()
        killed_at = acked
        time.sleep(0.5)
        rx.start()
        for t in threads:
            t.join(timeout=300)
        assert not client_errors, client_errors[:5]
        assert acked == TOTAL and retries > 0 and 0 < killed_at < TOTAL

        delivered_s = time.monotonic() - started
        db = sqlite3.connect(rx.db)
        # the ticket side is hit by a kill -9 too, while it is busy creating
        while 0 < (created := tracker.creates()) < GROUPS // 2:
            time.sleep(0.02)
        rx.kill9()
        rx.start()
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and db.execute("SELECT COUNT(*) FROM outbox WHERE done_at IS NULL").fetchone()[0]:
            time.sleep(0.5)
        pending = db.execute("SELECT COUNT(*) FROM outbox WHERE done_at IS NULL").fetchone()[0]
        print(f"delivered {TOTAL} in {delivered_s:.1f}s ({retries} retries, killed at {killed_at}); tickets killed at {created}")

        rows = db.execute("SELECT id, key_labels, generation FROM incidents").fetchall()
        assert len(rows) == GROUPS, f"{len(rows)} incidents for {GROUPS} groups"
        assert {g for (_, _, g) in rows} == {1}
        stored: dict[str, set[str]] = defaultdict(set)
        for instance, fp in db.execute(
            "SELECT json_extract(i.key_labels, '$.instance'), a.fingerprint FROM alerts a"
            " JOIN incidents i ON i.id = a.incident_id"
        ):
            stored[instance].add(fp)
        lost = {k: v - stored[k] for k, v in expected.items() if v - stored[k]}
        assert not lost, f"lost alerts in {len(lost)} groups"
        assert pending == 0
        markers = [i["labels"][0] for i in tracker.gh_issues.values()]
        assert len(markers) == GROUPS and len(set(markers)) == GROUPS, "duplicate external tickets"
        tickets = db.execute("SELECT COUNT(*), COUNT(DISTINCT external_id) FROM tickets").fetchone()
        assert tickets == (GROUPS, GROUPS)
        assert all(a == "Bearer test-token" for a in tracker.auth)
        db.close()
    finally:
        rx.stop()
        tracker.close()
