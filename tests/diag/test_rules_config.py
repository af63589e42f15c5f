"""unsafe_config (diag/rules/config.py): the ServiceConfig arithmetic against the memory limit.

The per-request memory is not given to the rule: it must recover it from the records (service
memory vs requests in flight), so the simulated cgroup memory follows the simulated in-flight count.
"""

from __future__ import annotations

import numpy as np

from collectors.records import ServiceConfig
from tests.diag.request_builders import (
    PID,
    T0,
    assert_units,
    finding,
    lognormal,
    not_evaluated,
    request_records,
    run,
    simulate_queue,
    telemetry,
)

D = 90.0
GIB = 1 << 30
PER_REQUEST = 200 << 20  # bytes per in-flight request in the simulated service (usage; anon is 80 % of it)

SAFE = {
    "workers": 2,
    "max_concurrency": 4,
    "queue_size": 16,
    "queue_timeout_s": 10.0,
    "request_timeout_s": 30.0,
    "preload": "shared",
    "refresh": "ttl",
    "max_prompt_tokens": 4096,
    "memory_guard": 0.9,
    "batching": "tokens",
    "max_batch_tokens": 4096,
    "weights_bytes": 512 << 20,
}


def _config(**overrides: object) -> dict:
    return ServiceConfig(ts=T0 - 5, service="demo", pid=PID, settings={**SAFE, **overrides}).to_dict()


def _loaded(seed: int, limit: int) -> list[dict]:
    """Requests whose concurrency swings between ~1 and ~12 (ample slots), and cgroup memory that
    follows the in-flight count: 1 GiB + 200 MiB per request."""
    rng = np.random.default_rng(seed)
    rows = simulate_queue(rng, D, lambda t: 2 + 18 * (0.5 + 0.5 * np.sin(t / 8)), 32, lognormal(0.5, 0.2))
    starts = np.array([s for _, s, _ in rows])
    ends = np.array([f for _, _, f in rows])

    def usage(t: float) -> float:
        inflight = np.mean([((starts <= x) & (x < ends)).sum() for x in np.linspace(t - 1, t, 5)])
        return float(GIB + PER_REQUEST * inflight)

    return request_records(rows) + telemetry(rng, D, usage=usage, limit=limit)


def test_per_worker_weights_over_the_limit_are_unsafe() -> None:
    rng = np.random.default_rng(1)
    records = [*telemetry(rng, 30.0, limit=6 * GIB), _config(workers=4, preload="per-worker", weights_bytes=2 * GIB)]
    a = run(records)
    f = finding(a, "config.unsafe")
    assert f is not None and f.cls == "unsafe_config" and f.confidence >= 0.6
    values = {e.what: e.value for e in f.evidence}
    assert values["model weights resident (4 copies)"] == 8 * GIB
    assert values["cgroup /llmdiag/svc limit"] == 6 * GIB
    assert any("preload per worker" in str(e.value) for e in f.evidence)
    assert any("share it" in r for r in f.remediation)
    assert_units(f)


def test_shared_weights_larger_than_the_limit_are_unsafe() -> None:
    """One shared mmap copy is page cache, charged to the cgroup: if it cannot fit, the service thrashes."""
    a = run([*_loaded(7, limit=2 * GIB), _config(weights_bytes=3 * GIB)])
    f = finding(a, "config.unsafe")
    assert f is not None and f.confidence >= 0.6
    assert "alone exceeds" in f.summary
    values = {e.what: e.value for e in f.evidence}
    assert values["model weights resident (1 copy)"] == 3 * GIB
    assert "requests in flight at which memory reaches the limit" not in values  # no negative "reach"


def test_concurrency_times_per_request_memory_over_the_limit_is_unsafe() -> None:
    a = run([*_loaded(2, limit=4 * GIB), _config(max_concurrency=16)])
    f = finding(a, "config.unsafe")
    assert f is not None and f.confidence >= 0.6
    values = {e.what: e.value for e in f.evidence}
    per_request = next(v for k, v in values.items() if k.startswith("memory per in-flight request"))
    assert 0.8 * PER_REQUEST * 0.8 <= per_request <= 1.2 * PER_REQUEST * 0.8  # anon = 80 % of usage
    assert values["projected memory at full configured concurrency"] > 4 * GIB


def test_unbounded_concurrency_reaches_the_limit_within_reach() -> None:
    a = run([*_loaded(3, limit=4 * GIB), _config(max_concurrency=None)])
    f = finding(a, "config.unsafe")
    assert f is not None and f.confidence >= 0.5
    reach = next(e.value for e in f.evidence if e.what == "requests in flight at which memory reaches the limit")
    expected = (4 * GIB - 0.8 * GIB) / (0.8 * PER_REQUEST)  # (limit - idle anon) / anon per request = 20
    assert 0.7 * expected <= reach <= 1.3 * expected


def test_safe_config_that_fits_is_quiet() -> None:
    a = run([*_loaded(4, limit=8 * GIB), _config()])
    assert finding(a, "config.unsafe") is None
    assert "config.unsafe" in a.evaluated


def test_risky_settings_that_fit_are_contributing_only() -> None:
    a = run([*_loaded(5, limit=8 * GIB), _config(queue_size=None, queue_timeout_s=None, request_timeout_s=None)])
    f = finding(a, "config.unsafe")
    assert f is not None and 0.2 <= f.confidence < 0.5
    assert any("a risk, not a cause" in r for r in f.rules_out)
    texts = [str(e.value) for e in f.evidence if e.what in ("risky setting", "minor setting")]
    assert any("queue_size is unbounded" in t for t in texts) and any("no queue or request timeout" in t for t in texts)


def test_unsafe_config_not_evaluated_without_a_config_record() -> None:
    a = run(_loaded(6, limit=4 * GIB))
    assert "config.unsafe" in not_evaluated(a)
