"""Prometheus exposition of the latest snapshot, with every family built from the catalog.

A custom ``Collector`` (not long-lived Gauge objects) because the set of series follows the host:
processes come and go, cgroups appear, a GPU may vanish. Each scrape renders the latest snapshot
afresh, so a process that exited leaves no stale series behind. Cumulative kernel counters are
passed through as counters (never turned into deltas), following node_exporter and cAdvisor.

The process and cgroup label values are capped (``collectors.series_cap``): beyond the cap, the
smallest are folded into one ``pid="other"`` / ``cgroup="other"`` series, so a host's series count
has a bound whatever runs on it. The flight recorder still gets every sampled process and group.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from collectors import catalog as cat
from collectors.catalog import MetricSpec
from collectors.records import CgroupSnapshot, GpuSnapshot, HostSnapshot, OomEvent, ProcessSample, WatchScope
from collectors.series_cap import OVERFLOW, FoldedCounters, SeriesCaps, choose
from collectors.snapshot import Snapshot

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def family(spec: MetricSpec) -> GaugeMetricFamily | CounterMetricFamily:
    """An empty metric family for a catalog entry; labels come from the catalog too."""
    if spec.type == "counter":
        return CounterMetricFamily(spec.name, spec.help, labels=list(spec.labels))
    if spec.type == "gauge":
        return GaugeMetricFamily(spec.name, spec.help, labels=list(spec.labels))
    raise ValueError(f"{spec.name}: the snapshot exporter only renders gauges and counters")


class _Families:
    """Families created on first use, emitted in catalog order, only when they hold a sample."""

    def __init__(self) -> None:
        self._by_name: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

    def add(self, spec: MetricSpec, value: float | int | None, labels: Iterable[str] = ()) -> None:
        if value is None:
            return
        fam = self._by_name.get(spec.name)
        if fam is None:
            fam = self._by_name[spec.name] = family(spec)
        fam.add_metric(list(labels), float(value))

    def emit(self) -> Iterator[Metric]:
        yield from self._by_name.values()


def host_metrics(out: _Families, host: HostSnapshot) -> None:
    for resource, psi in host.psi.items():
        if psi.some is not None and resource in cat.HOST_PSI_WAITING:
            out.add(cat.HOST_PSI_WAITING[resource], psi.some.total_us / 1e6)
            out.add(cat.HOST_PSI_AVG10, psi.some.avg10 / 100.0, (resource, "some"))
        if psi.full is not None and resource in cat.HOST_PSI_STALLED:
            out.add(cat.HOST_PSI_STALLED[resource], psi.full.total_us / 1e6)
            out.add(cat.HOST_PSI_AVG10, psi.full.avg10 / 100.0, (resource, "full"))
    for name, value in host.memory.items():
        spec = cat.HOST_MEMORY.get(name)
        if spec is not None:
            out.add(spec, value)
    for name, value in host.vmstat.items():
        spec = cat.HOST_VMSTAT.get(name)
        if spec is not None:
            out.add(spec, value)


def cgroup_metrics(out: _Families, cg: CgroupSnapshot) -> None:
    lbl = (cg.path,)
    out.add(cat.CGROUP_USAGE, cg.usage_bytes, lbl)
    out.add(cat.CGROUP_WORKING_SET, cg.working_set_bytes, lbl)
    out.add(cat.CGROUP_LIMIT, cg.limit_bytes, lbl)
    out.add(cat.CGROUP_HIGH, cg.high_bytes, lbl)
    out.add(cat.CGROUP_PEAK, cg.peak_bytes, lbl)
    out.add(cat.CGROUP_SWAP, cg.swap_bytes, lbl)
    for key, spec in cat.CGROUP_STAT_BYTES.items():
        out.add(spec, cg.stat.get(key), lbl)
    for key, spec in cat.CGROUP_STAT_COUNTERS.items():
        out.add(spec, cg.stat.get(key), lbl)
    for event, value in sorted(cg.events.items()):
        out.add(cat.CGROUP_EVENTS, value, (cg.path, event, "hierarchical"))
    for event, value in sorted(cg.events_local.items()):
        out.add(cat.CGROUP_EVENTS, value, (cg.path, event, "local"))
    if cg.under_oom is not None:
        out.add(cat.CGROUP_UNDER_OOM, int(cg.under_oom), lbl)
    if cg.pressure is not None:
        if cg.pressure.some is not None:
            out.add(cat.CGROUP_PSI_WAITING, cg.pressure.some.total_us / 1e6, lbl)
        if cg.pressure.full is not None:
            out.add(cat.CGROUP_PSI_STALLED, cg.pressure.full.total_us / 1e6, lbl)


def _sum(values: Iterable[int | float | None]) -> float | None:
    """The total of the values present; None when none is (the series is then left out, as for one process)."""
    present = [v for v in values if v is not None]
    return float(sum(present)) if present else None


def process_metrics(
    out: _Families, processes: Iterable[ProcessSample], model_counts: dict[str, int],
    kept: set[int] | None = None, folded_faults: float | None = None,
) -> None:  # fmt: skip
    """One labelled series per kept process (``kept`` None: all), the others summed into ``pid="other"``.

    The overflow's major faults are ``folded_faults``, a monotonic total (``FoldedCounters``), not a sum."""
    shown = [p for p in processes if kept is None or p.pid in kept]
    folded = [p for p in processes if kept is not None and p.pid not in kept]
    for p in shown:
        lbl = (str(p.pid), p.comm)
        out.add(cat.PROCESS_RSS, p.rss_bytes, lbl)
        out.add(cat.PROCESS_PSS, p.pss_bytes, lbl)
        out.add(cat.PROCESS_USS, p.uss_bytes, lbl)
        out.add(cat.PROCESS_SWAP, p.swap_bytes, lbl)
        out.add(cat.PROCESS_MAJOR_FAULTS, p.major_faults, lbl)
    if folded:
        lbl = (OVERFLOW, OVERFLOW)
        out.add(cat.PROCESS_RSS, _sum(p.rss_bytes for p in folded), lbl)
        out.add(cat.PROCESS_PSS, _sum(p.pss_bytes for p in folded), lbl)
        out.add(cat.PROCESS_USS, _sum(p.uss_bytes for p in folded), lbl)
        out.add(cat.PROCESS_SWAP, _sum(p.swap_bytes for p in folded), lbl)
        out.add(cat.PROCESS_MAJOR_FAULTS, folded_faults, lbl)
    for model, count in sorted(model_counts.items()):  # every holder counted, folded ones too
        out.add(cat.MODEL_PROCESSES, count, (model,))
    for p in shown:  # bounded as the process series are: the kept processes that hold a model file
        for model in sorted(set(p.model_files)):
            out.add(cat.MODEL_PROCESS_INFO, 1, (model, str(p.pid), p.comm))


