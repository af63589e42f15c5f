"""The diagnosis of an alert reads the alert's own machine: its ``host`` when it carries one, else its instance.

Against a real Prometheus scraping a real agent labelled ``host="gpu-07"``: an alert fired by that machine's
engine (another job and port, which this host does not run) is diagnosed on the agent's host series through
``host``; by its job and instance alone it would find nothing. An alert naming another machine finds nothing
of gpu-07's.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from diag.triage.diagnosis import DEFAULT_SELECTOR_LABELS, promql_selector, run_analysis
from tests import procs
from tests.promserver import PromServer, ScrapeJob, free_port, prometheus, require_prometheus


def test_the_host_label_selects_the_machine_in_place_of_job_and_instance() -> None:
    engine_alert = {"alertname": "X", "job": "vllm", "instance": "10.0.0.7:8000", "host": "gpu-07", "model": "m"}
    assert promql_selector(engine_alert, DEFAULT_SELECTOR_LABELS) == 'host="gpu-07"'
    assert promql_selector(engine_alert, ("job", "instance", "model")) == 'host="gpu-07",model="m"'
    assert promql_selector({"job": "vllm", "instance": "10.0.0.7:8000"}, DEFAULT_SELECTOR_LABELS) == (
        'job="vllm",instance="10.0.0.7:8000"'
    )
    assert promql_selector({"job": "j", "host": 'a"b'}, DEFAULT_SELECTOR_LABELS) == 'host="a\\"b"'
    # an operator who chose other selector labels (no instance) keeps them as given
    assert promql_selector({"job": "j", "host": "h", "cluster": "eu"}, ("cluster",)) == 'cluster="eu"'


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PromServer, str]]:
    """A real agent scraped as job llm-diag-host with host="gpu-07"; (Prometheus, the agent's instance)."""
    require_prometheus()
    folder = tmp_path_factory.mktemp("agent")
    port = free_port()
    agent = subprocess.Popen(
        [sys.executable, "-m", "diag.cli", "collect", "--interval", "1s", "--listen", f"127.0.0.1:{port}", "--no-gpu",
         "--no-kmsg", "--recorder", str(folder / "agent.db")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        with prometheus([ScrapeJob("llm-diag-host", [f"127.0.0.1:{port}"], labels={"host": "gpu-07"})]) as prom:
            assert prom.wait_for("count_over_time(up{host='gpu-07'}[2m]) >= 15", bool, timeout_s=90), prom.log_tail()
            yield prom, f"127.0.0.1:{port}"
    finally:
        procs.stop(agent)


def _diagnose(prom: PromServer, labels: dict[str, str]) -> tuple[str, dict]:  # type: ignore[type-arg]
    selector = promql_selector(labels, DEFAULT_SELECTOR_LABELS)
    return selector, run_analysis("prometheus", prom.url, selector, 120.0, time.time(), labels, True)


@pytest.mark.process
@pytest.mark.slow
def test_an_engine_alert_is_diagnosed_on_its_machines_series(machine: tuple[PromServer, str], tmp_path: Path) -> None:
    prom, agent_instance = machine
    engine = {"alertname": "LLMDiagQueueBacklog", "job": "vllm", "instance": "127.0.0.1:8000", "host": "gpu-07"}
    selector, doc = _diagnose(prom, engine)
    assert selector == 'host="gpu-07"'
    assert "error" not in doc, doc.get("error")
    # the same alert without its host label: job vllm, instance :8000 -- nothing of this machine
    _, blind = _diagnose(prom, {k: v for k, v in engine.items() if k != "host"})
    _, elsewhere = _diagnose(prom, {**engine, "host": "gpu-99"})
    assert len(doc["evaluated"]) > len(blind["evaluated"]), (doc["evaluated"], blind["evaluated"])
    assert len(doc["evaluated"]) > len(elsewhere["evaluated"])
    # and the agent's own alert, by job and instance as before: the same machine, the same rules evaluated
    _, own = _diagnose(prom, {"alertname": "A", "job": "llm-diag-host", "instance": agent_instance})
    assert sorted(own["evaluated"]) == sorted(doc["evaluated"])
