"""The report's charts: memory, pressure, queue wait vs inference, throughput vs concurrency, and the small
evidence lines, drawn with the project's chart primitives (``diag.views.charts``: matplotlib to inline SVG,
long series reduced to min/max envelopes).

``extract`` copies out of a Timeline the few series the charts draw (already reduced), so the
report can let the Timeline go before matplotlib is imported: the bundle's peak memory is then the
larger of the two phases, not their sum. Each chart function takes that ``ChartData`` (records only
-- charts render, they do not judge) and returns a ``Chart`` or None when the data is not there;
the report then says so instead of drawing an empty box.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from diag.timeline import Series, Timeline
from diag.views.charts import PALETTE, as_datetimes, new_figure, reduce_minmax, time_axis, to_svg

GiB = float(1 << 30)
MiB = float(1 << 20)
MAX_SCATTER = 800  # per series; beyond it, per-bucket median and p95 lines (SVG size)


@dataclass
class Chart:
    key: str
    title: str
    caption: str
    svg: str


HOST_SERIES = (
    "memory.total", "memory.available", "psi.memory.some.avg10", "psi.memory.full.avg10", "psi.io.some.avg10",
    "psi.cpu.some.avg10",
)  # fmt: skip
CGROUP_SERIES = ("usage", "limit", "psi.memory.some.avg10", "psi.memory.full.avg10")
GPU_SERIES = ("used", "total")
MAX_CGROUPS = 4


@dataclass
class ChartData:
    """What the charts draw, copied (and reduced) out of a Timeline."""

    host: dict[str, Series] = field(default_factory=dict)
    cgroups: dict[str, dict[str, Series]] = field(default_factory=dict)
    gpus: dict[int, dict[str, Series]] = field(default_factory=dict)
    arrival: np.ndarray = field(default_factory=lambda: np.empty(0))  # started requests only
    queue_wait: np.ndarray = field(default_factory=lambda: np.empty(0))
    inference: np.ndarray = field(default_factory=lambda: np.empty(0))
    curve: Any = None  # diag.rules.usl.LoadCurve of the request table, or None


def _reduced(s: Series) -> Series:
    v = s.valid()
    t, values = reduce_minmax(v.ts, v.values)
    return Series(np.array(t, dtype=np.float64), np.array(values, dtype=np.float64))


def extract(tl: Timeline) -> ChartData:
    data = ChartData()
    data.host = {k: _reduced(tl.host[k]) for k in HOST_SERIES if k in tl.host and len(tl.host[k].valid())}
    if "memory.total" in tl.host and "memory.available" in tl.host:
        total, avail = tl.host["memory.total"].valid(), tl.host["memory.available"].valid()
        if len(total) and len(avail):
            data.host["used"] = _reduced(Series(avail.ts, np.interp(avail.ts, total.ts, total.values) - avail.values))
    for path, series in list(tl.cgroups.items())[:MAX_CGROUPS]:
        kept = {k: _reduced(series[k]) for k in CGROUP_SERIES if k in series and len(series[k].valid())}
        if kept:
            data.cgroups[path] = kept
    for index, series in sorted(tl.gpus.items()):
        kept = {k: _reduced(series[k]) for k in GPU_SERIES if k in series and len(series[k].valid())}
        if kept:
            data.gpus[index] = kept
    req = tl.requests
    if len(req) and "queue_wait_s" in req:
        started = ~np.isnan(req["queue_wait_s"])
        data.arrival = np.array(req["arrival"][started])
        data.queue_wait = np.array(req["queue_wait_s"][started])
        data.inference = np.array(req["inference_s"][started])
    if len(req) >= 5:
        from diag.rules.usl import load_curve

        data.curve = load_curve(req, tl.start, tl.end)
    return data


def _line(ax: Any, s: Series, scale: float, label: str, color: str, **kw: Any) -> bool:
    s = s.valid()
    if len(s) == 0:
        return False
    t, v = reduce_minmax(s.ts, s.values / scale)
    if t.size == 1:
        ax.plot(as_datetimes(t), v, marker="o", color=color, label=label, **kw)
    else:
        ax.plot(as_datetimes(t), v, color=color, label=label, linewidth=1.2, **kw)
    return True


def _short(path: str, width: int = 40) -> str:
    return path if len(path) <= width else "…" + path[-(width - 1) :]


# --------------------------------------------------------------------------- the charts


def memory_chart(d: ChartData) -> Chart | None:
    """Memory over time: host used vs total, each watched cgroup's usage vs its limit, each GPU's used vs total."""
    panels: list[str] = []
    if "used" in d.host:
        panels.append("host")
    groups = [p for p, s in d.cgroups.items() if "usage" in s]
    if groups:
        panels.append("cgroup")
    gpus = [i for i, s in d.gpus.items() if "used" in s]
    if gpus:
        panels.append("gpu")
    if not panels:
        return None
    fig, axes = new_figure(len(panels))
    for ax, panel in zip(axes, panels, strict=True):
        if panel == "host":
            _line(ax, d.host["used"], GiB, "used (total − available)", PALETTE[0])
            if "memory.total" in d.host:
                _line(ax, d.host["memory.total"], GiB, "total", "#555555", linestyle="--")
            ax.set_ylabel("host GiB")
        elif panel == "cgroup":
            for i, path in enumerate(groups):
                color = PALETTE[(i + 1) % len(PALETTE)]
                _line(ax, d.cgroups[path]["usage"], MiB, f"{_short(path)} usage", color)
                if "limit" in d.cgroups[path]:
                    _line(ax, d.cgroups[path]["limit"], MiB, f"{_short(path)} limit", color, linestyle="--")
            ax.set_ylabel("cgroup MiB")
        else:
            for i in gpus:
                color = PALETTE[(i + 3) % len(PALETTE)]
                _line(ax, d.gpus[i]["used"], GiB, f"GPU {i} used", color)
                if "total" in d.gpus[i]:
                    _line(ax, d.gpus[i]["total"], GiB, f"GPU {i} total", color, linestyle="--")
            ax.set_ylabel("GPU GiB")
        ax.legend(loc="upper left", ncols=2)
    time_axis(axes[-1])
    what = {"host": "host", "cgroup": "watched cgroup", "gpu": "GPU"}
    return Chart("memory", "Memory over time", "Memory in use over the window: " + ", ".join(what[p] for p in panels)
                 + ". Dashed lines are the ceilings (host total, cgroup limit, GPU total).", to_svg(fig, "memory"))  # fmt: skip


def psi_chart(d: ChartData) -> Chart | None:
    """Pressure stall information (avg10, percent of time stalled): host memory/io/cpu and each cgroup's memory."""
    lines: list[tuple[Series, str, str, dict[str, Any]]] = []
    for name, label, color, kw in (
        ("psi.memory.some.avg10", "host memory some", PALETTE[0], {}),
        ("psi.memory.full.avg10", "host memory full", PALETTE[1], {}),
        ("psi.io.some.avg10", "host io some", PALETTE[3], {"linestyle": ":"}),
        ("psi.cpu.some.avg10", "host cpu some", "#777777", {"linestyle": ":"}),
    ):
        if name in d.host:
            lines.append((d.host[name], label, color, kw))
    for i, (path, series) in enumerate(d.cgroups.items()):
        for kind, style in (("some", "-"), ("full", "--")):
            s = series.get(f"psi.memory.{kind}.avg10")
            if s is not None:
                lines.append((s, f"{_short(path, 30)} memory {kind}", PALETTE[(i + 4) % len(PALETTE)], {"linestyle": style}))
    if not lines:
        return None
    fig, (ax,) = new_figure(1, height=3.0)
    for s, label, color, kw in lines:
        _line(ax, s, 1.0, label, color, **kw)
    ax.set_ylabel("% of time stalled (avg10)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", ncols=2)
    time_axis(ax)
    return Chart("psi", "Pressure (PSI)", "Share of wall time in which some (or all) tasks stalled waiting for memory, "
                 "I/O or CPU. Memory 'full' above a few percent means the service is mostly waiting on reclaim.",
                 to_svg(fig, "psi"))  # fmt: skip


