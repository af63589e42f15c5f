"""Queue vs thrash from aggregated histograms (the Prometheus path): recorded runs folded into per-step means."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from diag.demo.scenarios.recording import read_jsonl_gz
from diag.rules.aggregated import queue_vs_thrash
from diag.rules.base import Finding, TooLittleData
from diag.rules.engine import analyze
from diag.timeline import Series, Table, Timeline, timeline_from_records

SCENARIOS = Path(__file__).resolve().parents[1] / "fixtures" / "scenarios"
STEP_S = 5.0


def _as_fleet(name: str) -> Timeline:
    """The recorded run as Prometheus would hold it: per-step mean queue wait and inference time, no rows."""
    tl = timeline_from_records(read_jsonl_gz(SCENARIOS / f"{name}.jsonl.gz"), source=name)
    req = tl.requests
    ok = np.isfinite(req["start"]) & np.isfinite(req["finish"])
    finish, wait, infer = req["finish"][ok], req["queue_wait_s"][ok], req["inference_s"][ok]
    edges = np.arange(tl.start, tl.end + STEP_S, STEP_S)
    idx = np.digitize(finish, edges)
    steps = [i for i in np.unique(idx) if (idx == i).sum() >= 2]
    ts = np.array([edges[i - 1] + STEP_S for i in steps])
    tl.service = {
        "queue_wait_mean_s": Series(ts, np.array([wait[idx == i].mean() for i in steps])),
        "inference_mean_s": Series(ts, np.array([infer[idx == i].mean() for i in steps])),
        "inference_p50_s": Series(ts, np.array([np.median(infer[idx == i]) for i in steps])),
    }
    for table in ("requests", "batches", "loader", "routing"):
        setattr(tl, table, Table())
    tl.configs = []
    return tl


def test_queue_run_from_histograms_is_a_backlog() -> None:
    tl = _as_fleet("queue")
    f = queue_vs_thrash(tl)
    assert isinstance(f, Finding) and f.cls == "queue_backlog" and f.confidence >= 0.6, f
    assert analyze(tl).primary == "queue_backlog"


def test_thrash_run_from_histograms_is_thrashing() -> None:
    tl = _as_fleet("thrash")
    f = queue_vs_thrash(tl)
    assert isinstance(f, Finding) and f.cls == "thrashing" and f.confidence >= 0.6, f
    assert analyze(tl).primary == "thrashing"


def test_healthy_run_from_histograms_finds_nothing() -> None:
    tl = _as_fleet("healthy")
    assert queue_vs_thrash(tl) is None
    assert analyze(tl).primary == "healthy"


def test_a_few_steps_are_too_little_data() -> None:
    tl = _as_fleet("queue")
    tl.service = {k: Series(s.ts[:3], s.values[:3]) for k, s in tl.service.items()}
    assert queue_vs_thrash(tl) == TooLittleData(have="3 steps with requests", needed="5 steps with requests")


def test_a_wait_that_dwarfs_a_doubled_inference_is_a_backlog_from_histograms() -> None:
    """The queue run with its busy steps' inference doubled (CPU shared with the HTTP work), memory calm: the wait
    is still many times the inference time -- a backlog with a contributing slowdown, not a suspect."""
    tl = _as_fleet("queue")
    wait, infer = tl.service["queue_wait_mean_s"], tl.service["inference_mean_s"]
    busy = wait.values >= np.quantile(wait.values, 0.5)
    slowed = np.where(busy, infer.values * 2.0, infer.values)
    tl.service = {**tl.service, "inference_mean_s": Series(infer.ts, slowed), "inference_p50_s": Series(infer.ts, slowed)}
    f = queue_vs_thrash(tl)
    assert isinstance(f, Finding) and f.cls == "queue_backlog" and f.confidence >= 0.5, f
    assert "contributing slowdown" in f.summary
    assert analyze(tl).primary == "queue_backlog"
