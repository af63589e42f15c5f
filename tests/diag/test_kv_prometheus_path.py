"""The kv-saturation recording and its queue contrast through the Prometheus path: backfilled, loaded, analysed.

The recordings are of the reference backend speaking vLLM's /metrics, scraped by the agent. Converted to the
series a Prometheus scraping that engine would hold (``diag.demo.scenarios.openmetrics``: the recorded scrapes'
gauges, counters and histograms), backfilled into a real Prometheus with promtool and loaded with
``load_prometheus`` -- the path ``diag analyze --prometheus`` takes -- they must be diagnosed as on the recorder.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from diag.demo.scenarios.openmetrics import openmetrics
from diag.demo.scenarios.recording import read_jsonl_gz
from diag.rules.engine import analyze
from diag.sources.prometheus import load_prometheus
from tests.paths import FIXTURES
from tests.promserver import prometheus, require_prometheus

RUNS = {"scenarios/kv-saturation.jsonl.gz": "kv_cache_saturation", "dialects/queue-vllm.jsonl.gz": "queue_backlog"}


@pytest.mark.process
@pytest.mark.parametrize("path", sorted(RUNS))
def test_the_prometheus_path_gives_the_recorders_class(path: str, tmp_path: Path) -> None:
    require_prometheus()
    records = read_jsonl_gz(FIXTURES / path)
    t0, t1 = min(r["ts"] for r in records), max(r["ts"] for r in records)
    shift = (time.time() - 600) - t1  # inside the TSDB's retention, clear of the head block
    om = tmp_path / "run.om"
    om.write_text(openmetrics(records, agent_labels={"job": "llm-diag-host", "instance": "host:9464"},
                              backend_labels={"job": "vllm", "instance": "host:8000"}, shift_s=shift))  # fmt: skip
    with prometheus([], backfill=[om]) as prom:
        tl = load_prometheus(prom.url, selector='job="vllm"', since_s=t1 - t0, until=t1 + shift, step_s=1.0)
    analysis = analyze(tl)
    assert "kv_cache_usage_ratio" in tl.service and "preemptions_rps" in tl.service
    assert analysis.primary == RUNS[path], [(f.rule, round(f.confidence, 2), f.summary) for f in analysis.findings]
    if RUNS[path] != "kv_cache_saturation":
        assert "kv_cache_saturation" not in {f.cls for f in analysis.findings}
