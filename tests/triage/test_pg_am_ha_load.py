"""The whole HA path under load and faults: alerts posted to two real clustered Alertmanager peers (the shipped
``collectors/deploy/alertmanager-triage-ha.yml``, hosts, token path and route timers rewritten), both peers
routed to two ``diag triage serve`` receivers sharing one real PostgreSQL 15; one receiver ``kill -9``'d and
PostgreSQL restarted mid-run. Every delivery the receivers see comes from Alertmanager -- its own concurrency,
its own retries -- and every problem must end as exactly one incident with exactly one ticket created at a
wire-level GitHub server (``tests/triage/wire_github.py``); nothing posted may be lost.

Why the example's ``group_by: [alertname, job, instance]`` is kept: every problem has its own ``instance``, so
each alert is its own Alertmanager group (what ``group_by: ['...']`` would give) *and* its own incident key.

Volume: each problem is delivered by every peer that does not hear in time that another did (the pair's
``--cluster.peer-timeout`` is 10 ms, so often both), to both receivers, and again every ``repeat_interval`` while
it fires. The deliveries are counted as Alertmanager reports them acknowledged (``notification_requests_total``
minus ``notification_requests_failed_total`` of the webhook integration, both peers); the store's own
``deliveries`` count is printed beside it: lower when a receiver answers byte-identical repeats from its digest
cache without a write, higher when deliveries committed after Alertmanager gave up on them are sent again.
``PROBLEMS`` (500 tickets) rather than ``TOTAL / 2`` (2 500) keeps the wall time near 2 minutes on the shared
2-core host; the repeats make up the volume. Measured (wall time printed, not asserted): 118 s at load 18-23 --
5 075 deliveries acknowledged (2 696 written), 90 % of them of a problem delivered before, the peers reporting
2 118 failed notifications and 10 068 failed requests, 500 incidents, 500 creates at the ticket server; 406 s
with the fast test tier running beside it (load 25-30).

The alerts are posted in batches while at most ``WINDOW`` posted problems have no incident yet: posting 2 500 at
once made every group flush in the same second, and under that wave the receivers' queues outgrew Alertmanager's
10 s notification deadline (a test of backlog, not of the HA path).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from typing import Any

import psycopg
import pytest

from tests import procs
from tests.pgserver import PgServer, reset
from tests.triage.amcluster import AlertmanagerPair, binaries, ha_example, iso
from tests.triage.helpers import ReceiverProcess
from tests.triage.loadplan import DUPLICATE_SHARE, TOTAL
from tests.triage.wire_github import GitHub

pytestmark = [pytest.mark.process, pytest.mark.slow]

PROBLEMS = 500
BATCH = 16  # alerts per POST /api/v2/alerts (a Prometheus evaluation's worth)
WINDOW = 64  # posted problems without an incident yet: how far the alerts run ahead of the receivers
# group_wait 30s / group_interval 5m / repeat_interval 4h are the example's pacing for people; here they would only
# stretch the run (repeat_interval: the volume comes from re-notifying firing problems). The group interval also
# bounds one flush's retries (Alertmanager gives a flush max(group_interval, 10 s)), so a receiver down longer
# than that shows as a failed notification, retried at a later flush.
TIMERS = {"group_wait": "1s", "group_interval": "1s", "repeat_interval": "10s"}
FLUSH_DEADLINE_S = 10.0  # Alertmanager's notify.MinTimeout: a flush's retries end this long after it starts
TOKEN = "ha-load-token"
CLAIM_LEASE = "5s"
DEADLINE_S = 900.0  # a run that stalls fails rather than hangs


def delivered(pair: AlertmanagerPair) -> int:
    """Webhook requests Alertmanager saw acknowledged (2xx), both peers and both receivers together: requests minus
    failed requests, both counted once a request has ended. (``notifications_total`` is counted when a flush
    starts and its failure when the flush ends, so notifications minus failures is not a count: it falls.)"""
    sent = sum(pair.counter("alertmanager_notification_requests_total"))
    return int(sent - sum(pair.counter("alertmanager_notification_requests_failed_total")))


class Progress:
    """The store's own counts, read on a connection that survives the PostgreSQL restart (None while it is away)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn: psycopg.Connection[Any] | None = None

    def read(self) -> tuple[int, int, int] | None:
        """(committed deliveries, incidents, undone ticket actions)."""
        try:
            if self.conn is None or self.conn.closed:
                self.conn = psycopg.connect(self.url, autocommit=True, connect_timeout=2)
            row = self.conn.execute(
                "SELECT COALESCE((SELECT value FROM stats WHERE name = 'deliveries'), 0),"
                " (SELECT COUNT(*) FROM incidents), (SELECT COUNT(*) FROM outbox WHERE done_at IS NULL)"
            ).fetchone()
            return int(row[0]), int(row[1]), int(row[2])
        except psycopg.Error:
            self.close()
            return None

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(psycopg.Error):
                self.conn.close()
        self.conn = None


