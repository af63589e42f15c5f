"""The shipped HA example (collectors/deploy/alertmanager-triage-ha.yml), used verbatim but for its hosts, ports,
token path and timers: two real clustered Alertmanager 0.25 peers deliver every notification to two ``diag triage
serve`` receivers sharing one real PostgreSQL 15. Each problem is one incident with one ticket; with one receiver
killed, the other still files the next problem."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import psycopg
import pytest

from tests.pgserver import reset
from tests.procs import wait_for
from tests.triage.amcluster import AlertmanagerPair, binaries, ha_example
from tests.triage.helpers import FakeTracker, ReceiverProcess

pytestmark = [pytest.mark.process, pytest.mark.slow]

TOKEN = "ha-test-token"


def incidents(rx: ReceiverProcess, tag: str) -> list[dict[str, Any]]:
    rows = httpx.get(f"{rx.url}/api/incidents", timeout=10).json()
    return [r for r in rows if tag in r["title"]]


def test_the_shipped_ha_example_files_each_problem_once_and_survives_a_receiver(pg_server, tmp_path):
    binaries()
    reset(pg_server.url)
    tracker = FakeTracker()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    args = ("--no-diagnosis", "--github-repo", "acme/incidents", "--github-url", tracker.url, "--claim-lease", "5s")
    env = {"GITHUB_TOKEN": "gh", "LLMDIAG_TRIAGE_TOKEN": TOKEN}
    a = ReceiverProcess(pg_server.url, *args, env=env, log_dir=tmp_path).start()
    b = ReceiverProcess(pg_server.url, *args, env=env, log_dir=tmp_path).start()
    pair = None
    try:
        assert a.post({}).status_code == 401  # the receivers want the token the example's peers send
        pair = AlertmanagerPair(
            tmp_path, config_text=ha_example(a.url, b.url, str(token_file), group_wait="1s", group_interval="1s")
        )
        tag = uuid.uuid4().hex[:8]
        for instance in ("x", "y", "z"):
            pair.add({"alertname": f"HaLatency{tag}", "job": "llm", "instance": instance}, summary=f"latency {tag}")
        wait_for(lambda: len(incidents(a, tag)) == 3, "3 incidents")
        # every peer that delivers sends to both receivers: wait until at least 3 groups x 2 receivers arrived
        wait_for(lambda: sum(pair.notifications()) >= 6, "deliveries to both receivers")
        wait_for(lambda: tracker.creates() >= 3, "3 tickets")
        a.kill9()
        pair.add({"alertname": f"HaErrors{tag}", "job": "llm", "instance": "x"}, summary=f"errors {tag}")
        wait_for(lambda: len(incidents(b, tag)) == 4, "the 4th incident through the surviving receiver")
        wait_for(lambda: tracker.creates() >= 4, "its ticket")
        with psycopg.connect(pg_server.url, autocommit=True) as db:  # every ticket action sent: none can come later
            wait_for(lambda: db.execute("SELECT COUNT(*) FROM outbox WHERE done_at IS NULL").fetchone()[0] == 0, "outbox")
        rows = incidents(b, tag)
        assert len(rows) == 4 and all(r["generation"] == 1 for r in rows)
        markers = [i["labels"][0] for i in tracker.gh_issues.values()]
        assert tracker.creates() == 4 and len(set(markers)) == 4, "one ticket per incident"
    finally:
        if pair is not None:
            pair.stop()
        a.stop()
        b.stop()
        tracker.close()
