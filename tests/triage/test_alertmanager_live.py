"""Real Alertmanager 0.25 peers, alerts injected with ``amtool alert add`` into both, delivered to a real ``diag triage
serve``: one incident per alert group however many peers deliver it (a partitioned pair delivers everything twice),
resolve after the hold-down, reopen with a count (a clustered pair)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests import procs
from tests.triage.amcluster import AlertmanagerPair, binaries
from tests.triage.helpers import ReceiverProcess

pytestmark = pytest.mark.process

HOLD_DOWN_S = 3


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    binaries()
    folder = tmp_path_factory.mktemp("am")
    rx = ReceiverProcess(folder / "triage.db", "--no-diagnosis", "--hold-down", f"{HOLD_DOWN_S}s", "--reopen-window", "10m",
                         "--flap-threshold", "10").start()  # fmt: skip
    pair = None
    try:
        pair = AlertmanagerPair(folder, f"{rx.url}/webhook")
        yield rx, pair
    finally:
        if pair is not None:
            pair.stop()
        rx.stop()


def incidents(rx: ReceiverProcess, tag: str) -> list[dict[str, Any]]:
    rows = httpx.get(f"{rx.url}/api/incidents", timeout=10).json()
    return [r for r in rows if tag in r["title"]]


def wait_for(check: Callable[[], Any], timeout_s: float = 45.0, what: str = "") -> Any:
    return procs.wait_for(check, what or "the condition", timeout_s, every_s=0.3)


@pytest.fixture
def partitioned(stack, tmp_path):
    """Two peers that never gossip: each delivers every group, so the receiver surely gets every notification twice."""
    rx, _ = stack
    pair = AlertmanagerPair(tmp_path, f"{rx.url}/webhook", clustered=False)
    try:
        yield rx, pair
    finally:
        pair.stop()


def test_one_incident_per_alert_group_across_both_peers(partitioned):
    rx, pair = partitioned
    tag = uuid.uuid4().hex[:8]
    sent_before = pair.notifications()
    name = f"TriageLatency{tag}"
    pair.add({"alertname": name, "job": "llm", "instance": "a", "pod": "p1"}, summary=f"latency {tag}")
    pair.add({"alertname": name, "job": "llm", "instance": "a", "pod": "p2"}, summary=f"latency {tag}")
    pair.add({"alertname": name, "job": "llm", "instance": "b"}, summary=f"latency {tag}")
    pair.add({"alertname": f"TriageErrors{tag}", "job": "llm", "instance": "a"}, summary=f"errors {tag}")
    wait_for(lambda: len(incidents(rx, tag)) >= 3 and sum(r["alert_count"] for r in incidents(rx, tag)) >= 4, what="3 incidents")
    # Both unclustered peers deliver each of the 3 groups: once every copy has arrived, none may have made a 4th incident.
    wait_for(lambda: all(a - b >= 3 for a, b in zip(pair.notifications(), sent_before, strict=True)), what="every copy")
    rows = incidents(rx, tag)
    assert len(rows) == 3, rows
    by_instance = {(r["title"].split()[0], json_key(r)["instance"]): r for r in rows}
    assert by_instance[("latency", "a")]["alert_count"] == 2  # two alerts of one group: one incident, both fingerprints
    assert by_instance[("latency", "b")]["alert_count"] == 1
    assert by_instance[("errors", "a")]["alert_count"] == 1
    assert all(r["status"] == "open" for r in rows)
    sent = [after - before for after, before in zip(pair.notifications(), sent_before, strict=True)]
    assert all(n >= 3 for n in sent), f"each unclustered peer delivers each of the 3 groups: {sent}"


def json_key(row: dict[str, Any]) -> dict[str, str]:
    import json

    return json.loads(row["key_labels"])


def test_resolve_after_hold_down_then_reopen_with_count(stack):
    rx, pair = stack
    tag = uuid.uuid4().hex[:8]
    labels = {"alertname": f"TriageQueue{tag}", "job": "llm", "instance": "a"}
    start = time.time()
    pair.add(labels, start=start, summary=f"queue {tag}")
    (inc,) = wait_for(lambda: incidents(rx, tag), what="the incident")
    assert inc["status"] == "open"

    pair.add(labels, start=start, end=time.time(), summary=f"queue {tag}")
    wait_for(lambda: incidents(rx, tag)[0]["status"] in ("resolving", "resolved"), what="resolving")
    resolving_seen = time.monotonic()
    (inc,) = wait_for(lambda: [r for r in incidents(rx, tag) if r["status"] == "resolved"], what="resolved")
    assert time.monotonic() - resolving_seen >= HOLD_DOWN_S - 1.5  # not before the hold-down

    pair.add(labels, start=time.time(), summary=f"queue {tag}")  # fires again: Alertmanager gives it a new startsAt
    (inc,) = wait_for(lambda: [r for r in incidents(rx, tag) if r["status"] == "open"], what="reopen")
    assert inc["reopen_count"] == 1
    time.sleep(3)
    rows = incidents(rx, tag)
    assert len(rows) == 1 and rows[0]["reopen_count"] == 1  # the other peer's copy did not count twice
    detail = httpx.get(f"{rx.url}/api/incidents/{inc['id']}", timeout=10).json()
    kinds = [e["kind"] for e in detail["events"]]
    assert kinds[:4] == ["opened", "resolving", "resolved", "reopened"], kinds


@pytest.mark.slow
def test_two_tiers_of_one_slo_in_two_groups_are_one_incident(stack):
    rx, pair = stack
    tag = uuid.uuid4().hex[:8]
    slo = f"ttft-{tag}"
    pair.add({"alertname": "ErrorBudgetBurnFast", "slo": slo, "job": "llm", "severity": "page"}, summary=f"burn {tag}")
    pair.add({"alertname": "ErrorBudgetBurnSlow", "slo": slo, "job": "llm", "severity": "ticket"}, summary=f"burn {tag}")
    wait_for(lambda: incidents(rx, tag) and incidents(rx, tag)[0]["alert_count"] == 2, what="both tiers")
    time.sleep(2)
    rows = incidents(rx, tag)
    assert len(rows) == 1 and json_key(rows[0]) == {"slo": slo, "job": "llm"}
