"""Charts for the report, written straight to SVG text (inlined: no files, no network, no JS) by ``svgplot``.

Long series are reduced to per-bucket min/max pairs before drawing, which keeps every spike visible at a
fraction of the points (an hour at 1 Hz is 3600 points per line; a reader's eye gets ~800 pixels).

``extract`` copies out of a Timeline the few series the charts draw (already reduced), so the report can let
the Timeline go before it renders. Each chart function takes that ``ChartData`` (records only -- charts
render, they do not judge) and returns a ``Chart`` or None when the data is not there; the report then says
so instead of drawing an empty box.

The report's own plotting path rather than the project's matplotlib primitives (``diag.views.charts``, which
the dashboards' preview draws with): importing matplotlib and laying out the report's six figures cost ~1.5 s
of a bundle meant to cost what ``sos report`` costs. The palette and the min/max envelope are shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from diag.bundle import svgplot
from diag.timeline import Series, Timeline
from diag.views.charts import PALETTE, reduce_minmax

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


def _line(s: Series, scale: float, label: str, color: str, dash: str = "") -> svgplot.Line | None:
    s = s.valid()
    if len(s) == 0:
        return None
    t, v = reduce_minmax(s.ts, s.values / scale)
    return svgplot.Line(t, v, color, label, dash, markers=t.size == 1)


def _lines(*lines: svgplot.Line | None) -> list[svgplot.Line]:
    return [line for line in lines if line is not None]


def _short(path: str, width: int = 40) -> str:
    return path if len(path) <= width else "…" + path[-(width - 1) :]


# --------------------------------------------------------------------------- the charts


def memory_chart(d: ChartData) -> Chart | None:
    """Memory over time: host used vs total, each watched cgroup's usage vs its limit, each GPU's used vs total."""
    panels: list[tuple[str, svgplot.Panel]] = []
    if "used" in d.host:
        total = _line(d.host["memory.total"], GiB, "total", "#555555", "--") if "memory.total" in d.host else None
        panels.append(("host", svgplot.Panel(_lines(_line(d.host["used"], GiB, "used (total − available)", PALETTE[0]),
                                                    total), ylabel="host GiB")))  # fmt: skip
    groups = [p for p, s in d.cgroups.items() if "usage" in s]
    if groups:
        lines: list[svgplot.Line | None] = []
        for i, path in enumerate(groups):
            color = PALETTE[(i + 1) % len(PALETTE)]
            lines.append(_line(d.cgroups[path]["usage"], MiB, f"{_short(path)} usage", color))
            if "limit" in d.cgroups[path]:
                lines.append(_line(d.cgroups[path]["limit"], MiB, f"{_short(path)} limit", color, "--"))
        panels.append(("cgroup", svgplot.Panel(_lines(*lines), ylabel="cgroup MiB")))
    gpus = [i for i, s in d.gpus.items() if "used" in s]
    if gpus:
        lines = []
        for i in gpus:
            color = PALETTE[(i + 3) % len(PALETTE)]
            lines.append(_line(d.gpus[i]["used"], GiB, f"GPU {i} used", color))
            if "total" in d.gpus[i]:
                lines.append(_line(d.gpus[i]["total"], GiB, f"GPU {i} total", color, "--"))
        panels.append(("gpu", svgplot.Panel(_lines(*lines), ylabel="GPU GiB")))
    if not panels:
        return None
    what = {"host": "host", "cgroup": "watched cgroup", "gpu": "GPU"}
    svg = svgplot.figure("memory", [p for _, p in panels], panel_height=190.0)
    return Chart("memory", "Memory over time", "Memory in use over the window: " + ", ".join(what[k] for k, _ in panels)
                 + ". Dashed lines are the ceilings (host total, cgroup limit, GPU total).", svg)  # fmt: skip


def psi_chart(d: ChartData) -> Chart | None:
    """Pressure stall information (avg10, percent of time stalled): host memory/io/cpu and each cgroup's memory."""
    lines: list[svgplot.Line | None] = []
    for name, label, color, dash in (
        ("psi.memory.some.avg10", "host memory some", PALETTE[0], ""),
        ("psi.memory.full.avg10", "host memory full", PALETTE[1], ""),
        ("psi.io.some.avg10", "host io some", PALETTE[3], ":"),
        ("psi.cpu.some.avg10", "host cpu some", "#777777", ":"),
    ):
        if name in d.host:
            lines.append(_line(d.host[name], 1.0, label, color, dash))
    for i, (path, series) in enumerate(d.cgroups.items()):
        for kind, dash in (("some", ""), ("full", "--")):
            s = series.get(f"psi.memory.{kind}.avg10")
            if s is not None:
                lines.append(_line(s, 1.0, f"{_short(path, 30)} memory {kind}", PALETTE[(i + 4) % len(PALETTE)], dash))
    drawn = _lines(*lines)
    if not drawn:
        return None
    svg = svgplot.figure("psi", [svgplot.Panel(drawn, ylabel="% of time stalled (avg10)", y_from_zero=True)])
    return Chart("psi", "Pressure (PSI)", "Share of wall time in which some (or all) tasks stalled waiting for memory, "
                 "I/O or CPU. Memory 'full' above a few percent means the service is mostly waiting on reclaim.",
                 svg)  # fmt: skip


