"""The engine dashboard's vLLM queries over a vLLM /metrics at the wire, scraped live by a real Prometheus.

test_families.py proves every panel on backfilled history shaped from the declarations; this proves the same
queries on what a vLLM API server actually puts on the wire -- prometheus_client's rendering of the v1 engine's
families, counters with ``_total``, ``model_name`` and ``engine`` labels (tests/vllm_wire.py) -- scraped every
second by Prometheus in a plain job (no relabelling). Every vLLM alternative whose families the wire serves must
return a finite value; the panels covered are listed, so a family the wire stops serving shows as a lost panel.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator

import pytest

from dashboards.engine import alternative_dialects, engine_panels
from dashboards.promql import metric_names, series_known
from tests.promserver import PromServer, ScrapeJob, prometheus, require_prometheus
from tests.vllm_wire import VllmMetrics, serve

pytestmark = pytest.mark.process
DEADLINE_S = 40.0


@pytest.fixture(scope="module")
def vllm_host() -> Iterator[PromServer]:
    require_prometheus()
    with serve(VllmMetrics("demo-model")) as port, prometheus([ScrapeJob("vllm", [f"127.0.0.1:{port}"])]) as prom:
        assert prom.wait_for('vllm:num_requests_running{job="vllm"}', bool, 40), prom.log_tail()
        yield prom


def _instant(prom: PromServer, expr: str) -> list[float]:
    text = expr.replace("$__rate_interval", "10s")
    text = re.sub(r"\$\{?(job|instance|model)\}?", ".+", text)
    return [v for s in prom.query(text) if math.isfinite(v := float(s["value"][1]))]


def test_every_vllm_alternative_the_wire_serves_returns_data(vllm_host: PromServer) -> None:
    served = {s["metric"]["__name__"] for s in vllm_host.query('{job="vllm"}')}
    known = series_known()
    covered, missing = set(), []
    deadline = time.monotonic() + DEADLINE_S
    for panel in engine_panels():
        for query in panel.queries:
            for alt in query.alternatives:
                if alternative_dialects(alt) != {"vllm"} or not metric_names(alt) <= served:
                    continue
                while not _instant(vllm_host, alt) and time.monotonic() < deadline:  # a rate needs two scrapes
                    time.sleep(0.5)
                if _instant(vllm_host, alt):
                    covered.add(panel.title)
                else:
                    missing.append((panel.title, alt))
    assert not missing, missing
    assert {known[n] for n in served if n in known}, served
    assert covered >= {"KV cache saturation: usage vs ceiling, with preemptions", "KV cache usage", "Preemptions",
                       "Scheduler state: running and waiting", "Token throughput", "Finish reasons",
                       "Prefix cache hit rate", "Time to first token", "Inter-token latency", "End-to-end latency",
                       "Queue time", "Prefill and decode time", "Inference time"}, covered  # fmt: skip
