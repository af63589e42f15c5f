"""Live, end to end: generated rules in a real Prometheus, a real Alertmanager 0.25, a real agent and demo.

Prometheus (rules evaluated every second) scrapes ``diag collect --diagnose-every 5s`` and ``diag demo
serve``; Alertmanager routes with the generated config to a local webhook sink. Faults are real:
a process OOM-killed by the service's memory cgroup limit, and a queue overload of the demo. The SLO rules
come from a spec with minute-scale windows (the default rules are proven by their promtool tests);
the cause rules are the shipped ones. Each test asserts labels, annotations and the receiver, and
prints how long it took from fault to delivery.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote_plus

import httpx
import pytest
import yaml

from alerts.alertmanager import alertmanager_config
from alerts.generate import dump_yaml, render
from alerts.spec import DEFAULT_SPEC_PATH, load_spec, parse_spec
from dashboards.definitions import TIER_PANEL, dashboard
from diag.rules.classes import INCIDENT_CLASSES
from tests import procs
from tests.alerts import livestack
from tests.livecg import require_live
from tests.promserver import rules_evaluated_after

pytestmark = pytest.mark.live
MiB = 1 << 20
TIMINGS: dict[str, float] = {}


def live_spec(sink: livestack.Sink) -> Any:
    """The default spec with minute-scale tiers (factor 13.5 over 2m/30s pages, 2.16 over 10m/2m tickets)."""
    doc = yaml.safe_load(DEFAULT_SPEC_PATH.read_text())
    doc["tiers"] = [
        {"name": "fast", "severity": "page", "long": "2m", "short": "30s", "budget_percent": 0.0625, "min_events": 5},
        {"name": "slow", "severity": "ticket", "long": "10m", "short": "2m", "budget_percent": 0.05, "min_events": 5},
    ]
    doc["slos"] = [s for s in doc["slos"] if s["name"] in ("availability", "queue-wait")]
    # 0.32 s (a catalog bucket): with 24 clients on one slot a request waits ~23 inference times, so even a fast
    # host's ~50 ms inferences cross it (at 1.28 s a quiet host served fast enough never to burn)
    doc["slos"][1]["latency"]["threshold"] = 0.32
    doc["routing"] = {"receiver_url": sink.base_url}
    return parse_spec(doc)


class Load:
    """Closed-loop clients posting completions to the demo until stopped."""

    def __init__(self, url: str, clients: int, think_s: float, max_tokens: int = 16) -> None:
        self.url, self.clients, self.think_s, self.max_tokens = url, clients, think_s, max_tokens
        self.stop = threading.Event()
        self.sent = 0
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _run(self) -> None:
        with httpx.Client(timeout=120.0, trust_env=False) as client:
            while not self.stop.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    body = {"prompt": "tell me about memory " * 8, "max_tokens": self.max_tokens}
                    client.post(f"{self.url}/v1/completions", json=body)
                self.sent += 1
                self.stop.wait(self.think_s)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=150)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_live()
    from diag.demo.harness import start_demo
    from diag.demo.scenarios.cgroups import ScenarioCgroups
    from diag.demo.weights import ModelConfig, ensure_weights

    folder = tmp_path_factory.mktemp("alerts-live")
    groups = ScenarioCgroups(prefix="llmdiag-alerts")
    try:
        # the demo's own group: the OOM kill happens in the service's cgroup, as in a real incident (a process
        # the diagnosis counts as the service's; a kill in an unrelated group is only a weak finding)
        service = groups.create("service", 512 * MiB)
        with livestack.webhook_sink() as sink:
            spec = live_spec(sink)
            generated = render(spec, INCIDENT_CLASSES, "live-test")
            rules = []
            for rel, text in generated.files.items():
                if rel.endswith(".rules.yaml"):
                    (folder / rel).write_text(text)
                    rules.append(folder / rel)
            am_config = dump_yaml(alertmanager_config(spec, group_wait="1s", group_interval="1s", repeat_interval="1h"))
            weights = folder / "weights"
            ensure_weights(weights, ModelConfig.for_budget(16))
            demo = start_demo(["--max-concurrency", "1", "--queue-size", "64", "--queue-timeout", "120", "--memory-guard", "0"],
                              weights_mb=16, weights_dir=weights, log_dir=folder, cgroup=service, ready_timeout=120)  # fmt: skip
            try:
                with (
                    livestack.agent(folder / "recorder.db", [service.path], folder) as (agent_addr, _agent_pid),
                    livestack.alertmanager(am_config, folder / "am") as am_addr,
                    livestack.prometheus_with_rules(
                        rules, {"llm-diag-agent": agent_addr, "llm-api": f"127.0.0.1:{demo.port}"}, am_addr, folder / "prom"
                    ) as prom,  # fmt: skip
                ):
                    # ready when both targets are up and the rules have produced a request count
                    deadline = time.monotonic() + 90
                    while time.monotonic() < deadline:
                        r = httpx.get(f"{prom}/api/v1/query", params={"query": "sum(up)"}, trust_env=False).json()
                        if r["data"]["result"] and float(r["data"]["result"][0]["value"][1]) == 2:
                            break
                        time.sleep(0.5)
                    else:
                        pytest.fail("Prometheus never scraped both the agent and the demo")
                    yield {"sink": sink, "prom": prom, "demo": demo, "service": service, "agent": agent_addr}
            finally:
                demo.stop()
    finally:
        groups.close()
        assert not groups.leftovers, f"cgroups left behind: {groups.leftovers}"
        print("\nfault -> delivery (s):", {k: round(v, 1) for k, v in TIMINGS.items()}, file=sys.stderr)


def _label(name: str, value: str):
    return lambda a: a["labels"].get(name) == value


@pytest.mark.slow
def test_healthy_run_delivers_nothing(stack: dict[str, Any]) -> None:
    sink: livestack.Sink = stack["sink"]
    start = time.time()
    with Load(stack["demo"].url, clients=1, think_s=0.5) as load:
        time.sleep(45)  # the healthy run itself: 45 s of light load
    # Instead of waiting "a few evaluation cycles" for a late delivery: once every alerting group has evaluated the
    # whole run, Prometheus' own ALERTS series shows that no alert fired at any point of it -- nothing to deliver.
    load_end = time.time()
    evaluated = procs.poll_until(lambda: rules_evaluated_after(stack["prom"], load_end, alerting_only=True), 30)
    assert evaluated, "the alerting rules never ran after the load"
    query = f'max_over_time(ALERTS{{alertstate="firing"}}[{int(time.time() - start)}s])'  # this test's run only
    fired = httpx.get(f"{stack['prom']}/api/v1/query", params={"query": query}, trust_env=False).json()
    assert fired["status"] == "success" and fired["data"]["result"] == [], fired
    assert load.sent > 20
    delivered = sink.alerts(since=0)
    assert delivered == [], [(r, a["labels"]) for _, r, a in delivered]
    assert sink.refused == []
    TIMINGS["healthy (45 s) alerts"] = len(delivered)
    assert time.time() - start >= 45


def test_oom_kill_delivers_the_cause_alert_and_the_diagnosis(stack: dict[str, Any]) -> None:
    sink: livestack.Sink = stack["sink"]
    hog = stack["service"]
    t0 = time.time()
    proc = hog.spawn([sys.executable, "-c", "b = b'x' * (1024 << 20); import time; time.sleep(30)"])
    assert proc.wait(timeout=60) == -9, "the service group's 512 MiB limit must OOM-kill a 1 GiB allocation"
    assert hog.oom_kills() >= 1
    assert httpx.get(f"{stack['demo'].url}/healthz", timeout=10, trust_env=False).status_code in (200, 503)  # not the demo

    cgroup_oom = sink.wait_for(lambda a: a["labels"]["alertname"] == "LLMDiagCgroupOOMKill" and a["labels"]["cgroup"] == hog.path,
                               t0, 90)  # fmt: skip
    assert cgroup_oom is not None, "no LLMDiagCgroupOOMKill for the hog's group"
    at, receiver, alert = cgroup_oom
    assert receiver == "page"
    assert alert["labels"]["severity"] == "page" and alert["labels"]["diag_class"] == "host_oom"
    assert alert["annotations"]["summary"].startswith(f"cgroup {hog.path} hit its memory limit")
    assert alert["annotations"]["runbook_url"]
    TIMINGS["OOM kill -> LLMDiagCgroupOOMKill"] = at - t0

    kmsg = sink.wait_for(lambda a: a["labels"]["alertname"] == "LLMDiagOOMKill"
                         and a["labels"]["constraint"] == "CONSTRAINT_MEMCG", t0, 60)  # fmt: skip
    assert kmsg is not None and kmsg[1] == "page"
    TIMINGS["OOM kill -> LLMDiagOOMKill"] = kmsg[0] - t0

    is_incident = lambda a: a["labels"]["alertname"] == "LLMDiagIncident" and a["labels"]["class"] == "host_oom"  # noqa: E731
    incident = sink.wait_for(is_incident, t0, 120)
    assert incident is not None, "the live diagnosis did not conclude host_oom"
    at, receiver, alert = incident
    assert receiver == "ticket"
    assert alert["labels"]["diag_class"] == "host_oom" and alert["labels"]["severity"] == "ticket"
    info = httpx.get(f"http://{stack['agent']}/metrics", trust_env=False).text
    summary = alert["annotations"]["summary"]
    assert summary and f'summary="{summary}"' in info.replace('\\"', '"')
    assert alert["annotations"]["evidence"]
    assert 0.5 <= float(alert["annotations"]["confidence"]) <= 1
    TIMINGS["OOM kill -> LLMDiagIncident{host_oom}"] = at - t0
    assert sink.refused == []  # every route posted to a path the receiver serves


@pytest.mark.slow
def test_queue_overload_delivers_the_queue_cause_and_a_fast_burn_page(stack: dict[str, Any]) -> None:
    sink: livestack.Sink = stack["sink"]
    t0 = time.time()
    is_burn = lambda a: a["labels"]["alertname"] == "LLMDiagSLOBurn" and a["labels"]["slo"] == "queue-wait"  # noqa: E731
    with Load(stack["demo"].url, clients=24, think_s=0.0, max_tokens=32):
        burn = sink.wait_for(lambda a: is_burn(a) and a["labels"]["tier"] == "fast", t0, 150)
        cause = sink.wait_for(lambda a: a["labels"]["alertname"] == "LLMDiagQueueWaitDominates", t0, 180)
    assert burn is not None, "no fast-tier burn alert for the queue-wait SLO"
    at, receiver, alert = burn
    assert receiver == "page"
    labels = alert["labels"]
    tier = (labels["severity"], labels["long_window"], labels["short_window"], labels["burn_factor"])
    assert tier == ("page", "2m", "30s", "13.5")
    assert labels["model"] and labels["job"] == "llm-api"
    assert "burns its error budget 13.5x too fast: at this rate the 30-day budget is gone in" in alert["annotations"]["summary"]
    panel = dashboard("slo").panel_id(TIER_PANEL)
    assert alert["annotations"]["dashboard_url"] == (
        f"{load_spec().grafana_url}/d/llmdiag-slo?var-slo=queue-wait&var-model={quote_plus(labels['model'], safe='')}"
        f"&var-job=llm-api&viewPanel={panel}"
    )
    TIMINGS["queue overload -> LLMDiagSLOBurn{queue-wait, fast}"] = at - t0
    # the slow tier fires too, but the fast page inhibits it once delivered
    late_slow = [a for t, _, a in sink.alerts(since=at + 2) if is_burn(a) and a["labels"]["tier"] == "slow"]
    assert late_slow == []

    assert cause is not None, "no LLMDiagQueueWaitDominates"
    at, receiver, alert = cause
    assert receiver == "ticket" and alert["labels"]["diag_class"] == "queue_backlog"
    assert alert["labels"]["model"] == labels["model"]
    assert "wait >= 3x their inference time for a slot" in alert["annotations"]["summary"]
    TIMINGS["queue overload -> LLMDiagQueueWaitDominates"] = at - t0
    assert sink.refused == []