def folded_cgroup_metrics(out: _Families, folded: list[CgroupSnapshot], counters: dict[object, float]) -> None:
    """The groups beyond the cap as one ``cgroup="other"`` series: memory summed, counters from ``FoldedCounters``.

    Limits, memory.high and peaks are left out: a sum of limits limits nothing."""
    lbl = (OVERFLOW,)
    out.add(cat.CGROUP_USAGE, _sum(cg.usage_bytes for cg in folded), lbl)
    out.add(cat.CGROUP_WORKING_SET, _sum(cg.working_set_bytes for cg in folded), lbl)
    out.add(cat.CGROUP_SWAP, _sum(cg.swap_bytes for cg in folded), lbl)
    for key, spec in cat.CGROUP_STAT_BYTES.items():
        out.add(spec, _sum(cg.stat.get(key) for cg in folded), lbl)
    for fam, total in sorted(counters.items(), key=str):
        kind, *rest = fam if isinstance(fam, tuple) else (fam,)
        if kind == "stat":
            out.add(cat.CGROUP_STAT_COUNTERS[rest[0]], total, lbl)
        elif kind == "events":
            out.add(cat.CGROUP_EVENTS, total, (OVERFLOW, rest[0], rest[1]))
        elif kind == "psi_some":
            out.add(cat.CGROUP_PSI_WAITING, total, lbl)
        elif kind == "psi_full":
            out.add(cat.CGROUP_PSI_STALLED, total, lbl)
    under = [int(cg.under_oom) for cg in folded if cg.under_oom is not None]
    if under:
        out.add(cat.CGROUP_UNDER_OOM, max(under), lbl)


def cgroup_counters(cg: CgroupSnapshot) -> dict[object, float]:
    """A group's cumulative counters, keyed as ``folded_cgroup_metrics`` reads them back."""
    out: dict[object, float] = {}
    for key in cat.CGROUP_STAT_COUNTERS:
        if cg.stat.get(key) is not None:
            out[("stat", key)] = float(cg.stat[key])
    for event, value in cg.events.items():
        out[("events", event, "hierarchical")] = float(value)
    for event, value in cg.events_local.items():
        out[("events", event, "local")] = float(value)
    if cg.pressure is not None and cg.pressure.some is not None:
        out[("psi_some",)] = cg.pressure.some.total_us / 1e6
    if cg.pressure is not None and cg.pressure.full is not None:
        out[("psi_full",)] = cg.pressure.full.total_us / 1e6
    return out


