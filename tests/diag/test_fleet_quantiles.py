"""The fleet's latency quantiles, made from the bucket rates it asks for, equal the store's own ``histogram_quantile``.

Why here: the fleet asks a store for each histogram's bucket rates once and computes every quantile from them
(``diag.sources.fleet.quantile_results``), where the single-target path asks the store for ``histogram_quantile``
per quantile. The two must agree to the last bit, or a target's fleet verdict could differ from its own. So a real
Prometheus is backfilled with histograms shaped to meet each special case of its ``bucketQuantile`` -- a count
that falls between buckets, two spellings of one bound, no ``+Inf`` bucket, buckets that start late, no
observations, bounds at or below zero, an ``le`` that is no number -- and the two answers are compared series for
series, step for step, with ``==``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from diag.sources.fleet import _LazyPrometheus, quantile_results
from tests.promserver import PromServer, prometheus, require_prometheus

pytestmark = [pytest.mark.process]

STEP_S = 5
POINTS = 120  # ten minutes of samples, one every STEP_S
QS = (0.25, 0.5, 0.95, 0.99)
RATE = "rate(t_seconds_bucket[20s])"

# instance -> le -> cumulative count added per sample (the counters' slopes), or (slope, first sample index)
SHAPES: dict[str, dict[str, float | tuple[float, int]]] = {
    "plain": {"0.1": 1, "0.5": 4, "1": 9, "2.5": 10, "+Inf": 10},
    "falling": {"0.1": 2, "0.5": 6, "1": 5, "2.5": 9, "+Inf": 9},  # 1's count below 0.5's: forced up to it
    "spellings": {"0.1": 1, "1": 2, "1.0": 3, "+Inf": 8},  # "1" and "1.0": one bucket, counts added
    "no-inf": {"0.1": 1, "0.5": 3, "1": 4},  # no +Inf bucket: no quantile at all
    "late": {"0.1": (2, 60), "0.5": 3, "1": 7, "+Inf": 9},  # 0.1 starts half way: two bucket sets over the range
    "idle": {"0.1": 0, "0.5": 0, "+Inf": 0},  # no observations: no quantile
    "negative": {"-1": 3, "0": 5, "1": 6, "+Inf": 6},  # a rank in a lowest bucket bounded at or below zero
    "in-inf": {"0.1": 0, "0.5": 1, "+Inf": 20},  # ranks in the +Inf bucket: the highest finite bound
    "odd-le": {"0.1": 1, "abc": 50, "0.5": 5, "+Inf": 6},  # an le that is no number is skipped
}


def _openmetrics(end: float) -> str:
    lines = ["# TYPE t_seconds histogram"]
    for k in range(POINTS):
        ts = end - (POINTS - 1 - k) * STEP_S
        for instance, buckets in SHAPES.items():
            for le, shape in buckets.items():
                slope, first = shape if isinstance(shape, tuple) else (shape, 0)
                if k >= first:
                    # one more every third sample: the rates differ step to step, the quantiles with them (a counter
                    # never falls: a fall would be read as a restart)
                    value = slope * (k - first) + (k - first) // 3 * (slope > 0)
                    lines.append(f't_seconds_bucket{{instance="{instance}",le="{le}"}} {value} {ts:.0f}')
    lines.append("# EOF")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PromServer, float]]:
    require_prometheus()
    end = float(int(time.time()) // STEP_S * STEP_S - 600)  # inside the TSDB's retention, clear of the head block
    path: Path = tmp_path_factory.mktemp("quantiles") / "h.om"
    path.write_text(_openmetrics(end))
    with prometheus([], backfill=[path]) as server:
        yield server, end


def _range(server: PromServer, end: float, query: str) -> list:
    client = _LazyPrometheus(server.url, "", timeout_s=30)
    return client.range(query, end - (POINTS - 1) * STEP_S, end, STEP_S)


def test_each_quantile_is_the_stores_own_to_the_bit(store: tuple[PromServer, float]) -> None:
    server, end = store
    buckets = _range(server, end, f"sum by (le, instance) ({RATE})")
    assert {r.labels["instance"] for r in buckets} == set(SHAPES)  # every shape reached the store
    mine = quantile_results(buckets, QS)
    for q, results in zip(QS, mine, strict=True):
        theirs = {
            r.labels["instance"]: r for r in _range(server, end, f"histogram_quantile({q}, sum by (le, instance) ({RATE}))")
        }
        got = {r.labels["instance"]: r for r in results}
        assert set(got) == set(theirs), q  # the same series answer: none where the store has none
        for instance, res in theirs.items():
            np.testing.assert_array_equal(got[instance].ts, res.ts, err_msg=f"q={q} {instance}")
            assert got[instance].values.tolist() == res.values.tolist(), f"q={q} {instance}"  # exact, not close
            assert got[instance].labels == res.labels


def test_the_special_cases_are_met(store: tuple[PromServer, float]) -> None:
    """The cases above are not vacuous: each is in the data and gives what the store's rules say it gives."""
    server, end = store
    [p25, p50, p95, _] = [{r.labels["instance"]: r for r in rs} for rs in
                          quantile_results(_range(server, end, f"sum by (le, instance) ({RATE})"), QS)]  # fmt: skip
    assert "no-inf" not in p50 and "idle" not in p50  # no +Inf bucket, no observations: no quantile
    assert set(p50["in-inf"].values) == {0.5} and set(p95["in-inf"].values) == {0.5}  # the highest finite bound
    assert p50["negative"].values.min() == -1.0  # a rank in a lowest bucket bounded below zero: that bound
    assert p50["plain"].ts.size == POINTS - 1  # every step but the first (a rate needs two samples in its window)
    # Buckets that start late: before the 0.1 bucket the p25 is interpolated over 0..0.5 (0.34-0.38 here); with it,
    # from the 0.1 bound (0.095-0.125): two bucket sets over one range, each step with its own.
    late, half = p25["late"], end - (POINTS - 1 - 60) * STEP_S
    before, after = late.values[late.ts < half], late.values[late.ts >= half + 20]
    assert before.size and after.size and after.max() < 0.2 < before.min()
    # One bound however spelt: 1 + 2 + 3 of 8 observations at or below 1 puts the p50 inside 0.1..1, where the "1"
    # bucket alone (3 of 8 at or below 1) would put it in the +Inf bucket (1.0, the highest finite bound).
    assert 0.1 < p50["spellings"].values.max() < 1.0
