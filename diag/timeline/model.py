"""The Timeline: every recorded signal as columns (numpy arrays), aligned on Unix time.

Rules see only a Timeline (ARCHITECTURE.md). It is built by loaders from the flight recorder, a
bundle directory or a Prometheus server, so the rules do not care where the data came from -- and
it is columnar because the rules are statistics over long series (24 h at 1 Hz, a million
requests), which is what numpy is for.

Naming of series (the *signals* rules ask for, and what ``not_evaluated`` names when absent):

- host: ``memory.<snake name>`` (bytes), ``psi.<cpu|memory|io>.<some|full>.<avg10|avg60|avg300>``
  (percent), ``psi.<res>.<kind>.total_s`` (cumulative seconds), ``vmstat.<field>`` (cumulative).
- per cgroup path: ``usage``, ``working_set``, ``peak``, ``limit``, ``high``, ``swap``,
  ``events.<key>``, ``events_local.<key>``, ``stat.<key>``, ``under_oom``, and the group's memory
  PSI as ``psi.memory.<kind>.<field>``.
- per process track (pid + start time): ``rss``, ``pss``, ``uss``, ``swap``, ``major_faults``,
  ``minor_faults``; static facts (comm, cmdline, model files, cgroup) beside them.
- per GPU index: ``total``, ``used``, ``free``, ``reserved``, ``util_gpu``, ``util_memory``.
- ``service``: aggregated request-side series (quantiles, rates, the engine's scheduler and KV cache) for
  sources that have no per-request rows: a Prometheus server, or the agent's scrapes of the backend's own
  ``/metrics`` (``backends``, per scraped URL, from which ``diag.timeline.backends`` computes them).
- tables (one row per event): requests, batches, routing, loader, torch, and lists of OOM events,
  CUDA OOM errors and service configurations.

Missing values are NaN in float columns; an absent signal is an absent key, never a column of zeros.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from collectors.records import CudaOomError, OomEvent, ServiceConfig, WatchScope
from diag.timeline import signals as vocabulary

NAN = float("nan")


@dataclass
class Series:
    """One numeric signal over time; ``ts`` ascending seconds, ``values`` float64 with NaN for missing."""

    ts: np.ndarray
    values: np.ndarray

    def __len__(self) -> int:
        return int(self.ts.size)

    def window(self, start: float | None = None, end: float | None = None) -> Series:
        lo = 0 if start is None else int(np.searchsorted(self.ts, start, "left"))
        hi = self.ts.size if end is None else int(np.searchsorted(self.ts, end, "right"))
        return Series(self.ts[lo:hi], self.values[lo:hi])

    def valid(self) -> Series:
        """Only the samples that have a value."""
        keep = ~np.isnan(self.values)
        return Series(self.ts[keep], self.values[keep])

    def rate(self) -> Series:
        """Per-second rate of a cumulative counter; a reset (decrease) yields NaN for that step, not a negative rate."""
        s = self.valid()
        if len(s) < 2:
            return Series(np.empty(0), np.empty(0))
        dt = np.diff(s.ts)
        dv = np.diff(s.values)
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.where((dt > 0) & (dv >= 0), dv / np.where(dt > 0, dt, 1.0), np.nan)
        return Series(s.ts[1:], r)

    def increase(self) -> float:
        """Total increase of a counter over the series, counting through resets like PromQL's increase()."""
        s = self.valid()
        if len(s) < 2:
            return 0.0
        dv = np.diff(s.values)
        return float(np.where(dv >= 0, dv, s.values[1:]).sum())

    def last(self) -> float:
        s = self.valid()
        return float(s.values[-1]) if len(s) else NAN


@dataclass
class Table:
    """Rows of one event kind as columns. Float columns use NaN for missing; string columns are object arrays."""

    columns: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(next(iter(self.columns.values())).size) if self.columns else 0

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name]

    def __contains__(self, name: str) -> bool:
        return name in self.columns

    def select(self, mask: np.ndarray) -> Table:
        return Table({k: v[mask] for k, v in self.columns.items()})


