"""The project's chart primitives: matplotlib straight to SVG text, for inlining (no files, no network, no JS).
The dashboards preview (``diag.views.dashboards_preview``) draws with these; the bundle's report draws its
own lighter SVG (``diag.bundle.svgplot``: matplotlib's import and layout cost it ~1.5 s) with the same
palette and the same min/max envelope (``PALETTE``, ``reduce_minmax``).

Why matplotlib's ``Figure`` and not ``pyplot``: no global figure state and no GUI backend, so it is
safe off the main thread and on a headless box. Why SVG with ``svg.fonttype = none``: text stays
text (searchable, small), and the page needs nothing but itself. Long series are reduced to
per-bucket min/max pairs before drawing (``reduce_minmax``), which keeps every spike visible at a
fraction of the points (an hour at 1 Hz is 3600 points per line; a reader's eye gets ~800 pixels).
matplotlib is imported inside the functions, so importing this module costs nothing until a chart is drawn.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

MAX_POINTS = 1600
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")


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


def to_svg(fig: Any, key: str) -> str:
    """The figure as SVG text to inline; ``key`` prefixes its ids, unique per chart on one page, and salts its
    hashes, so the same figure gives the same bytes on every run."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({**_rc(), "svg.hashsalt": f"llmdiag-{key}"}):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    text = _HEAD_RE.sub("", buf.getvalue(), count=1)
    # ids must be unique across the several SVGs of one page (clip paths, markers)
    return re.sub(r'(id="|url\(#|xlink:href="#|href="#)([A-Za-z])', rf"\g<1>{key}-\g<2>", text)


def new_figure(rows: int = 1, height: float = 2.6, width: float = 9.0) -> tuple[Any, Any]:
    """A figure of ``rows`` stacked axes sharing their time axis, in the charts' style: ``(figure, axes)``."""
    import matplotlib
    from matplotlib.figure import Figure

    with matplotlib.rc_context(_rc()):
        fig = Figure(figsize=(width, height * rows), layout="constrained")
        axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    return fig, axes


def as_datetimes(ts: np.ndarray) -> np.ndarray:
    """Unix seconds as numpy datetimes (ms), which matplotlib's date axis reads."""
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


def time_axis(ax: Any, maxticks: int = 8) -> None:
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