def gpu_metrics(out: _Families, gpu: GpuSnapshot, folded_pids: frozenset[int] = frozenset()) -> None:
    out.add(cat.GPU_AVAILABLE, int(gpu.available))
    for dev in gpu.devices:
        lbl = (str(dev.index), dev.uuid)
        for part, value in (
            ("total", dev.total_bytes),
            ("used", dev.used_bytes),
            ("free", dev.free_bytes),
            ("reserved", dev.reserved_bytes),
        ):
            out.add(cat.GPU_MEMORY[part], value, lbl)
        out.add(cat.GPU_UTILIZATION, dev.utilization_gpu_ratio, (*lbl, "gpu"))
        out.add(cat.GPU_UTILIZATION, dev.utilization_memory_ratio, (*lbl, "memory"))
    folded: dict[int, list[int | None]] = {}
    for proc in gpu.processes:
        if proc.pid not in folded_pids:
            out.add(cat.GPU_PROCESS_MEMORY, proc.used_bytes, (str(proc.gpu_index), str(proc.pid)))
        else:  # a process folded out of the process series is folded on every GPU too
            folded.setdefault(proc.gpu_index, []).append(proc.used_bytes)
    for index, used in sorted(folded.items()):
        out.add(cat.GPU_PROCESS_MEMORY, _sum(used), (str(index), OVERFLOW))


def watch_metrics(out: _Families, scope: WatchScope) -> None:
    """Asked-for vs found targets by kind (no pid or path label: the set of series stays bounded)."""
    out.add(cat.WATCH_TARGETS_ASKED, len(scope.pids), ("pid",))
    out.add(cat.WATCH_TARGETS_FOUND, len(scope.resolved_pids), ("pid",))
    asked = len(scope.cgroups)
    missing_groups = sum(1 for line in scope.missing if line.startswith("cgroup "))
    out.add(cat.WATCH_TARGETS_ASKED, asked, ("cgroup",))
    out.add(cat.WATCH_TARGETS_FOUND, asked - missing_groups, ("cgroup",))


