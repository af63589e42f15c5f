"""The per-request metric families: the single-process fast path must expose exactly what
prometheus_client's own metrics (used in multiprocess mode) expose, built from the catalog."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from collectors import catalog
from collectors.tracking.metrics import REQUEST_SPECS, TrackerMetrics, flush_metrics


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_fast_series_expose_what_prometheus_client_exposes() -> None:
    fast_reg, prom_reg = CollectorRegistry(), CollectorRegistry()
    fast, prom = TrackerMetrics(fast_reg, fast=True), TrackerMetrics(prom_reg, fast=False)
    rng = random.Random(7)
    for metrics in (fast, prom):
        rng.seed(7)
        series = {r: metrics.series(r, "m") for r in ("/a", "/b")}
        for _ in range(500):
            s = series[rng.choice(("/a", "/b"))]
            s.queued()
            s.dequeued()
            s.started()
            if rng.random() < 0.1:
                s.rejected(rng.choice(("queue_full", "memory_psi")))
            wait = rng.choice((0.0, 0.0004, 0.001, 0.3, 200.0))  # bucket edges, +Inf
            s.finished(
                rng.choice(("ok", "error", "inference_timeout")),
                True,
                wait,
                rng.expovariate(5),
                wait + 1,
                rng.choice((None, 0.05)),
            )
        series["/a"].queued()  # one still waiting, one still running
        series["/b"].started()
    flush_metrics()  # the prometheus_client side batches: its values are written at a flush
    fast_samples, prom_samples = _samples(fast_reg), _samples(prom_reg)
    assert fast_samples.keys() == prom_samples.keys()
    for key, value in prom_samples.items():
        assert abs(fast_samples[key] - value) < 1e-6 * max(1.0, abs(value)), key
    names = {name for name, _ in fast_samples}
    for spec in REQUEST_SPECS:  # every family, under its catalog name
        expected = spec.name + ("_count" if spec.type == "histogram" else "")
        assert expected in names, spec.name
    assert fast_samples[(catalog.QUEUE_DEPTH.name, (("model", "m"), ("route", "/a")))] == 1
    assert fast_samples[(catalog.ACTIVE_INFERENCES.name, (("model", "m"), ("route", "/b")))] == 1


def test_families_are_described_once_per_registry() -> None:
    registry = CollectorRegistry()
    metrics = TrackerMetrics(registry, fast=True)
    metrics.series("/a", "m").finished("ok", False, 0.1, 0.2, 0.3, None)
    text = generate_latest(registry).decode()
    for spec in REQUEST_SPECS:
        assert text.count(f"# TYPE {spec.name} ") == 1
