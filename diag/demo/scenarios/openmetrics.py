"""A recording as Prometheus would have scraped it: OpenMetrics text for ``promtool tsdb create-blocks-from``.

Why: the flight recorder and a Prometheus see one incident through two different lenses -- the rules read
the recorder's records, the cause alerts read the series the agent and the tracker export. To hold the
two to one definition, the same recording must exist in both forms. The series here are not invented:
every sample comes from the product's own exporters fed the recorded records -- the agent's
``SnapshotCollector`` for each recorded sample (host, cgroups, processes, GPU, OOM kills), and the
tracker's ``TrackerMetrics`` observing each recorded request when it finished -- rendered at each sample's
time, exactly what a scrape at that moment would have returned. An uninstrumented recording's scrapes of
the engine's own /metrics (``BackendSample``) give back their gauges and counters at the scrape's time,
with the labels the scrape kept; histograms, recorded as what each bucket gained per scrape, are summed back
into cumulative buckets from the first scrape on (rates and quantiles are exact; totals start at 0). ``diag
collect``'s own process metrics (its CPU, its resident memory) describe this converter, not the recorded
agent, and are left out.

Labels a scrape config would add are given by the caller: ``agent_labels`` on the agent's series,
``backend_labels`` on the tracker's (``job``, ``instance``, ``host`` ...). ``shift_s`` moves every
timestamp (a recording from last month must land inside the TSDB's retention).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from collectors import backends as bk
from collectors.exporter import SnapshotCollector
from collectors.records import (
    BackendSample,
    CgroupSnapshot,
    GpuSnapshot,
    HostSnapshot,
    OomEvent,
    ProcessSample,
    RequestTiming,
    record_from_dict,
)
from collectors.snapshot import Snapshot

# The converter's own process, not the recorded agent's (see the module docstring).
OWN_PROCESS_FAMILIES = frozenset({"llmdiag_agent_cpu_seconds_total", "llmdiag_agent_resident_memory_bytes"})
REJECTIONS = {"rejected": "queue_full", "queue_timeout": "queue_timeout"}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _render(
    registry: CollectorRegistry, extra: Mapping[str, str], ts: float, skip: frozenset[str], types: dict[str, str]
) -> Iterator[tuple[str, str, str]]:
    """(family, series, sample line) of one scrape of ``registry`` at ``ts``; notes each family's type in ``types``."""
    text = generate_latest(registry).decode()
    for family in text_string_to_metric_families(text):
        if family.name in skip or any(s.name in skip for s in family.samples):
            continue
        types[family.name] = family.type
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = {**sample.labels, **extra}
            inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
            value = sample.value
            shown = "NaN" if math.isnan(value) else repr(float(value))
            series = f"{sample.name}{{{inner}}}"
            yield family.name, series, f"{series} {shown} {ts:.3f}"


def openmetrics(
    records: Iterable[Mapping[str, Any]],
    *,
    agent_labels: Mapping[str, str],
    backend_labels: Mapping[str, str],
    shift_s: float = 0.0,
) -> str:
    """The recording's series as one OpenMetrics document (families grouped, samples in time order, ``# EOF``)."""
    samples: dict[float, dict[str, list[Any]]] = defaultdict(lambda: defaultdict(list))
    requests: list[RequestTiming] = []
    scrapes: list[BackendSample] = []
    for raw in records:
        rec = record_from_dict(dict(raw))
        if isinstance(rec, RequestTiming):
            requests.append(rec)
        elif isinstance(rec, BackendSample):
            scrapes.append(rec)
        elif isinstance(rec, (HostSnapshot, CgroupSnapshot, ProcessSample, GpuSnapshot, OomEvent)):
            samples[round(rec.ts, 3)][type(rec).__name__].append(rec)
    requests.sort(key=lambda r: r.finish)
    agent = SnapshotCollector()
    agent_registry = CollectorRegistry()
    agent_registry.register(agent)
    tracker_registry = CollectorRegistry()
    from collectors.tracking.metrics import TrackerMetrics

    tracker = TrackerMetrics(tracker_registry, fast=True)
    lines: dict[str, list[str]] = defaultdict(list)
    types: dict[str, str] = {}
    # A series a scrape no longer returns (a process that exited) gets one NaN sample, as Prometheus writes a
    # staleness marker: otherwise it would look present for the 5-minute lookback and, say, count a killed
    # worker and its replacement as two model holders. (OpenMetrics text has no staleness marker; a NaN sample
    # fails every comparison, which is what the alert expressions need of a vanished series.)
    previous: dict[str, str] = {}
    done = 0
    pending_ooms: list[Any] = []
    for ts in sorted(samples):
        group = samples[ts]
        pending_ooms += group.get("OomEvent", [])
        hosts = group.get("HostSnapshot")
        if not hosts:
            continue  # an OOM line read between samples (kmsg has its own times): it joins the next scrape
        snap = Snapshot(ts=ts, host=hosts[0], cgroups=group.get("CgroupSnapshot", []),
                        processes=group.get("ProcessSample", []),
                        gpu=(group.get("GpuSnapshot") or [GpuSnapshot(ts=ts)])[0], ooms=pending_ooms)  # fmt: skip
        pending_ooms = []
        agent.update(snap)
        while done < len(requests) and requests[done].finish <= ts:
            _observe(tracker, requests[done])
            done += 1
        current: dict[str, str] = {}
        for registry, labels, skip in ((agent_registry, agent_labels, OWN_PROCESS_FAMILIES),
                                       (tracker_registry, backend_labels, frozenset())):  # fmt: skip
            for family, series, line in _render(registry, labels, ts + shift_s, skip, types):
                lines[family].append(line)
                current[series] = family
        for series, family in previous.items():
            if series not in current:
                lines[family].append(f"{series} NaN {ts + shift_s:.3f}")
        previous = current
    _engine_lines(scrapes, backend_labels, shift_s, lines, types)
    out: list[str] = []
    for family, family_lines in lines.items():
        kind = types.get(family, "untyped")
        out.append(f"# TYPE {family} {'unknown' if kind == 'untyped' else kind}")
        out.extend(family_lines)
    out.append("# EOF")
    return "\n".join(out) + "\n"


