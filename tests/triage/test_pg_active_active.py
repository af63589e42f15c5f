"""Two ``diag triage serve`` receivers active-active on one real PostgreSQL 15: 5 000 Alertmanager deliveries
(30 % duplicates) at concurrency 32, spread over both; one receiver is ``kill -9``'d and PostgreSQL is restarted
mid-run. 0 lost alerts, 0 duplicate incidents, 0 duplicate external tickets. Its wall time is printed, not
asserted (timing belongs in bench/triage.py --only stores): 58-187 s on the shared 2-core host it was written on.

The client behaves like Alertmanager behind a load balancer: a delivery goes to one receiver, and on a connection
error or a 5xx it is retried (to the other receiver first: the killed one is away for a while) until a 2xx; a 4xx
fails the test. Both receivers file tickets into one local HTTP server speaking GitHub's issue endpoints
(GitHub itself cannot run here), which counts every create it receives: two receivers racing for one incident's
create must send it once.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import defaultdict

import httpx
import psycopg
import pytest

from tests.pgserver import reset
from tests.triage.helpers import FakeTracker, ReceiverProcess
from tests.triage.loadplan import CONCURRENCY, GROUPS, TOTAL, plan

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.live]

CLAIM_LEASE = "5s"  # a killed receiver's claimed ticket actions are taken over this long after
GIVE_UP_S = 240.0  # a delivery unacknowledged this long fails the test rather than hanging it


def _deliver(receivers: list[ReceiverProcess], deliveries: list[dict], on_progress) -> tuple[int, int, list[str]]:
    """Send every delivery until it is acknowledged; returns (acked, retries, client errors)."""
    work: queue.Queue[tuple[int, dict]] = queue.Queue()
    for i, d in enumerate(deliveries):
        work.put((i, d))
    acked = retries = 0
    errors: list[str] = []
    lock = threading.Lock()

    def worker() -> None:
        nonlocal acked, retries
        with httpx.Client(timeout=30.0, trust_env=False) as client:
            while True:
                try:
                    i, doc = work.get_nowait()
                except queue.Empty:
                    return
                target = i % len(receivers)
                give_up = time.monotonic() + GIVE_UP_S  # per delivery: a slow host makes the whole run long, not one
                while True:
                    try:
                        r = client.post(f"{receivers[target].url}/webhook", json=doc)
                    except httpx.TransportError:
                        r = None
                    if r is not None and r.status_code < 300:
                        with lock:
                            acked += 1
                            on_progress(acked)
                        break
                    if r is not None and r.status_code < 500:
                        errors.append(f"{r.status_code} {r.text[:200]}")
                        break
                    with lock:
                        retries += 1
                    if time.monotonic() > give_up:
                        errors.append(f"delivery {i} not acknowledged within {GIVE_UP_S:.0f}s (last: {r and r.status_code})")
                        break
                    target = (target + 1) % len(receivers)
                    time.sleep(0.05)

    threads = [threading.Thread(target=worker) for _ in range(CONCURRENCY)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return acked, retries, errors


@pytest.mark.host_quiet(
    reason="receivers (--no-diagnosis) and PostgreSQL killed and restarted: CPU and sockets only, counts of alerts and tickets"
)
def test_two_receivers_on_one_postgres_kill9_and_a_database_restart_lose_and_duplicate_nothing(pg_server, tmp_path):
    reset(pg_server.url)
    deliveries, expected = plan()
    tracker = FakeTracker()
    args = ("--no-diagnosis", "--hold-down", "1h", "--github-repo", "acme/incidents", "--github-url", tracker.url,
            "--claim-lease", CLAIM_LEASE)  # fmt: skip
    env = {"GITHUB_TOKEN": "test-token"}
    a = ReceiverProcess(pg_server.url, *args, env=env, log_dir=tmp_path).start()
    b = ReceiverProcess(pg_server.url, *args, env=env, log_dir=tmp_path).start()
    events: dict[str, int] = {}
    chaos = threading.Event()

    def on_progress(acked: int) -> None:  # called under the client's lock: each mark is taken once
        if acked == int(TOTAL * 0.3) and "killed" not in events:
            events["killed"] = acked
            chaos.set()
        if acked == int(TOTAL * 0.6) and "pg_restart" not in events:
            events["pg_restart"] = acked
            chaos.set()

    def run_chaos() -> None:
        """The faults, off the client's threads: kill -9 one receiver (restarted 2 s later), restart PostgreSQL."""
        chaos.wait()
        chaos.clear()
        a.kill9()
        time.sleep(2.0)  # the other receiver alone takes every delivery meanwhile
        a.start()
        chaos.wait(timeout=120)
        pg_server.restart()

    faults = threading.Thread(target=run_chaos)
    started = time.monotonic()
    try:
        faults.start()
        acked, retries, client_errors = _deliver([a, b], deliveries, on_progress)
        delivered_s = time.monotonic() - started
        faults.join(timeout=120)
        assert not client_errors, client_errors[:5]
        assert acked == TOTAL and retries > 0 and set(events) == {"killed", "pg_restart"}, events

        with psycopg.connect(pg_server.url, autocommit=True) as db:
            deadline = time.monotonic() + 60
            pending = None
            while time.monotonic() < deadline:
                pending = db.execute("SELECT COUNT(*) FROM outbox WHERE done_at IS NULL").fetchone()[0]
                if pending == 0:
                    break
                time.sleep(0.5)
            wall_s = time.monotonic() - started
            print(
                f"delivered {TOTAL} to 2 receivers in {delivered_s:.1f}s ({retries} retries; receiver killed at "
                f"{events['killed']}, PostgreSQL restarted at {events['pg_restart']}); all tickets in {wall_s:.1f}s"
            )
            assert pending == 0

            rows = db.execute("SELECT id, key_labels, generation FROM incidents").fetchall()
            assert len(rows) == GROUPS, f"{len(rows)} incidents for {GROUPS} groups"
            assert {g for (_, _, g) in rows} == {1}
            stored: dict[str, set[str]] = defaultdict(set)
            for labels, fp in db.execute(
                "SELECT i.key_labels, a.fingerprint FROM alerts a JOIN incidents i ON i.id = a.incident_id"
            ):
                stored[json.loads(labels)["instance"]].add(fp)
            lost = {k: v - stored[k] for k, v in expected.items() if v - stored[k]}
            assert not lost, f"lost alerts in {len(lost)} groups"
            markers = [i["labels"][0] for i in tracker.gh_issues.values()]
            assert len(set(markers)) == GROUPS and len(markers) == GROUPS, "duplicate external tickets"
            assert tracker.creates() == GROUPS
            tickets = db.execute("SELECT COUNT(*), COUNT(DISTINCT external_id) FROM tickets").fetchone()
            assert tickets == (GROUPS, GROUPS)
    finally:
        chaos.set()
        a.stop()
        b.stop()
        tracker.close()