def queue_chart(d: ChartData) -> Chart | None:
    """Per request: time waiting for a slot vs time in inference, by arrival time."""
    if not d.arrival.size:
        return None
    arrival, wait, infer = d.arrival, d.queue_wait, d.inference
    fig, (ax,) = new_figure(1, height=3.0)
    if arrival.size <= MAX_SCATTER:
        ax.scatter(as_datetimes(arrival), wait, s=6, color=PALETTE[1], alpha=0.6, label="queue wait", linewidths=0)
        ax.scatter(as_datetimes(arrival), infer, s=6, color=PALETTE[0], alpha=0.6, label="inference", linewidths=0)
    else:  # too many to scatter: per-bucket median and p95
        edges = np.linspace(arrival.min(), arrival.max(), 121)
        idx = np.clip(np.searchsorted(edges, arrival, "right") - 1, 0, 119)
        centers = (edges[:-1] + edges[1:]) / 2
        for values, label, color in ((wait, "queue wait", PALETTE[1]), (infer, "inference", PALETTE[0])):
            med = np.full(120, np.nan)
            p95 = np.full(120, np.nan)
            for b in np.unique(idx):
                seg = values[idx == b]
                med[b], p95[b] = np.median(seg), np.percentile(seg, 95)
            ax.plot(as_datetimes(centers), med, color=color, label=f"{label} median")
            ax.plot(as_datetimes(centers), p95, color=color, linestyle="--", label=f"{label} p95")
    ax.set_ylabel("seconds")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", ncols=2)
    time_axis(ax)
    n = int(arrival.size)
    return Chart("queue", "Queue wait vs inference time", f"{n} started requests by arrival time. Waiting that grows while "
                 "inference stays flat is a queue backlog; inference that grows with load is the service itself slowing "
                 "down (e.g. thrashing).", to_svg(fig, "queue"))  # fmt: skip


