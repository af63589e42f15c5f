"""KV-cache saturation on synthetic Timelines: the engine's own series, as the --scrape and Prometheus paths fill them."""

from __future__ import annotations

import numpy as np

from diag.rules import levels
from diag.rules.base import Finding, TooLittleData
from diag.rules.engine import analyze
from diag.rules.kv_cache import kv_cache_saturation
from diag.timeline import Series, Timeline

STEP = 5.0
N = 60  # five minutes of 5 s steps


def _timeline(usage: np.ndarray, preempt: np.ndarray | None = None, ttft: np.ndarray | None = None,
              capacity: np.ndarray | None = None, **extra: np.ndarray) -> Timeline:  # fmt: skip
    ts = 1000.0 + STEP * np.arange(usage.size)
    service = {"kv_cache_usage_ratio": Series(ts, usage)}
    for key, values in (("preemptions_rps", preempt), ("ttft_mean_s", ttft), ("requests_waiting_capacity", capacity),
                        *extra.items()):  # fmt: skip
        if values is not None:
            service[key] = Series(ts, np.asarray(values, dtype=float))
    return Timeline(start=float(ts[0]), end=float(ts[-1]), source="synthetic", service=service)


def _calm_then_full(full_usage: float = 0.99) -> np.ndarray:
    """Room for the first third, then the cache at its ceiling."""
    return np.where(np.arange(N) < N // 3, 0.4, full_usage)


def _saturated(ttft_full: float = 2.0) -> Timeline:
    usage = _calm_then_full()
    full = usage >= levels.KV_CEILING
    return _timeline(usage, np.where(full, 1.5, 0.0), np.where(full, ttft_full, 0.3))


def test_full_cache_with_preemptions_and_rising_latency_is_saturation() -> None:
    f = kv_cache_saturation(_saturated())
    assert isinstance(f, Finding) and f.cls == "kv_cache_saturation" and f.confidence >= 0.75, f
    assert "preempts" in f.summary and "ttft_mean_s rises" in f.summary
    assert any("max_num_seqs" in r for r in f.remediation)
    assert any("gpu_memory_utilization only within" in r for r in f.remediation)
    assert any("queue backlog" in r for r in f.rules_out)
    assert analyze(_saturated()).primary == "kv_cache_saturation"


def test_waiting_for_capacity_counts_as_pressure_without_preemption_counts() -> None:
    usage = _calm_then_full()
    full = usage >= levels.KV_CEILING
    tl = _timeline(usage, None, np.where(full, 2.0, 0.3), capacity=np.where(full, 4.0, 0.0))
    f = kv_cache_saturation(tl)
    assert isinstance(f, Finding) and f.confidence >= 0.8 and "for KV capacity" in f.summary, f


def test_room_in_the_cache_is_not_saturation_even_when_requests_wait() -> None:
    """A queue backlog: requests wait and TTFT climbs, but the cache stays at 60 %: not this class."""
    usage = np.full(N, 0.6)
    tl = _timeline(usage, np.zeros(N), np.linspace(0.3, 5.0, N), queue_depth=np.linspace(0, 40, N))
    assert kv_cache_saturation(tl) is None
    assert analyze(tl).primary != "kv_cache_saturation"


def test_full_cache_without_preemptions_is_a_cache_in_use() -> None:
    usage = _calm_then_full()
    assert kv_cache_saturation(_timeline(usage, np.zeros(N), np.full(N, 0.3))) is None


def test_preemptions_with_flat_latency_stay_a_suspect() -> None:
    f = kv_cache_saturation(_saturated(ttft_full=0.31))
    assert isinstance(f, Finding) and f.confidence < 0.5 and "copes" in f.summary, f


def test_no_latency_series_stays_a_suspect() -> None:
    usage = _calm_then_full()
    f = kv_cache_saturation(_timeline(usage, np.where(usage >= levels.KV_CEILING, 1.0, 0.0)))
    assert isinstance(f, Finding) and 0.3 <= f.confidence < 0.5, f


def test_a_window_full_from_the_start_compares_with_its_early_part() -> None:
    """No sample with room: the latency reference is the window's first fifth before the ceiling."""
    usage = np.concatenate([np.full(8, 0.9), np.full(N - 8, 0.99)])
    ttft = np.concatenate([np.full(8, 0.2), np.full(N - 8, 1.0)])
    f = kv_cache_saturation(_timeline(usage, np.where(usage >= levels.KV_CEILING, 0.5, 0.0), ttft))
    assert isinstance(f, Finding) and f.confidence >= 0.75 and "early in the window" in f.summary, f


def test_too_few_samples_is_too_little_data() -> None:
    tl = _timeline(np.full(3, 0.99), np.full(3, 1.0), np.full(3, 1.0))
    assert isinstance(kv_cache_saturation(tl), TooLittleData)


def test_absent_kv_signals_leave_the_rule_not_evaluated() -> None:
    ts = 1000.0 + STEP * np.arange(N)
    tl = Timeline(start=float(ts[0]), end=float(ts[-1]), service={"ttft_mean_s": Series(ts, np.full(N, 0.3))})
    result = analyze(tl)
    missing = [n for n in result.not_evaluated if n["rule"] == "kv_cache.saturation"]
    assert missing and "service:kv_cache_usage_ratio" in missing[0]["missing"]
    assert "kv_cache.saturation" not in result.evaluated
    # usage alone (llama.cpp exports no preemption count) is not enough either
    tl.service["kv_cache_usage_ratio"] = Series(ts, np.full(N, 0.99))
    missing = [n for n in analyze(tl).not_evaluated if n["rule"] == "kv_cache.saturation"]
    assert missing and "preemptions_rps" in missing[0]["missing"][0]
