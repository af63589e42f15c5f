"""The generated Alertmanager routes deliver to paths the receiver serves: a real Alertmanager 0.25, a sink
that serves exactly the receiver's paths (tests/alerts/livestack.py) and answers any other 404, as
``diag triage serve`` does. Alertmanager drops a 4xx without retrying, so this is the difference between
an alert delivered and an alert lost; ``amtool check-config`` accepts both configs.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from alerts.alertmanager import alertmanager_config
from alerts.generate import dump_yaml
from alerts.spec import DEFAULT_SPEC_PATH, parse_spec
from tests.alerts import livestack

pytestmark = pytest.mark.process


def _config(sink: livestack.Sink) -> str:
    doc = yaml.safe_load(DEFAULT_SPEC_PATH.read_text())
    doc["routing"] = {"receiver_url": sink.base_url}
    return dump_yaml(alertmanager_config(parse_spec(doc), group_wait="1s", group_interval="1s", repeat_interval="1h"))


def _fire(am: str, alerts: list[dict[str, str]]) -> None:
    now = datetime.datetime.now(datetime.UTC).isoformat()
    body = [{"labels": labels, "annotations": {"summary": "test"}, "startsAt": now} for labels in alerts]
    r = httpx.post(f"http://{am}/api/v2/alerts", json=body, timeout=10, trust_env=False)
    assert r.status_code == 200, r.text


def _wait(sink: livestack.Sink, done: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not done():
        time.sleep(0.2)


ALERTS = [
    {"alertname": "LLMDiagCgroupOOMKill", "severity": "page", "diag_class": "host_oom", "job": "a", "instance": "h:9464"},
    {"alertname": "LLMDiagQueueWaitDominates", "severity": "ticket", "diag_class": "queue_backlog", "job": "b", "model": "m"},
    {"alertname": "SomethingElse", "job": "c"},  # no severity: the default route, a ticket
]


def test_the_generated_routes_deliver_every_alert_with_its_severity(tmp_path: Path) -> None:
    with livestack.webhook_sink() as sink, livestack.alertmanager(_config(sink), tmp_path / "am") as am:
        _fire(am, ALERTS)
        _wait(sink, lambda: len(sink.alerts()) >= 3)
        got = {a["labels"]["alertname"]: severity for _, severity, a in sink.alerts()}
        assert got == {"LLMDiagCgroupOOMKill": "page", "LLMDiagQueueWaitDominates": "ticket", "SomethingElse": "ticket"}
        assert sink.refused == []


def test_the_sink_refuses_what_the_receiver_would_so_the_old_routes_fail(tmp_path: Path) -> None:
    """The routes as they were shipped (/page, /ticket): every delivery refused, nothing recorded."""
    with livestack.webhook_sink() as sink:
        config = _config(sink).replace("/webhook/page", "/page").replace("/webhook/ticket", "/ticket")
        with livestack.alertmanager(config, tmp_path / "am") as am:
            _fire(am, ALERTS)
            _wait(sink, lambda: {"/page", "/ticket"} <= set(sink.refused))
            assert {"/page", "/ticket"} <= set(sink.refused)
            assert sink.alerts() == []
