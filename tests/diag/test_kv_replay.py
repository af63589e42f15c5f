"""KV-cache saturation vs a queue backlog on recordings of the reference backend speaking vLLM's /metrics.

Both runs are uninstrumented (the engine's own families, scraped by the agent): ``kv-saturation`` fills a
1600-token KV budget until the engine preempts, ``queue-vllm`` queues requests for one slot while the cache
has room. One must be diagnosed ``kv_cache_saturation``, the other must not.
"""

from __future__ import annotations

from pathlib import Path

from diag.demo.scenarios.recording import read_jsonl_gz
from diag.rules.engine import analyze
from diag.rules.kv_cache import kv_cache_saturation
from diag.timeline import Timeline, timeline_from_records

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _timeline(path: str) -> Timeline:
    return timeline_from_records(read_jsonl_gz(FIXTURES / path), source=path)


def test_the_saturated_cache_is_diagnosed_from_the_engines_own_metrics() -> None:
    tl = _timeline("scenarios/kv-saturation.jsonl.gz")
    assert not len(tl.requests)  # uninstrumented: nothing but the engine's /metrics about requests
    analysis = analyze(tl)
    assert analysis.primary == "kv_cache_saturation", [(f.rule, f.confidence, f.summary) for f in analysis.findings]
    kv = next(f for f in analysis.findings if f.cls == "kv_cache_saturation")
    assert kv.confidence >= 0.75 and "preempts" in kv.summary
    # the queue rule sees the wait on the same histograms, and gives way
    backlog = [f for f in analysis.findings if f.cls == "queue_backlog"]
    assert all(f.confidence <= 0.45 for f in backlog)


def test_a_queue_with_room_in_the_cache_is_a_backlog_not_saturation() -> None:
    tl = _timeline("dialects/queue-vllm.jsonl.gz")
    assert "kv_cache_usage_ratio" in tl.service  # the rule could look ...
    assert kv_cache_saturation(tl) is None  # ... and found the cache with room
    analysis = analyze(tl)
    assert "kv_cache.saturation" in analysis.evaluated
    assert analysis.primary == "queue_backlog"
    assert "kv_cache_saturation" not in {f.cls for f in analysis.findings}
