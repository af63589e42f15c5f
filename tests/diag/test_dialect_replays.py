"""Uninstrumented engines judged from their own /metrics: recorded runs of the reference backend speaking TGI or llama.cpp.

Each fixture (``tests/fixtures/dialects/<scenario>-<dialect>.jsonl.gz``) is one real run of ``diag demo --scenario
NAME --dialect D``: no request rows, only the engine's families as the agent scraped them, beside the agent's host,
cgroup and process samples. What they pin down:

- a queue building in front of one slot holds memory (every waiting request's prompt and connection), and memory
  that grows with it is load, not a leak -- weighed against the engine's running + waiting gauges;
- a real leak stays a leak when weighed against the same gauges;
- memory pressure that follows the engine's load is the service's own, even while other jobs stall the host;
- llama.cpp's server exports no latency histogram, but its deferred and processing gauges give the ratio of queue
  wait to service time by Little's law: a backlog is seen, a healthy run and a KV-bound run are not called one;
- KV usage is not exported there: the KV rule says it could not evaluate, never concludes.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from diag.demo.scenarios.recording import read_jsonl_gz
from diag.rules import memory, stats
from diag.rules.aggregated import queue_from_gauges
from diag.rules.base import Finding
from diag.rules.engine import Analysis, analyze
from diag.timeline import Timeline, timeline_from_records

DIALECTS = Path(__file__).resolve().parents[1] / "fixtures" / "dialects"


def _records(name: str) -> list[dict[str, Any]]:
    return read_jsonl_gz(DIALECTS / f"{name}.jsonl.gz")


def _timeline(name: str, records: list[dict[str, Any]] | None = None) -> Timeline:
    tl = timeline_from_records(records if records is not None else _records(name), source=name)
    assert not len(tl.requests)  # uninstrumented: the engine's /metrics is all there is about requests
    return tl


def _explain(analysis: Analysis) -> list[tuple[str, float, str]]:
    return [(f.rule, round(f.confidence, 2), f.summary) for f in analysis.findings]


def _leak_of(tl: Timeline) -> list[memory.Assessment]:
    return memory.assess_service(tl).decisive


# --------------------------------------------------------------------------- the engine's gauges as load


def test_engine_load_is_running_plus_waiting_held_between_samples() -> None:
    tl = _timeline("queue-tgi")
    load = stats.load_index(tl)
    assert isinstance(load, stats.EngineLoad)
    run, wait = tl.service["requests_running"].valid(), tl.service["requests_waiting"].valid()
    # at the gauges' own sample times: their sum; half-way to the next sample: still the last sample's value
    at = load.at(wait.ts)
    assert np.array_equal(at, wait.values + np.interp(wait.ts, run.ts, run.values))
    mid = 0.5 * (wait.ts[:-1] + wait.ts[1:])
    assert np.array_equal(load.at(mid)[: len(mid)], at[:-1])
    assert float(load.at(np.array([tl.start - 100.0]))[0]) == 0.0  # before the first sample: nothing known, none held
    assert load.covers(tl.start, tl.end) and not load.covers(tl.end + 10, tl.end + 20)


def test_engine_load_needs_both_gauges_and_request_rows_come_first() -> None:
    only_running = copy.deepcopy(_records("queue-tgi"))
    for r in only_running:
        if r["kind"] == "backend":
            r["gauges"] = {k: v for k, v in r["gauges"].items() if not k.startswith("tgi_queue_size")}
    # running alone misses the queue, which is what holds the memory: no load rather than a wrong one
    assert stats.load_index(_timeline("queue-tgi", only_running)) is None
    # an instrumented service's request rows say when each request ran: they are the load, not the gauges
    tracked = timeline_from_records(read_jsonl_gz(DIALECTS.parent / "scenarios" / "queue.jsonl.gz"), source="queue")
    assert len(tracked.requests) and isinstance(stats.load_index(tracked), stats.LoadIndex)


def test_a_queue_that_holds_memory_is_a_backlog_not_a_leak_tgi() -> None:
    tl = _timeline("queue-tgi")
    (a,) = _leak_of(tl)
    assert a.trend is not None and a.trend.slope > 0  # the working set does climb while the queue builds ...
    assert a.load.observed and a.load.name == stats.EngineLoad.NAME
    assert a.load.follows and a.load.rho >= memory.FOLLOWS_LOAD_RHO  # ... with the requests the engine holds
    assert not a.leak and any(w.startswith("explained by load") for w in a.why_not)
    analysis = analyze(tl)
    assert analysis.primary == "queue_backlog", _explain(analysis)
    assert "memory_leak" not in {f.cls for f in analysis.findings}


def test_a_leak_stays_a_leak_against_the_engines_load_tgi() -> None:
    tl = _timeline("leak-tgi")
    (a,) = _leak_of(tl)
    assert a.load.observed and a.load.name == stats.EngineLoad.NAME and not a.load.explains
    assert a.leak
    analysis = analyze(tl)
    assert analysis.primary == "memory_leak", _explain(analysis)
    leak = next(f for f in analysis.findings if f.cls == "memory_leak")
    assert any(stats.EngineLoad.NAME in e.what for e in leak.evidence)  # the load it was weighed against is shown


def test_pressure_that_follows_the_engines_load_is_the_services_own_tgi() -> None:
    tl = _timeline("pressure-tgi")
    analysis = analyze(tl)
    assert analysis.primary == "memory_pressure", _explain(analysis)
    pressure = next(f for f in analysis.findings if f.cls == "memory_pressure")
    assert "memory follows " + stats.EngineLoad.NAME in pressure.summary
    # the host stalled from other jobs too: the neighbour finding stays, ranked under the service's own pressure
    neighbour = [f for f in analysis.findings if f.cls == "noisy_neighbour"]
    assert all(f.confidence < pressure.confidence for f in neighbour)


# --------------------------------------------------------------------------- llama.cpp: Little's law on two gauges


def test_llamacpp_queue_is_a_backlog_from_deferred_vs_processing() -> None:
    tl = _timeline("queue-llamacpp")
    assert not any(k.startswith("queue_wait") for k in tl.service)  # no latency histograms at all
    found = queue_from_gauges(tl)
    assert isinstance(found, Finding) and found.confidence >= 0.5, found
    ratio = next(e for e in found.evidence if "Little's law" in e.what)
    busy, calm = (float(x) for x in str(ratio.value).split(" vs "))
    assert busy >= 5.0 and busy > 3 * calm  # each waits many times its service time at busy times
    analysis = analyze(tl)
    assert analysis.primary == "queue_backlog", _explain(analysis)


def test_swapped_gauges_are_no_backlog() -> None:
    """The same run with processing and deferred exchanged: as many running as waited, nearly none waiting."""
    records = copy.deepcopy(_records("queue-llamacpp"))
    for r in records:
        g = r.get("gauges") if r["kind"] == "backend" else None
        if g and "llamacpp:requests_deferred" in g:
            g["llamacpp:requests_deferred"], g["llamacpp:requests_processing"] = (
                g["llamacpp:requests_processing"], g["llamacpp:requests_deferred"],
            )  # fmt: skip
    assert queue_from_gauges(_timeline("queue-llamacpp", records)) is None


@pytest.mark.parametrize("name", ["healthy-llamacpp", "kv-saturation-llamacpp"])
def test_llamacpp_runs_without_a_backlog_are_not_called_one(name: str) -> None:
    tl = _timeline(name)
    assert queue_from_gauges(tl) is None
    analysis = analyze(tl)
    assert analysis.primary not in ("queue_backlog", "kv_cache_saturation"), _explain(analysis)
    if name == "healthy-llamacpp":
        assert analysis.primary == "healthy", _explain(analysis)


def test_llamacpp_exports_no_kv_usage_and_the_kv_rule_says_so() -> None:
    tl = _timeline("kv-saturation-llamacpp")
    assert "kv_cache_usage_ratio" not in tl.service and "preemptions_rps" not in tl.service
    analysis = analyze(tl)
    assert "kv_cache.saturation" in {n["rule"] for n in analysis.not_evaluated}
    assert "kv_cache_saturation" not in {f.cls for f in analysis.findings}


def test_the_gauge_rule_stands_aside_where_waits_are_measured() -> None:
    """vLLM and TGI export queue-time histograms: the measured waits decide, not Little's law on the gauges."""
    for name in ("queue-vllm", "queue-tgi"):
        tl = _timeline(name)
        assert "requests_waiting" in tl.service and "queue_wait_mean_s" in tl.service
        assert queue_from_gauges(tl) is None