def wait_for(check, what: str, deadline: float) -> Any:
    """``tests.procs.wait_for`` against the run's one deadline."""
    return procs.wait_for(check, what, max(0.0, deadline - time.monotonic()))


def failed(pair: AlertmanagerPair) -> tuple[float, float]:
    """(failed notifications, failed webhook requests) summed over both peers."""
    return sum(pair.counter("alertmanager_notifications_failed_total")), sum(
        pair.counter("alertmanager_notification_requests_failed_total")
    )


def chaos(pg: PgServer, a: ReceiverProcess, pair: AlertmanagerPair, deadline: float, events: dict[str, Any]) -> None:
    """Progress marks are (seconds, acknowledged deliveries, (store deliveries, incidents, undone ticket actions)).
    kill -9 receiver A at 30 % of the deliveries; restart it once Alertmanager has given up a flush on it (so
    the redelivery to it is Alertmanager's next-flush retry, not an in-flush one); restart PostgreSQL at 60 %."""
    progress = Progress(pg.url)
    t0 = time.monotonic()
    try:
        wait_for(lambda: delivered(pair) >= TOTAL * 0.3, "30 % of the deliveries", deadline)
        before = failed(pair)[0]
        a.kill9()
        events["killed_at"] = (round(time.monotonic() - t0, 1), delivered(pair), progress.read())
        # Alertmanager's metrics do not name the URL, so "a flush gave up on A" is read as: failed notifications
        # rose after the kill and the flush deadline (10 s) passed since it -- only then is A started again
        killed = time.monotonic()
        wait_for(lambda: failed(pair)[0] > before and time.monotonic() - killed > FLUSH_DEADLINE_S, "a failed flush", deadline)
        events["restarting_at"] = (round(time.monotonic() - t0, 1), delivered(pair), progress.read())
        a.start(timeout_s=120)
        events["restarted_at"] = (round(time.monotonic() - t0, 1), delivered(pair), progress.read())
        wait_for(lambda: delivered(pair) >= TOTAL * 0.6, "60 % of the deliveries", deadline)
        events["pg_restart_at"] = (round(time.monotonic() - t0, 1), delivered(pair), progress.read())
        progress.close()
        pg.restart()
        events["pg_back_at"] = round(time.monotonic() - t0, 1)
    except BaseException as exc:  # reported by the test thread
        events["error"] = repr(exc)
    finally:
        progress.close()