class SnapshotCollector(Collector):
    """Holds the latest snapshot plus counters the agent accumulates (OOM kills, sampler errors, folds)."""

    def __init__(self, caps: SeriesCaps | None = None) -> None:
        self._lock = threading.Lock()
        self.caps = caps or SeriesCaps()
        self._latest: Snapshot | None = None
        self._kept_pids: set[int] = set()
        self._kept_cgroups: set[str] = set()
        self._folded_pids: frozenset[int] = frozenset()
        self._process_faults = FoldedCounters()
        self._cgroup_counters = FoldedCounters()
        self._overflows: Counter[str] = Counter()
        self._oom_kills: Counter[str] = Counter()
        self._sampler_errors: Counter[str] = Counter()
        self._recorder_size: int | None = None
        self._recorder_errors = 0
        self._recorder_disk_full = 0
        self._recorder_resets: Counter[str] = Counter()

    def update(self, snapshot: Snapshot, recorder_size: int | None = None, recorder_error: bool = False) -> None:
        with self._lock:
            self._latest = snapshot
            self._fold(snapshot)
            self._count_ooms(snapshot.ooms)
            for sampler in snapshot.errors:
                self._sampler_errors[sampler] += 1
            if snapshot.host.missing:
                self._sampler_errors["host"] += 1
            # optional v2-only files don't count; nor does a group not found (llmdiag_watch_targets_found says so)
            if any(cg.usage_bytes is None and cg.version != "none" for cg in snapshot.cgroups):
                self._sampler_errors["cgroup"] += 1
            if recorder_size is not None:
                self._recorder_size = recorder_size
            self._recorder_errors += int(recorder_error)

    def recorder_state(self, *, disk_full: int | None = None, reset: str | None = None) -> None:
        """The agent's recorder counters: full-disk events (cumulative) and fresh starts by reason."""
        with self._lock:
            if disk_full is not None:
                self._recorder_disk_full = disk_full
            if reset is not None:
                self._recorder_resets[reset] += 1

    def _fold(self, snapshot: Snapshot) -> None:
        """Choose the process and cgroup label values to export (largest by memory, kept ones sticky)."""
        caps, scope = self.caps, snapshot.scope
        procs = snapshot.processes
        self._kept_pids = choose({p.pid: float(p.rss_bytes or 0) for p in procs}, self._kept_pids, caps.max_processes,
                                 caps.margin, scope.resolved_pids if scope is not None else ())  # fmt: skip
        self._folded_pids = frozenset(p.pid for p in procs) - self._kept_pids
        self._process_faults.observe(
            {("faults", p.pid): float(p.major_faults) for p in procs if p.major_faults is not None}, set(self._folded_pids)
        )
        groups = snapshot.cgroups
        sizes = {cg.path: float(cg.working_set_bytes or cg.usage_bytes or 0) for cg in groups}
        self._kept_cgroups = choose(sizes, self._kept_cgroups, caps.max_cgroups, caps.margin,
                                    scope.resolved_cgroups if scope is not None else ())  # fmt: skip
        folded_groups = {cg.path for cg in groups} - self._kept_cgroups
        self._cgroup_counters.observe(
            {(fam, cg.path): value for cg in groups for fam, value in cgroup_counters(cg).items()}, folded_groups
        )
        if self._folded_pids:
            self._overflows["process"] += 1
        if folded_groups:
            self._overflows["cgroup"] += 1

    def _count_ooms(self, ooms: Iterable[OomEvent]) -> None:
        for oom in ooms:
            self._oom_kills[oom.constraint or "unknown"] += 1

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            snap = self._latest
            oom_kills = dict(self._oom_kills)
            errors = dict(self._sampler_errors)
            recorder_size, recorder_errors = self._recorder_size, self._recorder_errors
            disk_full, resets = self._recorder_disk_full, dict(self._recorder_resets)
            kept_pids, kept_groups, folded_pids = set(self._kept_pids), set(self._kept_cgroups), self._folded_pids
            faults = self._process_faults.totals.get("faults")
            group_counters = dict(self._cgroup_counters.totals)
            overflows = dict(self._overflows)
        out = _Families()
        folded = {"process": 0, "cgroup": 0}
        if snap is not None:
            host_metrics(out, snap.host)
            folded_groups = [cg for cg in snap.cgroups if cg.path not in kept_groups]
            for cg in snap.cgroups:
                if cg.path in kept_groups:
                    cgroup_metrics(out, cg)
            if folded_groups:
                folded_cgroup_metrics(out, folded_groups, group_counters)
            process_metrics(out, snap.processes, snap.model_processes(), kept_pids, faults)
            gpu_metrics(out, snap.gpu, folded_pids)
            folded = {"process": len(folded_pids), "cgroup": len(folded_groups)}
            out.add(cat.AGENT_SAMPLE_DURATION, snap.duration_s)
            if snap.scope is not None:
                watch_metrics(out, snap.scope)
        # Counters exist from the first scrape (at zero) so rate() and absent() behave.
        for constraint in sorted(set(oom_kills) | {"CONSTRAINT_MEMCG", "CONSTRAINT_NONE"}):
            out.add(cat.OOM_KILLS, oom_kills.get(constraint, 0), (constraint,))
        for kind in ("cgroup", "process"):
            out.add(cat.SERIES_FOLDED, folded[kind], (kind,))
            out.add(cat.SERIES_OVERFLOW, overflows.get(kind, 0), (kind,))
        for sampler in sorted(set(errors) | {"host", "cgroup", "processes", "gpu", "kmsg"}):
            out.add(cat.AGENT_SAMPLER_ERRORS, errors.get(sampler, 0), (sampler,))
        out.add(cat.AGENT_RESIDENT_MEMORY, _own_rss_bytes())
        times = os.times()
        out.add(cat.AGENT_CPU, times.user + times.system)
        out.add(cat.RECORDER_SIZE, recorder_size)
        out.add(cat.RECORDER_WRITE_ERRORS, recorder_errors)
        out.add(cat.RECORDER_DISK_FULL, disk_full)
        for reason in sorted(set(resets) | {"corrupt", "deleted", "replaced"}):
            out.add(cat.RECORDER_RESETS, resets.get(reason, 0), (reason,))
        yield from out.emit()


def _own_rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return None


def exposition(snapshot: Snapshot, caps: SeriesCaps | None = None) -> bytes:
    """The text exposition of one snapshot (what ``diag collect --once`` prints)."""
    registry = CollectorRegistry(auto_describe=False)
    collector = SnapshotCollector(caps)
    collector.update(snapshot)
    registry.register(collector)
    return generate_latest(registry)
