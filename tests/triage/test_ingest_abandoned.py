"""The group-commit writer skips a delivery whose sender was already answered 503 (its commit deadline passed).

Why it matters: Alertmanager retries a 503 or a timed-out request. If the writer still applied the abandoned one
when it got to it, a receiver that fell behind would apply every timed-out delivery *and* its retry, so the
queue would grow with the very retries meant to relieve it.
"""

from __future__ import annotations

import json
import threading

import pytest

from diag.triage import payload
from diag.triage.ingest import Ingestor, Unavailable
from diag.triage.lifecycle import Policy
from diag.triage.store import connect
from tests.triage.helpers import alert, body


def note(instance: str) -> payload.Notification:
    doc = body(alert({"alertname": "Abandoned", "job": "llm", "instance": instance}))
    return payload.parse(json.dumps(doc).encode())


def test_a_delivery_answered_503_is_not_applied_later_and_its_retry_is(tmp_path):
    gate = threading.Event()
    blocked = threading.Event()

    def hold_after_first_commit() -> None:  # the writer, stuck after a batch: what a slow store looks like
        if not blocked.is_set():
            blocked.set()
            assert gate.wait(30)

    ingestor = Ingestor(tmp_path / "t.db", Policy(), on_commit=hold_after_first_commit)
    try:
        assert ingestor.submit(note("a")) == ["opened"]
        assert blocked.wait(10)
        with pytest.raises(Unavailable):
            ingestor.submit(note("b"), timeout_s=0.2)  # the writer is stuck: the sender is told 503
        gate.set()
        assert ingestor.submit(note("c")) == ["opened"]  # queued behind "b": "b" was skipped before it
        assert ingestor.submit(note("b")) == ["opened"]  # the retry of "b" opens its incident, once
    finally:
        gate.set()
        ingestor.close()
    db = connect(tmp_path / "t.db")
    try:
        instances = [json.loads(r[0])["instance"] for r in db.execute("SELECT key_labels FROM incidents ORDER BY id")]
        assert instances == ["a", "c", "b"]
        assert db.execute("SELECT value FROM stats WHERE name = 'deliveries'").fetchone()[0] == 3
    finally:
        db.close()
