"""Charts for the report, drawn with matplotlib straight to SVG text (inlined: no files, no network, no JS).

Why matplotlib's ``Figure`` and not ``pyplot``: no global figure state and no GUI backend, so it is
safe off the main thread and on a headless box. Why SVG with ``svg.fonttype = none``: text stays
text (searchable, small), and the page needs nothing but itself. Long series are reduced to
per-bucket min/max pairs before drawing, which keeps every spike visible at a fraction of the
points (an hour at 1 Hz is 3600 points per line; a reader's eye gets ~800 pixels).

``extract`` copies out of a Timeline the few series the charts draw (already reduced), so the
report can let the Timeline go before matplotlib is imported: the bundle's peak memory is then the
larger of the two phases, not their sum. Each chart function takes that ``ChartData`` (records only
-- charts render, they do not judge) and returns a ``Chart`` or None when the data is not there;
the report then says so instead of drawing an empty box.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from diag.timeline import Series, Timeline

GiB = float(1 << 30)
MiB = float(1 << 20)
MAX_POINTS = 1600
MAX_SCATTER = 800  # per series; beyond it, per-bucket median and p95 lines (SVG size)
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")


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


def _rc() -> dict[str, Any]:
    return {
        "svg.fonttype": "none",
        "font.size": 9,
        "axes.titlesize": 10,
        "axes.grid": True,
        "grid.alpha": 0.3,
        "axes.spines.top": False,
        "axes.spines.right": False,
        "legend.fontsize": 8,
        "legend.frameon": False,
    }


_HEAD_RE = re.compile(r"^.*?(?=<svg)", re.DOTALL)


def _svg(fig: Any, key: str) -> str:
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({**_rc(), "svg.hashsalt": f"llmdiag-{key}"}):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    text = _HEAD_RE.sub("", buf.getvalue(), count=1)
    # ids must be unique across the several SVGs of one page (clip paths, markers)
    return re.sub(r'(id="|url\(#|xlink:href="#|href="#)([A-Za-z])', rf"\g<1>{key}-\g<2>", text)


def _figure(rows: int = 1, height: float = 2.6, width: float = 9.0) -> tuple[Any, Any]:
    import matplotlib
    from matplotlib.figure import Figure

    with matplotlib.rc_context(_rc()):
        fig = Figure(figsize=(width, height * rows), layout="constrained")
        axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    return fig, axes


def _when(ts: np.ndarray) -> np.ndarray:
    return (np.asarray(ts, dtype=np.float64) * 1000).astype("datetime64[ms]")


MIN_WINDOW_S = 10.0  # a window narrower than this (one sample, two close ones) is widened around its middle
_DAY_S = 86400.0
# Tick label formats, finest last: seconds when ticks are seconds apart, minutes within a day, date and time beyond.
_TICK_FORMATS = ("%m-%d %H:%M", "%H:%M", "%H:%M:%S", "%m-%d %H:%M:%S", "%Y-%m-%d %H:%M:%S")


def _tick_format(values: Sequence[float]) -> str:
    """The shortest format that tells the ticks (matplotlib date numbers: days) apart, as a reader expects it:
    HH:MM:SS when ticks are less than a minute apart, HH:MM within a day, date and time over longer windows."""
    import matplotlib.dates as mdates

    if len(values) < 2:
        return "%H:%M:%S"
    step = float(np.min(np.diff(np.sort(np.asarray(values, dtype=np.float64))))) * _DAY_S
    span = (max(values) - min(values)) * _DAY_S
    if step < 60:
        first = 2
    elif span < _DAY_S and mdates.num2date(min(values)).date() == mdates.num2date(max(values)).date():
        first = 1
    else:
        first = 0
    formats = list(_TICK_FORMATS[first:])
    if mdates.num2date(min(values)).year != mdates.num2date(max(values)).year:
        formats = ["%Y-%m-%d %H:%M", *formats]  # month-day alone would not sort across new year
    for fmt in formats:
        labels = [mdates.num2date(v).strftime(fmt) for v in values]
        if len(set(labels)) == len(labels):
            return fmt
    return _TICK_FORMATS[-1]


def _tick_formatter() -> Any:
    import matplotlib.dates as mdates
    import matplotlib.ticker as mticker

    class TimeFormatter(mticker.Formatter):
        """Formats all ticks of the axis with one format chosen from their spacing (``_tick_format``)."""

        def format_ticks(self, values: Sequence[float]) -> list[str]:
            fmt = _tick_format(values)
            return [mdates.num2date(v).strftime(fmt) for v in values]

        def __call__(self, x: float, pos: int | None = None) -> str:
            return mdates.num2date(x).strftime("%Y-%m-%d %H:%M:%S")

    return TimeFormatter()


def _time_axis(ax: Any, maxticks: int = 8) -> None:
    """UTC time on x with distinct, readable ticks for any window from seconds to a month.

    The view is set to the data's own window (widened to ``MIN_WINDOW_S`` when narrower): left to itself,
    matplotlib widens a single-instant date axis to days, and every tick then reads 00:00:00."""
    import matplotlib.dates as mdates

    lows, highs = [], []
    for sibling in ax.get_shared_x_axes().get_siblings(ax):
        lo, hi = sibling.dataLim.intervalx
        if np.isfinite(lo) and np.isfinite(hi):
            lows.append(lo)
            highs.append(hi)
    if lows:
        lo, hi = min(lows), max(highs)
        min_days = MIN_WINDOW_S / _DAY_S
        if hi - lo < min_days:
            mid = (lo + hi) / 2
            lo, hi = mid - min_days / 2, mid + min_days / 2
        margin = (hi - lo) * 0.02
        ax.set_xlim(lo - margin, hi + margin)
    locator = mdates.AutoDateLocator(minticks=3, maxticks=maxticks)
    locator.intervald[mdates.SECONDLY] = [1, 2, 5, 10, 15, 30]  # never sub-second ticks
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(_tick_formatter())
    ax.set_xlabel("time (UTC)")


def reduce_minmax(ts: np.ndarray, values: np.ndarray, max_points: int = MAX_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """At most ``max_points`` points: per bucket its min at the bucket's first instant and its max at its
    last (an envelope: every spike survives, at a fraction of the points). NaN-free input expected."""
    n = ts.size
    if n <= max_points:
        return ts, values
    buckets = max_points // 2
    starts = np.unique(np.linspace(0, n, buckets, endpoint=False).astype(np.int64))
    ends = np.append(starts[1:], n) - 1
    lo = np.minimum.reduceat(values, starts)
    hi = np.maximum.reduceat(values, starts)
    out_t = np.empty(2 * starts.size)
    out_v = np.empty(2 * starts.size)
    out_t[0::2], out_t[1::2] = ts[starts], ts[ends]
    out_v[0::2], out_v[1::2] = lo, hi
    return out_t, out_v


def _line(ax: Any, s: Series, scale: float, label: str, color: str, **kw: Any) -> bool:
    s = s.valid()
    if len(s) == 0:
        return False
    t, v = reduce_minmax(s.ts, s.values / scale)
    if t.size == 1:
        ax.plot(_when(t), v, marker="o", color=color, label=label, **kw)
    else:
        ax.plot(_when(t), v, color=color, label=label, linewidth=1.2, **kw)
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
    fig, axes = _figure(len(panels))
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
    _time_axis(axes[-1])
    what = {"host": "host", "cgroup": "watched cgroup", "gpu": "GPU"}
    return Chart("memory", "Memory over time", "Memory in use over the window: " + ", ".join(what[p] for p in panels)
                 + ". Dashed lines are the ceilings (host total, cgroup limit, GPU total).", _svg(fig, "memory"))  # fmt: skip


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
    fig, (ax,) = _figure(1, height=3.0)
    for s, label, color, kw in lines:
        _line(ax, s, 1.0, label, color, **kw)
    ax.set_ylabel("% of time stalled (avg10)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", ncols=2)
    _time_axis(ax)
    return Chart("psi", "Pressure (PSI)", "Share of wall time in which some (or all) tasks stalled waiting for memory, "
                 "I/O or CPU. Memory 'full' above a few percent means the service is mostly waiting on reclaim.",
                 _svg(fig, "psi"))  # fmt: skip


def queue_chart(d: ChartData) -> Chart | None:
    """Per request: time waiting for a slot vs time in inference, by arrival time."""
    if not d.arrival.size:
        return None
    arrival, wait, infer = d.arrival, d.queue_wait, d.inference
    fig, (ax,) = _figure(1, height=3.0)
    if arrival.size <= MAX_SCATTER:
        ax.scatter(_when(arrival), wait, s=6, color=PALETTE[1], alpha=0.6, label="queue wait", linewidths=0)
        ax.scatter(_when(arrival), infer, s=6, color=PALETTE[0], alpha=0.6, label="inference", linewidths=0)
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
            ax.plot(_when(centers), med, color=color, label=f"{label} median")
            ax.plot(_when(centers), p95, color=color, linestyle="--", label=f"{label} p95")
    ax.set_ylabel("seconds")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", ncols=2)
    _time_axis(ax)
    n = int(arrival.size)
    return Chart("queue", "Queue wait vs inference time", f"{n} started requests by arrival time. Waiting that grows while "
                 "inference stays flat is a queue backlog; inference that grows with load is the service itself slowing "
                 "down (e.g. thrashing).", _svg(fig, "queue"))  # fmt: skip


def throughput_chart(d: ChartData) -> Chart | None:
    """Completions per second against the number of requests in service, one point per time bucket."""
    curve = d.curve
    if curve is None or len(curve) < 3:
        return None
    keep = ~np.isnan(curve.throughput) & ~np.isnan(curve.n_service)
    if keep.sum() < 3:
        return None
    fig, (ax,) = _figure(1, height=3.2, width=6.5)
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
                 "contention such as thrashing.", _svg(fig, "throughput"))  # fmt: skip


def evidence_chart(key: str, label: str, unit: str, series: Sequence[Sequence[float]]) -> str | None:
    """A small line for one piece of evidence that carries a series excerpt."""
    pts = np.asarray([p[:2] for p in series if len(p) >= 2], dtype=np.float64)
    if pts.ndim != 2 or pts.shape[0] < 2:
        return None
    fig, (ax,) = _figure(1, height=1.5, width=6.0)
    scale, unit_label = 1.0, unit
    if unit in ("bytes", "B") and np.nanmax(np.abs(pts[:, 1])) >= MiB:
        scale, unit_label = MiB, "MiB"
    ax.plot(_when(pts[:, 0]), pts[:, 1] / scale, color=PALETTE[0], linewidth=1.2, marker="o", markersize=2)
    ax.set_ylabel(unit_label or "")
    ax.set_title(label, loc="left")
    _time_axis(ax, maxticks=5)
    ax.set_xlabel("")
    return _svg(fig, key)


def overview_charts(d: ChartData) -> list[Chart]:
    return [c for c in (memory_chart(d), psi_chart(d), queue_chart(d), throughput_chart(d)) if c is not None]
