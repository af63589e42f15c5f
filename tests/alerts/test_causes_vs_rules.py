"""Every scenario recording judged twice -- by the rules (flight-recorder path) and by the committed cause alerts
(Prometheus path) -- and the two compared.

The alerts and the rules share their levels (``diag/rules/levels.py``); this test shows the shared definition
holds on real incidents. Each recording (tests/fixtures: the scenario runs and the uninstrumented ones) becomes
the series a Prometheus would have scraped from it (``diag.demo.scenarios.openmetrics``: the product's own
exporters fed the recorded records), is backfilled into a real Prometheus with promtool, and every cause alert's
expression is evaluated over it with ``query_range``. Recordings last about a minute, so an alert's ``for:`` can
never elapse in them: what is compared is the alert's *condition* (its expression returning a series at some
step), the part both sides define.

Agreement, both ways:
- an alert that fires names a class the rules also found (confidence >= 0.3) in the same recording;
- a recording whose verdict is a class some cause alert covers makes one of them fire.
Two kinds of disagreement are expected and stated, not hidden:
- alerts judge every cgroup on their own, the rules judge *the service*: a neighbour thrashing its own group fires
  the thrashing alert on that group, while the rules call it ``noisy_neighbour`` for the service;
- duplicate private copies whose processes hold no model file open (``duplicates-no-files``) are visible only to
  the rules, which follow the process tree; the alert's handle on a model process is the file it holds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from alerts.causes import CAUSES
from diag.demo.scenarios.openmetrics import openmetrics
from diag.demo.scenarios.recording import read_jsonl_gz
from diag.rules.engine import analyze
from diag.rules.stats import service_context
from diag.timeline import timeline_from_records
from tests.paths import FIXTURES
from tests.promserver import prometheus

pytestmark = pytest.mark.process

RECORDINGS = sorted((FIXTURES / "scenarios").glob("*.jsonl.gz")) + sorted((FIXTURES / "uninstrumented").glob("*.jsonl.gz"))
SLOT_S = 900.0  # each recording gets its own quarter hour: no rate window reaches into the next one
STEP_S = 5
SUSPECT = 0.3
BLIND_TO_ALERTS = {"duplicates-no-files": "duplicate_model_processes"}


@dataclass
class Judged:
    name: str
    primary: str
    found: dict[str, float]  # class -> best confidence, findings at or above SUSPECT
    service_cgroup: str | None
    fired: list[tuple[str, str, str]]  # (alert, class, cgroup label or '')


@pytest.fixture(scope="module")
def judged(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Judged]:
    folder = tmp_path_factory.mktemp("causes-vs-rules")
    now = time.time()
    spans: dict[str, tuple[float, float]] = {}
    files: list[Path] = []
    views: dict[str, Judged] = {}
    for i, path in enumerate(RECORDINGS):
        name = path.name.removesuffix(".jsonl.gz")
        records = read_jsonl_gz(path)
        t1 = max(r["ts"] for r in records)
        end = now - 300 - SLOT_S * (len(RECORDINGS) - 1 - i)
        shift = end - t1
        spans[name] = (min(r["ts"] for r in records) + shift, end)
        out = folder / f"{name}.om"
        out.write_text(openmetrics(records, agent_labels={"job": "llm-diag-host", "instance": f"{name}:9464"},
                                   backend_labels={"job": "llm-backend", "instance": f"{name}:8000"}, shift_s=shift))  # fmt: skip
        files.append(out)
        tl = timeline_from_records(records, source=name)
        analysis = analyze(tl).to_dict()
        found: dict[str, float] = {}
        for f in analysis["findings"]:
            if f["confidence"] >= SUSPECT:
                found[f["class"]] = max(found.get(f["class"], 0.0), f["confidence"])
        views[name] = Judged(name, analysis["verdict"]["primary"], found, service_context(tl).cgroup, [])
    with prometheus([], backfill=files) as prom:
        for name, (start, end) in spans.items():
            for cause in CAUSES:
                if not cause.diag_class:
                    continue
                r = httpx.get(f"{prom.url}/api/v1/query_range", timeout=30, trust_env=False,
                              params={"query": cause.expr, "start": start, "end": end + 60, "step": STEP_S}).json()  # fmt: skip
                assert r["status"] == "success", (cause.alert, r)
                for series in r["data"]["result"]:
                    views[name].fired.append((cause.alert, cause.diag_class, series["metric"].get("cgroup", "")))
    return views


@pytest.mark.slow
def test_every_recording_was_judged_by_both(judged: dict[str, Judged]) -> None:
    assert len(judged) == len(RECORDINGS) >= 15
    assert any(v.fired for v in judged.values())  # the alerts saw something at all: the conversion worked


@pytest.mark.parametrize("name", [p.name.removesuffix(".jsonl.gz") for p in RECORDINGS])
def test_an_alert_that_fires_names_a_class_the_rules_found(judged: dict[str, Judged], name: str) -> None:
    view = judged[name]
    for alert, cls, cgroup in view.fired:
        if cls in view.found:
            continue
        neighbour = view.primary == "noisy_neighbour" and cgroup and cgroup != view.service_cgroup
        assert neighbour, (
            f"{name}: {alert} fires ({cls}{' on ' + cgroup if cgroup else ''}) but the rules found only "
            f"{view.found or 'nothing'} (verdict {view.primary})"
        )


def test_a_verdict_a_cause_alert_covers_makes_one_fire(judged: dict[str, Judged]) -> None:
    covered = {c.diag_class for c in CAUSES if c.diag_class}
    checked, missed = [], []
    for name, view in judged.items():
        if view.primary not in covered:
            continue  # leaks, batching, loaders ...: no cause alert; the live diagnosis's LLMDiagIncident reports them
        fired = {cls for _, cls, _ in view.fired}
        if BLIND_TO_ALERTS.get(name) == view.primary:
            assert view.primary not in fired, f"{name}: the alert sees it now; drop the exception"
            continue
        checked.append(name)
        if view.primary not in fired:
            missed.append(f"{name}: the rules conclude {view.primary}; no cause alert of that class fires")
    assert not missed, missed
    # every class a cause alert covers has a recording concluding it (queue, thrashing, OOM, pressure, copies, GPU OOM)
    assert {judged[n].primary for n in checked} == covered, checked
