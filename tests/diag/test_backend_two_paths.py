"""The same backend samples through both paths: the agent's recorded scrapes and a real Prometheus give one set of signals.

For each dialect (vLLM, TGI, llama.cpp, our tracker) a host's exposition is rendered every second for five
minutes, under three phases of load, from the families ``collectors.backends`` declares (names, types, labels,
buckets). The recorder path takes each exposition through the scrape (``TargetScraper.from_text``: parse, sum
away labels, bucket deltas) into a real flight recorder and ``load_recorder``; the Prometheus path writes the
very same samples, with their times, into a real Prometheus (``promtool tsdb create-blocks-from openmetrics``)
and runs ``load_prometheus`` on it. Both must fill the same ``service:`` keys, and agree on their values
(after the first rate window, where Prometheus extrapolates to before the first sample).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from collectors import backends as bk
from collectors.recorder import FlightRecorder
from collectors.scrape import TargetScraper
from diag.sources.prometheus import load_prometheus
from diag.sources.recorder import load_recorder
from diag.timeline import Timeline
from tests.promserver import prometheus, require_prometheus

pytestmark = pytest.mark.process

STEPS = 300
PHASE = 100
LABEL_VALUES = {  # values of the labels each dialect's families carry
    "model_name": ("m",), "engine": ("0", "1"), "finished_reason": ("stop", "length", "abort"),
    "reason": ("capacity", "deferred"), "err": ("overloaded", "validation", "generation", "dropped"),
    "method": ("prefill", "decode"), "route": ("/v1/completions",), "model": ("m",),
    "outcome": ("ok", "error", "queue_timeout", "inference_timeout", "rejected"),
}  # fmt: skip
RUNTIME_BUCKETS = (1.0, 10.0, 100.0, 1000.0, 10000.0)  # for histograms whose buckets the server sets at run time


def _start() -> float:
    """Five-minute-aligned, an hour ago: inside Prometheus' retention and before its head block."""
    import time

    return float(int(time.time() - 3600) // 300 * 300)


@dataclass
class Host:
    """A backend of one dialect: its families' state, advanced a second at a time."""

    dialect: str
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(7))
    values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)
    hists: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]] = field(default_factory=dict)

    def families(self) -> list[bk.Family]:
        return [f for f in bk.families_of(self.dialect) if f.name in bk.SCRAPED and f.type != "summary"]  # type: ignore[arg-type]

    @staticmethod
    def label_sets(fam: bk.Family) -> list[tuple[tuple[str, str], ...]]:
        sets: list[tuple[tuple[str, str], ...]] = [()]
        for label in fam.labels:
            sets = [(*s, (label, v)) for s in sets for v in LABEL_VALUES[label]]
        return sets

    def step(self, i: int) -> None:
        phase = i // PHASE
        load = (1.0, 3.0, 6.0)[phase]
        for fam in self.families():
            buckets = fam.buckets or RUNTIME_BUCKETS
            for n, labels in enumerate(self.label_sets(fam)):
                key = (fam.name, labels)
                if fam.type == "gauge":
                    self.values[key] = (
                        round(load * (1 + n) + (i % 7) * 0.5, 3)
                        if "usage" not in fam.name
                        else min(1.0, 0.3 + 0.2 * phase + 0.01 * (i % 5) + 0.02 * n)
                    )
                elif fam.type == "counter":
                    self.values[key] = self.values.get(key, 0.0) + float(self.rng.poisson(4 * load * (1 + n)))
                else:
                    cum = self.hists.setdefault(key, [0.0] * (len(buckets) + 2))  # buckets, +Inf, sum
                    scale = buckets[len(buckets) // 2] * (0.3 + 0.5 * phase)
                    for v in self.rng.lognormal(math.log(scale), 0.6, int(self.rng.poisson(3 * load))):
                        for j, le in enumerate(buckets):
                            if v <= le:
                                cum[j] += 1
                        cum[len(buckets)] += 1
                        cum[-1] += float(v)

    def samples(self) -> Iterator[tuple[str, dict[str, str], float]]:
        for fam in self.families():
            buckets = fam.buckets or RUNTIME_BUCKETS
            for labels in self.label_sets(fam):
                key = (fam.name, labels)
                lb = dict(labels)
                if fam.type in ("gauge", "counter"):
                    if key in self.values:
                        yield fam.name, lb, self.values[key]
                    continue
                cum = self.hists.get(key)
                if cum is None:
                    continue
                for j, le in enumerate(buckets):
                    yield fam.name + "_bucket", {**lb, "le": repr(float(le))}, cum[j]
                yield fam.name + "_bucket", {**lb, "le": "+Inf"}, cum[len(buckets)]
                yield fam.name + "_sum", lb, round(cum[-1], 6)
                yield fam.name + "_count", lb, cum[len(buckets)]

    def exposition(self) -> bytes:
        """The classic text format, with each family's name exactly as declared (TGI's counters without _total)."""
        lines = []
        by_family: dict[str, list[str]] = {}
        types = {f.name: f.type for f in self.families()}
        for name, labels, value in self.samples():
            family = next(f for f in types if name == f or name.startswith(f + "_"))
            inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
            by_family.setdefault(family, []).append(f"{name}{{{inner}}} {value!r}" if inner else f"{name} {value!r}")
        for family, rows in by_family.items():
            lines += [f"# TYPE {family} {types[family]}", *rows]
        return ("\n".join(lines) + "\n").encode()


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


@dataclass
class Run:
    recorder: Timeline
    prometheus: Timeline
    start: float


def _openmetrics(series: dict[tuple[str, tuple[tuple[str, str], ...]], list[tuple[float, float]]], path: Path) -> None:
    """Every sample with its time, as OpenMetrics (each sample name its own ``unknown`` family) for promtool."""
    with path.open("w") as fh:
        names = sorted({name for name, _ in series})
        for name in names:
            fh.write(f"# TYPE {name} unknown\n")
            for (n, labels), points in series.items():
                if n != name:
                    continue
                inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
                head = f"{name}{{{inner}}}" if inner else name
                fh.writelines(f"{head} {v!r} {t:.3f}\n" for t, v in points)
        fh.write("# EOF\n")


@pytest.fixture(scope="module", params=["vllm", "tgi", "llamacpp", "llmdiag"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    require_prometheus()
    dialect = request.param
    work = tmp_path_factory.mktemp(f"two-paths-{dialect}")
    start = _start()
    host = Host(dialect)
    scraper = TargetScraper(f"http://127.0.0.1:9/{dialect}")
    series: dict[tuple[str, tuple[tuple[str, str], ...]], list[tuple[float, float]]] = {}
    rows = []
    for i in range(STEPS):
        ts = start + i
        host.step(i)
        record = scraper.from_text(ts, host.exposition())
        assert record.up, record.error
        rows.append((ts, record.KIND, record.SCHEMA, record.to_json()))
        for name, labels, value in host.samples():
            series.setdefault((name, tuple(sorted(labels.items()))), []).append((ts, value))
    with FlightRecorder(work / "rec.db") as rec:
        rec.write_rows(rows)
    recorded = load_recorder(work / "rec.db")
    om = work / "backfill.om"
    _openmetrics(series, om)
    with prometheus([], backfill=[om]) as prom:
        prom_tl = load_prometheus(prom.url, since_s=STEPS - 1, until=start + STEPS - 1, step_s=1.0)
    assert json.loads(record.to_json())["dialect"] == dialect
    yield Run(recorded, prom_tl, start)


EXPECTED = {
    "vllm": {"queue_wait_p50_s", "queue_wait_p95_s", "queue_wait_mean_s", "inference_p95_s", "e2e_p50_s", "prefill_p50_s",
             "decode_mean_s", "ttft_p95_s", "itl_p50_s", "requests_waiting", "requests_running", "requests_waiting_capacity",
             "kv_cache_usage_ratio", "preemptions_rps", "prefix_cache_hit_ratio", "prompt_tokens_rps",
             "generation_tokens_rps", "throughput_rps", "queue_depth", "active_inferences"},
    "tgi": {"queue_wait_p50_s", "inference_p95_s", "e2e_mean_s", "itl_p50_s", "requests_waiting", "requests_running",
            "requests_rps", "throughput_rps", "error_rps", "rejected_rps", "prompt_tokens_rps", "generation_tokens_rps"},
    "llamacpp": {"requests_waiting", "requests_running", "prompt_tokens_rps", "generation_tokens_rps", "itl_mean_s"},
    "llmdiag": {"queue_wait_p50_s", "inference_mean_s", "e2e_p95_s", "ttft_p50_s", "requests_rps", "throughput_rps",
                "error_rps", "timeout_rps", "rejected_rps", "requests_waiting", "requests_running", "queue_depth"},
}  # fmt: skip


def test_both_paths_fill_the_same_signals(run: Run, request: pytest.FixtureRequest) -> None:
    dialect = request.node.callspec.params["run"]
    assert set(run.recorder.service) == set(run.prometheus.service)
    assert EXPECTED[dialect] <= set(run.recorder.service), sorted(EXPECTED[dialect] - set(run.recorder.service))


def test_both_paths_agree_on_every_value(run: Run) -> None:
    """Equal, not close: the same samples, the same windows, the same interpolation -- except in the first window,
    where Prometheus extrapolates a rate to a range that reaches back before the first sample."""
    for key, mine in run.recorder.service.items():
        theirs = run.prometheus.service[key]
        common, i_mine, i_theirs = np.intersect1d(np.round(mine.ts, 3), np.round(theirs.ts, 3), return_indices=True)
        keep = common - run.start > 4
        assert keep.sum() > STEPS * 0.9, f"{key}: only {keep.sum()} common steps"
        np.testing.assert_allclose(mine.values[i_mine][keep], theirs.values[i_theirs][keep], rtol=1e-6, atol=1e-9,
                                   err_msg=key)  # fmt: skip


def test_a_gauge_is_the_same_number_on_both_paths(run: Run) -> None:
    for key in ("requests_waiting", "requests_running", "kv_cache_usage_ratio"):
        if key not in run.recorder.service:
            continue
        mine, theirs = run.recorder.service[key], run.prometheus.service[key]
        common, i_mine, i_theirs = np.intersect1d(np.round(mine.ts, 3), np.round(theirs.ts, 3), return_indices=True)
        assert common.size >= STEPS - 2
        np.testing.assert_allclose(mine.values[i_mine], theirs.values[i_theirs], rtol=1e-9)


def test_the_recorder_keeps_the_scrapes_own_series(run: Run) -> None:
    (target,) = run.recorder.backends
    up = run.recorder.backends[target]["up"]
    assert len(up) == STEPS and float(up.values.min()) == 1.0