def queue_chart(d: ChartData) -> Chart | None:
    """Per request: time waiting for a slot vs time in inference, by arrival time."""
    if not d.arrival.size:
        return None
    arrival, wait, infer = d.arrival, d.queue_wait, d.inference
    panel = svgplot.Panel(ylabel="seconds", y_from_zero=True)
    if arrival.size <= MAX_SCATTER:
        panel.points = [svgplot.Points(arrival, wait, PALETTE[1], "queue wait"),
                        svgplot.Points(arrival, infer, PALETTE[0], "inference")]  # fmt: skip
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
            panel.lines += [svgplot.Line(centers, med, color, f"{label} median"),
                            svgplot.Line(centers, p95, color, f"{label} p95", "--")]  # fmt: skip
    n = int(arrival.size)
    return Chart("queue", "Queue wait vs inference time", f"{n} started requests by arrival time. Waiting that grows while "
                 "inference stays flat is a queue backlog; inference that grows with load is the service itself slowing "
                 "down (e.g. thrashing).", svgplot.figure("queue", [panel]))  # fmt: skip


def throughput_chart(d: ChartData) -> Chart | None:
    """Completions per second against the number of requests in service, one point per time bucket."""
    curve = d.curve
    if curve is None or len(curve) < 3:
        return None
    keep = ~np.isnan(curve.throughput) & ~np.isnan(curve.n_service)
    if keep.sum() < 3:
        return None
    when = curve.centers[keep] - curve.centers[keep].min()
    span = float(when.max()) or 1.0
    panel = svgplot.Panel(points=[svgplot.Points(curve.n_service[keep], curve.throughput[keep], svgplot.viridis(when / span),
                                                 radius=3.0, opacity=1.0)],
                          ylabel="completions / s", y_from_zero=True)  # fmt: skip
    svg = svgplot.figure("throughput", [panel], is_time=False, xlabel="requests in service (time-averaged)", width=660.0,
                         panel_height=240.0, colorbar=svgplot.ColorBar(0.0, span, "seconds since window start"))  # fmt: skip
    return Chart("throughput", "Throughput vs concurrency", f"One point per {curve.dt:.0f} s bucket. Throughput that "
                 "flattens as concurrency rises is a saturated service (queueing); throughput that falls is "
                 "contention such as thrashing.", svg)  # fmt: skip


def evidence_chart(key: str, label: str, unit: str, series: Sequence[Sequence[float]]) -> str | None:
    """A small line for one piece of evidence that carries a series excerpt."""
    pts = np.asarray([p[:2] for p in series if len(p) >= 2], dtype=np.float64)
    if pts.ndim != 2 or pts.shape[0] < 2:
        return None
    scale, unit_label = 1.0, unit
    if unit in ("bytes", "B") and np.nanmax(np.abs(pts[:, 1])) >= MiB:
        scale, unit_label = MiB, "MiB"
    line = svgplot.Line(pts[:, 0], pts[:, 1] / scale, PALETTE[0], markers=True)
    panel = svgplot.Panel([line], ylabel=unit_label or "", title=label)
    return svgplot.figure(key, [panel], width=660.0, panel_height=100.0, max_ticks=5, xlabel="")


def overview_charts(d: ChartData) -> list[Chart]:
    return [c for c in (memory_chart(d), psi_chart(d), queue_chart(d), throughput_chart(d)) if c is not None]
