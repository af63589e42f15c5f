"""Timeline building from records, the recorder and a bundle directory; Series arithmetic."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pytest

from collectors.recorder import FlightRecorder
from collectors.records import (
    CgroupSnapshot,
    HostSnapshot,
    LoaderEvent,
    OomEvent,
    ProcessSample,
    Psi,
    PsiLine,
    RequestTiming,
    ServiceConfig,
)
from diag.sources import load_bundle, load_recorder
from diag.timeline import Series, timeline_from_records


def _records(t0: float) -> list:
    out = []
    for i in range(10):
        ts = t0 + i
        out.append(
            HostSnapshot(
                ts=ts,
                psi={"memory": Psi(some=PsiLine(1.0 * i, 0.5, 0.1, 1000 * i), full=PsiLine(0.5, 0.2, 0.0, 500 * i))},
                memory={"total": 1000, "available": 900 - i},
                vmstat={"pgmajfault": 10 * i},
            )
        )
        out.append(CgroupSnapshot(ts=ts, path="/svc", version="v1", usage_bytes=100 + i, limit_bytes=None, events={"max": i}))
        out.append(ProcessSample(ts=ts, pid=42, comm="python", start_time_s=5.0, rss_bytes=1 << 20, model_files=["/m.gguf"]))
    out.append(RequestTiming(ts=t0 + 3, arrival=t0 + 1, start=t0 + 2, finish=t0 + 3, outcome="ok", prompt_tokens=5))
    out.append(RequestTiming(ts=t0 + 4, arrival=t0 + 2, start=None, finish=t0 + 4, outcome="rejected"))
    out.append(LoaderEvent(ts=t0 + 2, name="ckpt", start=t0 + 1.5, duration_s=0.5, in_request_path=True))
    out.append(OomEvent(ts=t0 + 5, constraint="CONSTRAINT_MEMCG", pid=7, task="python"))
    out.append(ServiceConfig(ts=t0, service="demo", settings={"workers": 4}))
    return out


def test_records_become_columns() -> None:
    t0 = 1_000_000.0
    tl = timeline_from_records(r.to_dict() for r in _records(t0))
    assert tl.start == t0 and tl.end == t0 + 9
    assert np.array_equal(tl.host["memory.available"].values, 900 - np.arange(10.0))
    assert tl.host["psi.memory.some.total_s"].values[-1] == pytest.approx(0.009)
    assert tl.host["psi.memory.full.avg10"].values[0] == 0.5
    assert tl.cgroups["/svc"]["events.max"].increase() == 9
    track = next(iter(tl.processes.values()))
    assert track.pid == 42 and track.model_files == {"/m.gguf"} and len(track.series["rss"]) == 10
    req = tl.requests
    assert len(req) == 2
    assert req["queue_wait_s"][0] == 1.0 and math.isnan(req["queue_wait_s"][1])
    assert list(req["outcome"]) == ["ok", "rejected"]
    assert tl.loader["in_request_path"][0] == 1.0
    assert tl.ooms[0].constraint == "CONSTRAINT_MEMCG" and tl.configs[0].settings == {"workers": 4}
    signals = tl.signals()
    for name in ("host:memory.available", "cgroup:events.max", "processes", "process:model_files", "requests", "loader",
                 "ooms", "config"):  # fmt: skip
        assert name in signals, name
    assert "routing" not in signals and "torch" not in signals


def test_bad_rows_are_counted_not_fatal() -> None:
    from diag.timeline import TimelineBuilder

    b = TimelineBuilder()
    b.add_json("{not json", "host")
    b.add_json('{"kind": "martian", "ts": 1}', "martian")
    b.add_json('{"kind": "process", "ts": 1}', "process")  # no pid
    b.add_json(HostSnapshot(ts=2.0, memory={"total": 5}).to_json(), "host")
    tl = b.build()
    assert tl.counts == {"host": 1}
    assert tl.skipped == {"host": 1, "martian": 1, "process": 1}


def test_series_rate_and_increase_handle_resets() -> None:
    s = Series(np.array([0.0, 1.0, 2.0, 3.0]), np.array([10.0, 20.0, 5.0, 15.0]))
    assert s.increase() == 10 + 5 + 10
    r = s.rate()
    assert r.values[0] == 10 and math.isnan(r.values[1]) and r.values[2] == 10
    assert len(s.window(1.0, 2.0)) == 2


def test_recorder_and_bundle_loaders_agree(tmp_path: Path) -> None:
    now = time.time()
    records = _records(now - 20)
    with FlightRecorder(tmp_path / "r.db") as rec:
        rec.write(records)
        rec.write([HostSnapshot(ts=now - 7200, memory={"total": 1})])  # outside --since
    from_recorder = load_recorder(tmp_path / "r.db", since_s=3600)
    bundle = tmp_path / "bundle" / "timeline"
    bundle.mkdir(parents=True)
    by_kind: dict[str, list[str]] = {}
    for r in records:
        by_kind.setdefault(r.KIND, []).append(r.to_json())
    for kind, lines in by_kind.items():
        (bundle / f"{kind}.jsonl").write_text("\n".join(lines) + "\n")
    (bundle / "host.jsonl").open("a").write("garbage line\n")
    from_bundle = load_bundle(tmp_path / "bundle")
    assert from_recorder.counts == from_bundle.counts
    assert from_bundle.skipped == {"host": 1}
    assert np.array_equal(from_recorder.host["memory.available"].values, from_bundle.host["memory.available"].values)
    assert from_recorder.start == pytest.approx(now - 20)
    with pytest.raises(FileNotFoundError, match="not an llm-diag bundle"):
        load_bundle(tmp_path)


def test_the_watch_scope_in_force_before_the_window_is_kept(tmp_path: Path) -> None:
    """The agent writes a watch scope at start-up and on change only: a later window must still know it."""
    from collectors.records import HostSnapshot, WatchScope

    now = time.time()
    path = tmp_path / "r.db"
    with FlightRecorder(path) as fr:
        fr.write([WatchScope(ts=now - 3600, cgroups=["/svc"], resolved_cgroups=["/svc"])])
        fr.write([HostSnapshot(ts=now - 30 + i) for i in range(10)])
    tl = load_recorder(path, since_s=60)
    assert [w.cgroups for w in tl.watch_scopes] == [["/svc"]]
    assert tl.start >= now - 31  # the scope states a configuration: it does not stretch the window
    assert load_recorder(path, since_s=60 * 60 * 2).watch_scopes[0].resolved_cgroups == ["/svc"]


def test_whole_series_go_through_the_builder_like_records() -> None:
    """A source of series (Prometheus) hands the builder whole series, tracks, rows and records; the window is where
    the series have data, else the window the source asked for."""
    from collectors.records import OomEvent
    from diag.timeline import TimelineBuilder

    empty = TimelineBuilder(source="series", window=(0.0, 100.0)).build()
    assert (empty.start, empty.end) == (0.0, 100.0)  # nothing observed: the query window
    b = TimelineBuilder(source="series", window=(0.0, 100.0))
    b.add_track("7@python", 7, None, comm="python")
    b.add_series("processes", "7@python", "rss", Series(np.array([10.0, 20.0]), np.array([1.0, 2.0])))
    b.add_series("service", None, "queue_depth", Series(np.array([5.0, 30.0]), np.array([0.0, 3.0])))
    b.add_rows("gpu_processes", {"ts": np.array([40.0, 35.0]), "gpu": np.zeros(2), "pid": np.full(2, 7.0),
                                 "used_bytes": np.array([1.0, 2.0])})  # fmt: skip
    b.keep("ooms", [OomEvent(ts=90.0), OomEvent(ts=50.0)])
    b.mark_unavailable("gpus", "no NVML")
    tl = b.build()
    assert (tl.start, tl.end) == (5.0, 30.0)  # rows and kept records do not stretch it; series do
    assert tl.processes["7@python"].comm == "python" and tl.processes["7@python"].series["rss"].values.tolist() == [1, 2]
    assert tl.gpu_processes["ts"].tolist() == [35.0, 40.0] and [o.ts for o in tl.ooms] == [50.0, 90.0]
    assert tl.gpu_unavailable_reason == "no NVML" and tl.counts == {}
    with pytest.raises(KeyError, match="add_track"):
        b.add_series("processes", "8@x", "rss", Series(np.array([1.0]), np.array([1.0])))
    with pytest.raises(KeyError, match="scope"):
        b.add_series("disks", None, "x", Series(np.array([1.0]), np.array([1.0])))
    with pytest.raises(RuntimeError, match="builds one"):
        b.build()  # its pieces are gone: a second Timeline would be empty, so it refuses


def test_no_source_assembles_a_timeline_itself() -> None:
    """Every source goes through ``TimelineBuilder``: none constructs a Timeline, a track or a table on its own."""
    import ast

    import diag.sources

    folder = Path(diag.sources.__file__).parent
    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            called = node.func.id if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) else None
            if called in ("Timeline", "ProcessTrack", "Table"):
                found.append(f"{path.name}:{node.lineno} {called}(...)")
    assert found == []
    assert "TimelineBuilder" in (folder / "prometheus.py").read_text()  # the check reads real code (not vacuous)


def test_sources_and_the_timeline_import_nothing_above_them() -> None:
    """Records flow up: the Timeline and its sources sit below the rules, the bundle, the triage and the demo."""
    import ast

    from tests.paths import REPO

    above = ("diag.bundle", "diag.rules", "diag.triage", "diag.demo", "diag.cli")
    found = []
    for folder in ("diag/sources", "diag/timeline"):
        for path in sorted((REPO / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
                found += [f"{folder}/{path.name} imports {n}" for n in names if n.startswith(above)]
    assert found == []


def test_only_a_large_build_hands_memory_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Handing freed pages back costs a walk of the heap and page faults later: worth it for a day, not for the live
    diagnosis's few minutes every 15 s."""
    import diag.timeline.builder as builder_module
    from diag.timeline import TimelineBuilder

    calls: list[int] = []
    monkeypatch.setattr(builder_module, "give_back_freed_memory", lambda: calls.append(1))
    records = [r.to_dict() for r in _records(1_000_000.0)]

    def build() -> None:
        b = TimelineBuilder()
        for obj in records:
            b.add(obj)
        b.build()

    build()
    assert calls == []
    monkeypatch.setattr(builder_module, "TRIM_FROM_ROWS", len(records))
    build()
    assert len(calls) >= 3  # after each group of series, each table, and once at the end