def _observe(tracker: Any, req: RequestTiming) -> None:
    """What the tracker records when this request ends (its series keyed by route and model)."""
    series = tracker.series(req.route or "/v1/completions", req.model or "")
    if req.outcome in REJECTIONS:
        series.rejected(REJECTIONS[req.outcome])
    if req.start is not None:
        series.started()
    e2e = max(0.0, req.finish - req.arrival)
    series.finished(req.outcome, req.start is not None, req.queue_wait_s, req.inference_s, e2e, req.ttft_s)


def _engine_lines(scrapes: list[BackendSample], labels: Mapping[str, str], shift_s: float,
                  lines: dict[str, list[str]], types: dict[str, str]) -> None:  # fmt: skip
    """The gauges and counters of the engine's recorded scrapes, each at its scrape's time."""
    extra = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    totals: dict[str, float] = {}  # histogram sample key -> its count so far (per bucket, not cumulative in le)
    for rec in sorted(scrapes, key=lambda r: r.ts):
        if not rec.up:
            continue
        for key, gained in (rec.deltas or {}).items():
            totals[key] = totals.get(key, 0.0) + float(gained)
        _histogram_lines(totals, extra, rec.ts + shift_s, lines, types)
        for values, kind in ((rec.gauges, "gauge"), (rec.counters, "counter")):
            for key, value in (values or {}).items():
                name, _, inner = key.partition("{")
                fam = bk.FAMILIES.get(name)
                family = fam.base if fam is not None else name
                types[family] = kind
                inner = inner.rstrip("}")
                both = ",".join(x for x in (inner, extra) if x)
                lines[family].append(f"{name}{{{both}}} {float(value)!r} {rec.ts + shift_s:.3f}")


def _histogram_lines(totals: Mapping[str, float], extra: str, ts: float, lines: dict[str, list[str]],
                     types: dict[str, str]) -> None:  # fmt: skip
    """Cumulative ``_bucket`` (summed over every bound at or under ``le``), ``_sum`` and ``_count`` lines at ``ts``."""
    by_family: dict[str, dict[str, float]] = defaultdict(dict)
    for key, value in totals.items():
        name, _, inner = key.partition("{")
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix):
                family = name.removesuffix(suffix)
                by_family[family][suffix + ("{" + inner if inner else "")] = value
    for family, parts in by_family.items():
        fam = bk.FAMILIES.get(family)
        if fam is None or fam.buckets is None:
            continue  # run-time buckets: their bounds are not known here
        types[family] = "histogram"
        bounds = {float(k.split('le="', 1)[1].split('"', 1)[0]): v for k, v in parts.items() if k.startswith("_bucket")}
        running = 0.0
        for le in (*fam.buckets, math.inf):
            running += sum(v for b, v in bounds.items() if (b == le if math.isinf(le) else math.isclose(b, le)))
            text = "+Inf" if math.isinf(le) else repr(float(le))
            inner = ",".join(x for x in (f'le="{text}"', extra) if x)
            lines[family].append(f"{family}_bucket{{{inner}}} {running!r} {ts:.3f}")
        count = parts.get("_count", running)
        lines[family].append(f"{family}_sum{{{extra}}} {parts.get('_sum', 0.0)!r} {ts:.3f}")
        lines[family].append(f"{family}_count{{{extra}}} {count!r} {ts:.3f}")