def test_alertmanager_ha_pair_to_two_receivers_on_postgres_kill9_and_restart_lose_and_duplicate_nothing(pg_server, tmp_path):
    binaries()
    reset(pg_server.url)
    github = GitHub()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    args = ("--no-diagnosis", "--hold-down", "1h", "--github-repo", github.repo, "--github-url", github.url,
            "--claim-lease", CLAIM_LEASE)  # fmt: skip
    env = {"GITHUB_TOKEN": github.token, "LLMDIAG_TRIAGE_TOKEN": TOKEN}
    a = ReceiverProcess(pg_server.url, *args, env=env, log_dir=tmp_path).start()
    b = ReceiverProcess(pg_server.url, *args, env=env, log_dir=tmp_path).start()
    pair = None
    progress = Progress(pg_server.url)
    events: dict[str, Any] = {}
    now = time.time()
    alerts = [
        {
            "labels": {"alertname": "HaLoad", "job": "llm", "instance": f"node-{i}"},
            "annotations": {"summary": f"load {i}"},
            "startsAt": iso(now),
            "endsAt": iso(now + 3600),
        }
        for i in range(PROBLEMS)
    ]  # endsAt explicit: no alert may resolve (a resolved notification) on a slow run
    started = time.monotonic()
    deadline = started + DEADLINE_S
    faults = None
    try:
        # the peer timeout is amcluster's 10 ms: both peers often deliver a group
        pair = AlertmanagerPair(tmp_path, config_text=ha_example(a.url, b.url, str(token_file), **TIMERS))
        faults = threading.Thread(target=chaos, args=(pg_server, a, pair, deadline, events), daemon=True)
        faults.start()
        posted = 0
        while posted < PROBLEMS:
            p = wait_for(progress.read, "the store", deadline)
            if posted - p[1] < WINDOW:
                pair.post(alerts[posted : posted + BATCH])
                posted += BATCH
            else:
                time.sleep(0.1)
            assert time.monotonic() < deadline and "error" not in events, events
        posted_s = time.monotonic() - started

        def done() -> bool:
            assert "error" not in events, events
            p = progress.read()
            return p is not None and p[1] == PROBLEMS and "pg_back_at" in events and delivered(pair) >= TOTAL

        wait_for(done, f"{PROBLEMS} incidents and {TOTAL} deliveries", deadline)
        faults.join(timeout=60)
        assert "error" not in events, events
        wait_for(lambda: (p := progress.read()) and p[2] == 0, "every ticket action sent", deadline)
        wall_s = time.monotonic() - started
        stored, _, _ = progress.read() or (0, 0, 0)
        deliveries = delivered(pair)
        notifications_failed, requests_failed = failed(pair)
        sent = pair.notifications()
        print(
            f"\n{PROBLEMS} problems posted in {posted_s:.1f}s; {deliveries} deliveries acknowledged ({stored} written), "
            f"all filed in {wall_s:.1f}s; faults: {events}; Alertmanager "
            f"notifications per peer {sent}, failed notifications {notifications_failed:.0f}, failed requests "
            f"{requests_failed:.0f}"
        )

        # volume: at least TOTAL deliveries acknowledged, at least DUPLICATE_SHARE of them of a problem seen before
        assert deliveries >= TOTAL and (deliveries - PROBLEMS) / deliveries >= DUPLICATE_SHARE, deliveries
        # Alertmanager's retries happened: a flush gave up on the killed receiver, requests failed and were redone
        assert notifications_failed > 0 and requests_failed > 0
        assert all(n > 0 for n in sent), sent

        with psycopg.connect(pg_server.url, autocommit=True) as db:
            rows = db.execute("SELECT key_labels::json->>'instance', generation FROM incidents").fetchall()
            per_problem = Counter(instance for instance, _ in rows)
            wanted = {x["labels"]["instance"] for x in alerts}
            assert set(per_problem) == wanted, f"lost: {sorted(wanted - set(per_problem))[:5]}"
            assert per_problem.most_common(1)[0][1] == 1 and {g for _, g in rows} == {1}, "duplicate incidents"
            stored = db.execute("SELECT COUNT(DISTINCT fingerprint) FROM alerts").fetchone()[0]
            assert stored == PROBLEMS
            tickets = db.execute("SELECT COUNT(*), COUNT(DISTINCT external_id) FROM tickets").fetchone()
            assert tickets == (PROBLEMS, PROBLEMS)
        creates = [r for r in github.seen("POST") if r.path == f"/repos/{github.repo}/issues"]
        markers = Counter(i["labels"][0]["name"] for i in github.issues.values())
        assert len(creates) == PROBLEMS and len(markers) == PROBLEMS, "duplicate external tickets"
    finally:
        if faults is not None:
            faults.join(timeout=60)
        progress.close()
        if pair is not None:
            pair.stop()
        a.stop()
        b.stop()
        github.close()
