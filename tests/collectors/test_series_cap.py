"""The agent's cap on process and cgroup label values: which are kept, what the overflow series holds.

The choice and the folded counters are checked on their own and through the exporter's rendering of
snapshots; tests/collectors/test_series_cap_agent.py scrapes a real agent.
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from collectors.exporter import SnapshotCollector, exposition
from collectors.records import CgroupSnapshot, GpuProcess, GpuSnapshot, HostSnapshot, ProcessSample, WatchScope
from collectors.series_cap import OVERFLOW, FoldedCounters, SeriesCaps, choose
from collectors.snapshot import Snapshot

MiB = 1 << 20


def _proc(pid: int, rss_mib: float, faults: int = 0) -> ProcessSample:
    rss = int(rss_mib * MiB)
    return ProcessSample(ts=0.0, pid=pid, comm=f"w{pid}", rss_bytes=rss, pss_bytes=rss, uss_bytes=rss // 2,
                         swap_bytes=0, major_faults=faults)  # fmt: skip


def _group(path: str, ws_mib: float, oom_kills: int = 0, faults: int = 0) -> CgroupSnapshot:
    ws = int(ws_mib * MiB)
    return CgroupSnapshot(ts=0.0, path=path, version="v2", usage_bytes=ws + MiB, working_set_bytes=ws,
                          limit_bytes=4096 * MiB, events={"oom_kill": oom_kills}, stat={"pgmajfault": faults})  # fmt: skip


def _snap(procs: list[ProcessSample], groups: list[CgroupSnapshot] = (), scope: WatchScope | None = None,  # type: ignore[assignment]
          gpu: GpuSnapshot | None = None) -> Snapshot:  # fmt: skip
    return Snapshot(0.0, HostSnapshot(ts=0.0), list(groups), procs, gpu or GpuSnapshot(ts=0.0, available=False),
                    scope=scope)  # fmt: skip


def _series(collector: SnapshotCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in registry.collect() for s in fam.samples}


def _value(series: dict, name: str, **labels: str) -> float | None:  # type: ignore[type-arg]
    return series.get((name, tuple(sorted(labels.items()))))


def _pids(series: dict, name: str = "llmdiag_process_resident_memory_bytes") -> set[str]:  # type: ignore[type-arg]
    return {dict(lbl)["pid"] for n, lbl in series if n == name}


def test_choose_keeps_the_largest_and_every_key_under_the_cap() -> None:
    sizes = {1: 10.0, 2: 50.0, 3: 30.0, 4: 40.0}
    assert choose(sizes, (), 2, 0.25) == {2, 4}
    assert choose(sizes, (), 4, 0.25) == set(sizes)
    assert choose(sizes, (), 10, 0.25) == set(sizes)


def test_a_kept_key_gives_way_only_to_a_clearly_larger_newcomer() -> None:
    # 100 kept; a newcomer at 120 is within the 25 % margin: no churn
    assert choose({"a": 100.0, "b": 120.0}, {"a"}, 1, 0.25) == {"a"}
    # at 130 it is clearly larger: it takes the place
    assert choose({"a": 100.0, "b": 130.0}, {"a"}, 1, 0.25) == {"b"}
    # without hysteresis the larger one always wins
    assert choose({"a": 100.0, "b": 101.0}, {"a"}, 1, 0.0) == {"b"}


def test_pinned_keys_come_first_and_ties_do_not_depend_on_order() -> None:
    assert choose({1: 1.0, 2: 100.0, 3: 90.0}, (), 2, 0.25, pinned=[1]) == {1, 2}
    forward = choose({f"/g{i}": 5.0 for i in range(10)}, (), 3, 0.25)
    backward = choose({f"/g{i}": 5.0 for i in reversed(range(10))}, (), 3, 0.25)
    assert forward == backward == {"/g0", "/g1", "/g2"}


def test_folded_counters_never_go_down_when_members_come_and_go() -> None:
    folded = FoldedCounters()
    folded.observe({("f", 1): 10, ("f", 2): 100}, {1, 2})
    assert folded.totals["f"] == 0  # first sight adds nothing
    folded.observe({("f", 1): 15, ("f", 2): 130}, {1, 2})
    assert folded.totals["f"] == 35
    folded.observe({("f", 1): 20, ("f", 2): 1000}, {1})  # 2 is kept now: its growth is on its own series
    assert folded.totals["f"] == 40
    folded.observe({("f", 2): 1001}, {2})  # 1 exited; 2 folded again: only growth since last seen
    assert folded.totals["f"] == 41
    folded.observe({("f", 2): 3}, {2})  # a counter that went back (a reused pid) adds nothing
    assert folded.totals["f"] == 41
    folded.observe({("f", 2): 4, ("g", 9): 50}, {2})  # a family only kept members have: no overflow series for it
    assert "g" not in folded.totals and folded.totals["f"] == 42


def test_exporter_folds_the_smallest_processes_into_other() -> None:
    procs = [_proc(100 + i, 10 + i) for i in range(8)]  # 10 .. 17 MiB
    collector = SnapshotCollector(SeriesCaps(max_processes=3))
    collector.update(_snap(procs))
    series = _series(collector)
    assert _pids(series) == {"105", "106", "107", OVERFLOW}
    folded_rss = sum(p.rss_bytes or 0 for p in procs[:5])
    assert _value(series, "llmdiag_process_resident_memory_bytes", pid=OVERFLOW, comm=OVERFLOW) == folded_rss
    assert _value(series, "llmdiag_series_folded", kind="process") == 5
    assert _value(series, "llmdiag_series_folded", kind="cgroup") == 0
    assert _value(series, "llmdiag_series_overflow_total", kind="process") == 1
    every = {dict(lbl)["pid"] for n, lbl in series if n.startswith("llmdiag_process_")}
    assert every == {"105", "106", "107", OVERFLOW}


def test_no_overflow_series_under_the_cap() -> None:
    collector = SnapshotCollector(SeriesCaps(max_processes=8))
    collector.update(_snap([_proc(100 + i, 10 + i) for i in range(8)]))
    series = _series(collector)
    assert OVERFLOW not in _pids(series)
    assert _value(series, "llmdiag_series_folded", kind="process") == 0
    assert _value(series, "llmdiag_series_overflow_total", kind="process") == 0


def test_kept_processes_do_not_churn_when_sizes_wobble() -> None:
    collector = SnapshotCollector(SeriesCaps(max_processes=2))
    collector.update(_snap([_proc(1, 100), _proc(2, 99), _proc(3, 98)]))
    assert _pids(_series(collector)) == {"1", "2", OVERFLOW}
    for wobble in range(5):  # 3 overtakes 2 by a few percent, back and forth: the labels stay
        collector.update(_snap([_proc(1, 100), _proc(2, 98 + wobble % 2), _proc(3, 100 + wobble % 2)]))
        assert _pids(_series(collector)) == {"1", "2", OVERFLOW}
    collector.update(_snap([_proc(1, 100), _proc(2, 98), _proc(3, 200)]))  # 3 doubles: now it is shown
    assert _pids(_series(collector)) == {"1", "3", OVERFLOW}


def test_watched_pids_are_kept_whatever_their_size() -> None:
    scope = WatchScope(ts=0.0, pids=[7], resolved_pids=[7])
    collector = SnapshotCollector(SeriesCaps(max_processes=2))
    collector.update(_snap([_proc(7, 1), _proc(8, 500), _proc(9, 400)], scope=scope))
    assert _pids(_series(collector)) == {"7", "8", OVERFLOW}


def test_overflow_major_faults_stay_monotonic_as_membership_changes() -> None:
    collector = SnapshotCollector(SeriesCaps(max_processes=1))
    seen = []
    rounds = [
        [_proc(1, 100, 0), _proc(2, 10, 5), _proc(3, 20, 7)],
        [_proc(1, 100, 0), _proc(2, 10, 9), _proc(3, 20, 8)],  # +4 +1
        [_proc(1, 100, 0), _proc(3, 20, 30)],  # 2 exited: +22
        [_proc(1, 10, 0), _proc(3, 200, 31)],  # 3 kept now, 1 folded (first sight folded: +0)
        [_proc(1, 10, 6), _proc(3, 200, 32)],  # +6
    ]
    for procs in rounds:
        collector.update(_snap(procs))
        seen.append(_value(_series(collector), "llmdiag_process_major_faults_total", pid=OVERFLOW, comm=OVERFLOW))
    assert seen == [0, 5, 27, 27, 33]


def test_cgroups_fold_with_summed_memory_and_counters_and_no_summed_limit() -> None:
    collector = SnapshotCollector(SeriesCaps(max_cgroups=2))
    groups = [_group(f"/svc/{i}", 100 * (i + 1), oom_kills=1, faults=10) for i in range(5)]
    collector.update(_snap([], groups))
    later = [_group(f"/svc/{i}", 100 * (i + 1), oom_kills=2, faults=15) for i in range(5)]
    collector.update(_snap([], later))
    series = _series(collector)
    shown = {dict(lbl)["cgroup"] for n, lbl in series if n == "llmdiag_cgroup_memory_working_set_bytes"}
    assert shown == {"/svc/3", "/svc/4", OVERFLOW}
    assert _value(series, "llmdiag_cgroup_memory_working_set_bytes", cgroup=OVERFLOW) == 600 * MiB  # 100+200+300
    assert _value(series, "llmdiag_cgroup_memory_limit_bytes", cgroup=OVERFLOW) is None
    assert _value(series, "llmdiag_cgroup_memory_events_total", cgroup=OVERFLOW, event="oom_kill", scope="hierarchical") == 3
    assert _value(series, "llmdiag_cgroup_memory_pgmajfault_total", cgroup=OVERFLOW) == 15
    assert _value(series, "llmdiag_cgroup_pressure_memory_stalled_seconds_total", cgroup=OVERFLOW) is None  # none has PSI
    assert _value(series, "llmdiag_series_folded", kind="cgroup") == 3
    assert _value(series, "llmdiag_series_overflow_total", kind="cgroup") == 2


def test_gpu_processes_fold_with_their_process() -> None:
    gpu = GpuSnapshot(ts=0.0, available=True, processes=[GpuProcess(gpu_index=0, pid=1, used_bytes=5 * MiB),
                                                         GpuProcess(gpu_index=0, pid=2, used_bytes=7 * MiB),
                                                         GpuProcess(gpu_index=0, pid=99, used_bytes=1 * MiB)])  # fmt: skip
    collector = SnapshotCollector(SeriesCaps(max_processes=1))
    collector.update(_snap([_proc(1, 100), _proc(2, 10)], gpu=gpu))
    series = _series(collector)
    pids = {dict(lbl)["pid"]: v for (n, lbl), v in series.items() if n == "llmdiag_gpu_process_memory_bytes"}
    assert pids == {"1": 5 * MiB, OVERFLOW: 7 * MiB, "99": 1 * MiB}  # 99 is not a sampled process: never folded


def test_once_exposition_honours_the_caps() -> None:
    text = exposition(_snap([_proc(100 + i, 10 + i) for i in range(6)]), SeriesCaps(max_processes=2)).decode()
    pids = {s.labels["pid"] for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "llmdiag_process_resident_memory_bytes"}  # fmt: skip
    assert pids == {"104", "105", OVERFLOW}


def test_a_cap_below_one_is_refused_in_one_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from diag.cli.main import app

    for option in ("--max-processes", "--max-cgroups"):
        result = CliRunner().invoke(app, ["collect", option, "0", "--recorder", str(tmp_path / "r.db")])
        assert result.exit_code == 2, result.output
        assert f"{option} 0: at least 1" in result.stderr and "Traceback" not in result.stderr
        assert not (tmp_path / "r.db").exists()  # refused before the recorder was made
