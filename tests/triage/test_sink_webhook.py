"""The generic JSON webhook sink against a receiving end that checks the documented body (``llmdiag.ticket.v1``,
``tests/triage/wire_webhook.py``): one POST per action with the incident's id, key, marker as ``dedup_key``,
title, text, labels, severity, class and links; an ``Idempotency-Key`` that is the same on every retry of one
action (so the receiving end applies it once) and different between actions; the bearer token."""

from __future__ import annotations

import json
import time

import pytest

from diag.triage.outbox import Dispatcher, marker
from diag.triage.sinks import Notice, WebhookSink
from diag.triage.sinks.webhook import SCHEMA, payload
from tests.triage.helpers import REPO
from tests.triage.ticketkit import LABELS, drain, fire, outbox, resolve, store, wait_until
from tests.triage.wire_webhook import FIELDS, WebhookReceiver


@pytest.fixture
def hook():
    server = WebhookReceiver(token="hook-token")
    yield server
    server.close()


@pytest.mark.process
def test_one_post_per_action_with_the_documented_body(tmp_path, hook):
    db, policy, path = store(tmp_path, ("webhook",))
    sink = WebhookSink(f"{hook.url}{hook.path}", "hook-token")
    d = Dispatcher(path, {"webhook": sink}, page_url="http://t.local", start=False)
    fire(db, policy, 100.0, summary="KV cache full", runbook_url="https://runbooks.test/kv", severity="page")
    drain(d)
    resolve(db, policy, 100.0, 200.0)
    drain(d)
    fire(db, policy, 300.0)
    drain(d)
    mark = marker(db.execute("SELECT * FROM incidents").fetchone())
    assert [b["action"] for b in hook.applied] == ["create", "close", "reopen"]
    create = hook.applied[0]
    assert create["dedup_key"] == mark and {b["dedup_key"] for b in hook.applied} == {mark}
    assert create["incident_id"] == 1 and create["generation"] == 1 and create["labels"] == LABELS
    assert create["title"].startswith("[llm-diag] KV cache full") and "alertname=KVCachePressure" in create["text"]
    assert create["links"] == {"incident": "http://t.local/incidents/1", "source": "http://127.0.0.1:9090/graph?g0.expr=up",
                               "runbook": "https://runbooks.test/kv"}  # fmt: skip
    assert create["diagnosis_state"] == "pending" and create["class"] is None
    assert "Resolved" in hook.applied[1]["text"] and hook.applied[1]["status"] == "resolved"
    keys = [r.headers["idempotency-key"] for r in hook.requests]
    assert len(set(keys)) == 3 and all(k.startswith(mark + "/") for k in keys)
    assert all(r.headers["authorization"] == "Bearer hook-token" for r in hook.requests)
    assert db.execute("SELECT external_id, url FROM tickets").fetchone()[:] == ("INC0000001", "https://itsm.test/incident/1")
    d.close()
    db.close()


@pytest.mark.process
def test_a_retry_carries_the_same_idempotency_key(tmp_path, hook):
    hook.fail(503, times=2)
    db, policy, path = store(tmp_path, ("webhook",))
    d = Dispatcher(path, {"webhook": WebhookSink(f"{hook.url}{hook.path}", "hook-token")}, base_backoff_s=0.01)
    try:
        fire(db, policy, time.time())
        wait_until(lambda: hook.applied)
        keys = {r.headers["idempotency-key"] for r in hook.requests}
        assert len(hook.requests) == 3 and len(keys) == 1
        assert wait_until(lambda: outbox(db)[0]["done_at"])
    finally:
        d.close()
        db.close()


def test_the_url_must_be_http():
    with pytest.raises(ValueError, match="--ticket-webhook-url"):
        WebhookSink("ftp://bridge.test/x")


def test_the_readme_documents_exactly_the_body_that_is_sent():
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("**The webhook body**") :]
    documented = json.loads(section[section.index("```json") + 7 : section.index("```", section.index("```json") + 7)])
    notice = Notice("create", "llmdiag-k-g1", "t", (), {"id": 1, "labels": {}}, {}, "k")
    assert set(documented) == set(payload(notice)) == FIELDS
    assert documented["schema"] == SCHEMA