@dataclass
class ProcessTrack:
    """One process over its lifetime (a pid reused by another program is another track)."""

    pid: int
    start_time_s: float | None
    comm: str = ""
    cmdline: str = ""
    memory_cgroup: str | None = None
    model_files: set[str] = field(default_factory=set)
    ppid: int | None = None
    series: dict[str, Series] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.pid}@{self.start_time_s}"


@dataclass
class Timeline:
    start: float
    end: float
    source: str = ""
    host: dict[str, Series] = field(default_factory=dict)
    cgroups: dict[str, dict[str, Series]] = field(default_factory=dict)
    processes: dict[str, ProcessTrack] = field(default_factory=dict)
    gpus: dict[int, dict[str, Series]] = field(default_factory=dict)
    gpu_unavailable_reason: str | None = None
    gpu_processes: Table = field(default_factory=Table)  # ts, gpu, pid, used_bytes
    # Aggregated request-side series when per-request rows are not available (the Prometheus path):
    # queue_wait_p50_s/p95_s, inference_p50_s/p95_s, e2e_p95_s, throughput_rps, active_inferences, queue_depth,
    # rejected_rps, error_rps, prompt_tokens_rps ... (see diag/sources/prometheus.py for the exact set).
    service: dict[str, Series] = field(default_factory=dict)
    # Inference backends' own families as the agent scraped them (``BackendSample``), per target URL: ``up``,
    # ``scrape_duration_s``, ``gauge.<series>``, ``counter.<series>``, ``delta.<series>``. The service signals
    # they give are computed from them into ``service`` (``diag.timeline.backends``); rules read those.
    backends: dict[str, dict[str, Series]] = field(default_factory=dict)
    requests: Table = field(default_factory=Table)
    batches: Table = field(default_factory=Table)
    routing: Table = field(default_factory=Table)
    loader: Table = field(default_factory=Table)
    torch: Table = field(default_factory=Table)
    ooms: list[OomEvent] = field(default_factory=list)
    cuda_ooms: list[CudaOomError] = field(default_factory=list)
    configs: list[ServiceConfig] = field(default_factory=list)
    # What the operator asked the agent to watch (--pid/--cgroup), oldest first; the last one before the window
    # is included by the recorder loader, since a scope is written only at start-up and when it changes.
    watch_scopes: list[WatchScope] = field(default_factory=list)
    # Tables of record kinds declared after these attributes (a ``Rows`` destination naming no attribute above).
    tables: dict[str, Table] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)  # records read per kind
    skipped: dict[str, int] = field(default_factory=dict)  # undecodable rows per kind

    @property
    def duration_s(self) -> float:
        return max(0.0, self.end - self.start)

    def table(self, name: str) -> Table:
        """A table by its name: an attribute above, else one of ``tables`` (empty when absent)."""
        found = getattr(self, name, None) if name in _TABLE_FIELDS else self.tables.get(name)
        return found if found is not None else Table()

    def signals(self) -> set[str]:
        """Names of the signals present, as rules declare them (``host:memory.available``, ``requests``...)."""
        names = {f"host:{k}" for k, s in self.host.items() if len(s.valid())}
        for series in self.cgroups.values():
            names.update(f"cgroup:{k}" for k, s in series.items() if len(s.valid()))
        if self.processes:
            names.add("processes")
            names.update(f"process:{k}" for t in self.processes.values() for k in t.series)
        if any(t.model_files for t in self.processes.values()):
            names.add("process:model_files")
        names.update(f"service:{k}" for k, s in self.service.items() if len(s.valid()))
        for dev in self.gpus.values():
            names.update(f"gpu:{k}" for k in dev)
        for name, attr in vocabulary.TABLE_ATTRS.items():
            if len(self.table(attr)):
                names.add(name)
        if len(self.requests):
            for col in vocabulary.REQUEST_COLUMNS:
                if col in self.requests and not np.isnan(self.requests[col]).all():
                    names.add(f"requests:{col}")
        if self.ooms or self.counts.get("host"):  # kmsg watched while the agent ran: absence of OOMs is evidence
            names.add("ooms")
        if self.cuda_ooms:
            names.add("cuda_ooms")
        if self.configs:
            names.add("config")
        return names


_TABLE_FIELDS = frozenset(f.name for f in fields(Timeline) if f.type in ("Table", Table))