def throughput_chart(d: ChartData) -> Chart | None:
    """Completions per second against the number of requests in service, one point per time bucket."""
    curve = d.curve
    if curve is None or len(curve) < 3:
        return None
    keep = ~np.isnan(curve.throughput) & ~np.isnan(curve.n_service)
    if keep.sum() < 3:
        return None
    fig, (ax,) = new_figure(1, height=3.2, width=6.5)
    when = curve.centers[keep]
    points = ax.scatter(curve.n_service[keep], curve.throughput[keep], c=when - when.min(), cmap="viridis", s=14)
    bar = fig.colorbar(points, ax=ax)
    bar.set_label("seconds since window start")
    ax.set_xlabel("requests in service (time-averaged)")
    ax.set_ylabel("completions / s")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    return Chart("throughput", "Throughput vs concurrency", f"One point per {curve.dt:.0f} s bucket. Throughput that "
                 "flattens as concurrency rises is a saturated service (queueing); throughput that falls is "
                 "contention such as thrashing.", to_svg(fig, "throughput"))  # fmt: skip


def evidence_chart(key: str, label: str, unit: str, series: Sequence[Sequence[float]]) -> str | None:
    """A small line for one piece of evidence that carries a series excerpt."""
    pts = np.asarray([p[:2] for p in series if len(p) >= 2], dtype=np.float64)
    if pts.ndim != 2 or pts.shape[0] < 2:
        return None
    fig, (ax,) = new_figure(1, height=1.5, width=6.0)
    scale, unit_label = 1.0, unit
    if unit in ("bytes", "B") and np.nanmax(np.abs(pts[:, 1])) >= MiB:
        scale, unit_label = MiB, "MiB"
    ax.plot(as_datetimes(pts[:, 0]), pts[:, 1] / scale, color=PALETTE[0], linewidth=1.2, marker="o", markersize=2)
    ax.set_ylabel(unit_label or "")
    ax.set_title(label, loc="left")
    time_axis(ax, maxticks=5)
    ax.set_xlabel("")
    return to_svg(fig, key)


def overview_charts(d: ChartData) -> list[Chart]:
    return [c for c in (memory_chart(d), psi_chart(d), queue_chart(d), throughput_chart(d)) if c is not None]
