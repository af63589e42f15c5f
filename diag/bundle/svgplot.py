"""A small plotting path for the report: stacked panels of lines and points over time, written as SVG text.

Why not matplotlib here: importing it and laying out the report's six figures cost ~1.5 s of a bundle that
should cost what ``sos report`` costs (its constrained layout measures every text box, twice), and the charts
need four things -- lines, points, a time axis, a legend -- that are a few hundred bytes of SVG each. The
output is plain SVG 1.1: ``<path>`` for every mark (one per series), ``<text>`` for every label (searchable, no
font embedded), ids prefixed with the chart's key (unique across the page), no script, nothing fetched.

Time is UTC on x. The ticks fall on round instants (1 s to 30 days apart), 3 to ``max_ticks`` of them, and are
labelled with the shortest format that tells them apart: HH:MM:SS when seconds apart, HH:MM within a day,
month-day and time beyond, the year too across a new year. A window narrower than ``MIN_WINDOW_S`` is
widened around its middle, so one sample still gets a readable axis.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

MIN_WINDOW_S = 10.0
_TIME_STEPS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400,
                 2 * 86400, 7 * 86400, 14 * 86400, 28 * 86400)  # fmt: skip
_DAY_S = 86400.0
FONT = 11.0
_CHAR_W = 0.62 * FONT  # average advance of a sans-serif glyph, for laying out legends
DASHES = {"--": "5 3", ":": "1.5 2.5"}
# viridis at ten evenly spaced points (perceptually uniform, legible in grey): points coloured by time
VIRIDIS = ("#440154", "#482878", "#3e4989", "#31688e", "#26828e", "#1f9e89", "#35b779", "#6ece58", "#b5de2b", "#fde725")


@dataclass
class Line:
    x: np.ndarray  # Unix seconds (time axis) or plain numbers
    y: np.ndarray
    color: str
    label: str = ""
    dash: str = ""  # "" solid, "--" dashed, ":" dotted
    markers: bool = False  # a dot on every point (short excerpts, single samples)


@dataclass
class Points:
    x: np.ndarray
    y: np.ndarray
    color: str | Sequence[str]  # one colour, or one per point
    label: str = ""
    radius: float = 2.2
    opacity: float = 0.6


@dataclass
class Panel:
    lines: list[Line] = field(default_factory=list)
    points: list[Points] = field(default_factory=list)
    ylabel: str = ""
    title: str = ""
    y_from_zero: bool = False
    legend_columns: int = 2


@dataclass
class ColorBar:
    low: float
    high: float
    label: str


def esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


# --------------------------------------------------------------------------- ticks


def nice_ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    """Round values (1, 2, 2.5, 5 x 10^k apart) covering [lo, hi], about ``target`` of them."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    raw = (hi - lo) / max(1, target - 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def tick_label(value: float, step: float) -> str:
    """``value`` with as many decimals as ``step`` needs (0.25 -> 2, 2.5 -> 1, 1000 -> 0)."""
    decimals = 0
    while decimals < 6 and not math.isclose(step * 10**decimals, round(step * 10**decimals), abs_tol=1e-9):
        decimals += 1
    if abs(value) < abs(step) * 1e-9:
        value = 0.0  # not "-0.0"
    return f"{value:.{decimals}f}"


def tick_labels(ticks: Sequence[float]) -> list[str]:
    """Labels for a numeric axis; beyond five digits, scaled with a suffix (8G, not 8000000000)."""
    if not ticks:
        return []
    step = ticks[1] - ticks[0] if len(ticks) > 1 else (abs(ticks[0]) or 1.0)
    biggest = max(abs(t) for t in ticks)
    power = min(12, 3 * math.floor(math.log10(biggest) / 3)) if biggest >= 1e5 else 0
    scale = 10.0**power
    suffix = {0: "", 3: "k", 6: "M", 9: "G", 12: "T"}[power]
    return [tick_label(t / scale, step / scale) + suffix for t in ticks]


def time_ticks(lo: float, hi: float, max_ticks: int = 8) -> list[float]:
    """Instants on round multiples of the finest step that gives at most ``max_ticks`` (and at least 3)."""
    for step in _TIME_STEPS_S:
        first = math.ceil(lo / step) * step
        n = int((hi - first) // step) + 1
        if n <= max_ticks:
            return [first + i * step for i in range(n)] if n >= 3 else _fine(lo, hi, step)
    step = _TIME_STEPS_S[-1]
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) // step) + 1)]


def _fine(lo: float, hi: float, step: float) -> list[float]:
    """The step below ``step`` (more ticks than asked for beats fewer than three)."""
    finer = max((s for s in _TIME_STEPS_S if s < step), default=step)
    first = math.ceil(lo / finer) * finer
    return [first + i * finer for i in range(int((hi - first) // finer) + 1)]


_TIME_FORMATS = ("%m-%d %H:%M", "%H:%M", "%H:%M:%S", "%m-%d %H:%M:%S", "%Y-%m-%d %H:%M:%S")


def time_format(ticks: Sequence[float]) -> str:
    """The shortest format that tells the ticks apart, as a reader expects it."""
    if len(ticks) < 2:
        return "%H:%M:%S"
    step = min(b - a for a, b in itertools.pairwise(ticks))
    first_day, last_day = time.gmtime(ticks[0])[:3], time.gmtime(ticks[-1])[:3]
    if step < 60:
        start = 2
    elif ticks[-1] - ticks[0] < _DAY_S and first_day == last_day:
        start = 1
    else:
        start = 0
    formats = list(_TIME_FORMATS[start:])
    if first_day[0] != last_day[0]:
        formats = ["%Y-%m-%d %H:%M", *formats]  # month-day alone would not sort across new year
    for fmt in formats:
        labels = [time.strftime(fmt, time.gmtime(t)) for t in ticks]
        if len(set(labels)) == len(labels):
            return fmt
    return _TIME_FORMATS[-1]


# --------------------------------------------------------------------------- the figure


@dataclass
class _Frame:
    left: float
    top: float
    width: float
    height: float
    x0: float
    x1: float
    y0: float
    y1: float

    def px(self, x: np.ndarray) -> np.ndarray:
        return self.left + (x - self.x0) / (self.x1 - self.x0) * self.width

    def py(self, y: np.ndarray) -> np.ndarray:
        return self.top + self.height - (y - self.y0) / (self.y1 - self.y0) * self.height


def _y_range(panel: Panel) -> tuple[float, float]:
    values = [s.y[np.isfinite(s.y)] for s in (*panel.lines, *panel.points)]
    values = [v for v in values if v.size]
    if not values:
        return 0.0, 1.0
    lo = min(float(v.min()) for v in values)
    hi = max(float(v.max()) for v in values)
    if panel.y_from_zero:
        lo = min(0.0, lo)
    if hi - lo < 1e-12:
        pad = abs(hi) * 0.1 or 1.0
        return (lo if panel.y_from_zero else lo - pad), hi + pad
    pad = (hi - lo) * 0.05
    return (lo if panel.y_from_zero and lo == 0.0 else lo - pad), hi + pad


def _x_range(panels: Sequence[Panel], is_time: bool) -> tuple[float, float]:
    xs = [s.x[np.isfinite(s.x)] for p in panels for s in (*p.lines, *p.points)]
    xs = [x for x in xs if x.size]
    if not xs:
        now = time.time()
        return now - MIN_WINDOW_S, now
    lo, hi = min(float(x.min()) for x in xs), max(float(x.max()) for x in xs)
    if is_time and hi - lo < MIN_WINDOW_S:
        mid = (lo + hi) / 2
        lo, hi = mid - MIN_WINDOW_S / 2, mid + MIN_WINDOW_S / 2
    elif hi - lo < 1e-12:
        lo, hi = lo - 1.0, hi + 1.0
    margin = (hi - lo) * 0.02
    return lo - margin, hi + margin


def _path_d(px: np.ndarray, py: np.ndarray) -> str:
    """One path through the points, broken where a value is missing."""
    parts: list[str] = []
    pen_down = False
    for x, y in zip(px.tolist(), py.tolist(), strict=True):
        if not (math.isfinite(x) and math.isfinite(y)):
            pen_down = False
            continue
        parts.append(f"{'L' if pen_down else 'M'}{x:.1f} {y:.1f}")
        pen_down = True
    return "".join(parts)


def _dots_d(px: np.ndarray, py: np.ndarray, r: float) -> list[str]:
    return [f"M{x - r:.1f} {y:.1f}a{r} {r} 0 1 0 {2 * r} 0a{r} {r} 0 1 0 {-2 * r} 0"
            for x, y in zip(px.tolist(), py.tolist(), strict=True) if math.isfinite(x) and math.isfinite(y)]  # fmt: skip


def viridis(fraction: np.ndarray) -> list[str]:
    f = np.clip(np.nan_to_num(np.asarray(fraction, dtype=np.float64)), 0.0, 1.0) * (len(VIRIDIS) - 1)
    rgb = np.array([[int(c[i : i + 2], 16) for i in (1, 3, 5)] for c in VIRIDIS], dtype=np.float64)
    lo = np.floor(f).astype(int)
    hi = np.minimum(lo + 1, len(VIRIDIS) - 1)
    t = (f - lo)[:, None]
    mixed = np.rint(rgb[lo] * (1 - t) + rgb[hi] * t).astype(int)
    return [f"#{r:02x}{g:02x}{b:02x}" for r, g, b in mixed.tolist()]


def figure(key: str, panels: Sequence[Panel], *, is_time: bool = True, xlabel: str | None = None, width: float = 900.0,
           panel_height: float = 230.0, max_ticks: int = 8, colorbar: ColorBar | None = None) -> str:  # fmt: skip
    """The SVG of ``panels`` stacked over one shared x axis (time by default)."""
    left, right = 62.0, (92.0 if colorbar else 14.0)
    title_h = FONT + 8 if any(p.title for p in panels) else 6.0
    axis_label = "time (UTC)" if xlabel is None and is_time else (xlabel or "")
    bottom = 2 * FONT + 18 if axis_label else FONT + 12
    gap = 10.0
    plot_w = width - left - right
    height = title_h + len(panels) * panel_height + (len(panels) - 1) * gap + bottom
    x0, x1 = _x_range(panels, is_time)
    xt = [t for t in (time_ticks(x0, x1, max_ticks) if is_time else nice_ticks(x0, x1, 6)) if x0 <= t <= x1]
    if is_time:
        fmt = time_format(xt)
        xlabels = [time.strftime(fmt, time.gmtime(t)) for t in xt]
    else:
        xlabels = tick_labels(xt)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="DejaVu Sans, Arial, sans-serif" font-size="{FONT:g}" '
           f'id="{key}-figure">', f'<rect width="{width:.0f}" height="{height:.0f}" fill="#ffffff"/>']  # fmt: skip
    top = title_h
    for i, panel in enumerate(panels):
        y0, y1 = _y_range(panel)
        frame = _Frame(left, top, plot_w, panel_height, x0, x1, y0, y1)
        last = i == len(panels) - 1
        out.append(f'<g id="{key}-panel{i}">')
        if panel.title:
            out.append(f'<text x="{left:.1f}" y="{top - 6:.1f}" font-size="{FONT + 1:g}">{esc(panel.title)}</text>')
        _axes(out, key, frame, panel, xt, xlabels if last else None)
        out.append(f'<clipPath id="{key}-clip{i}"><rect x="{left:.1f}" y="{top:.1f}" width="{plot_w:.1f}" '
                   f'height="{panel_height:.1f}"/></clipPath><g clip-path="url(#{key}-clip{i})">')  # fmt: skip
        for s in panel.lines:
            d = _path_d(frame.px(s.x), frame.py(s.y))
            dash = f' stroke-dasharray="{DASHES[s.dash]}"' if s.dash else ""
            out.append(f'<path d="{d}" fill="none" stroke="{s.color}" stroke-width="1.4"{dash} stroke-linejoin="round"/>')
            if s.markers or s.x.size == 1:
                out.append(f'<path d="{"".join(_dots_d(frame.px(s.x), frame.py(s.y), 2.5))}" fill="{s.color}"/>')
        for p in panel.points:
            dots = _dots_d(frame.px(p.x), frame.py(p.y), p.radius)
            if isinstance(p.color, str):
                out.append(f'<path d="{"".join(dots)}" fill="{p.color}" fill-opacity="{p.opacity:g}"/>')
            else:
                by_color: dict[str, list[str]] = {}
                for dot, color in zip(dots, p.color, strict=False):
                    by_color.setdefault(color, []).append(dot)
                out += [f'<path d="{"".join(ds)}" fill="{c}"/>' for c, ds in by_color.items()]
        out.append("</g>")
        _legend(out, frame, panel)
        out.append("</g>")
        top += panel_height + gap
    if axis_label:
        out.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 6:.1f}" text-anchor="middle">{esc(axis_label)}</text>')
    if colorbar is not None:
        _colorbar(out, key, colorbar, left + plot_w + 18, title_h, panel_height)
    out.append("</svg>")
    return "".join(out)


def _axes(out: list[str], key: str, f: _Frame, panel: Panel, xt: list[float], xlabels: list[str] | None) -> None:
    yt = [t for t in nice_ticks(f.y0, f.y1) if f.y0 <= t <= f.y1]
    grid = "".join(f"M{f.left:.1f} {y:.1f}h{f.width:.1f}" for y in f.py(np.array(yt)).tolist())
    grid += "".join(f"M{x:.1f} {f.top:.1f}v{f.height:.1f}" for x in f.px(np.array(xt)).tolist())
    out.append(f'<path d="{grid}" stroke="#000000" stroke-opacity="0.12" stroke-width="0.8"/>')
    bottom = f.top + f.height
    out.append(f'<path d="M{f.left:.1f} {f.top:.1f}V{bottom:.1f}H{f.left + f.width:.1f}" fill="none" stroke="#333333" '
               'stroke-width="1"/>')  # fmt: skip
    for label, y in zip(tick_labels(yt), f.py(np.array(yt)).tolist(), strict=True):
        out.append(f'<text x="{f.left - 5:.1f}" y="{y + FONT / 3:.1f}" text-anchor="end">{label}</text>')
    if panel.ylabel:
        cy = f.top + f.height / 2
        out.append(f'<text x="14" y="{cy:.1f}" text-anchor="middle" transform="rotate(-90 14 {cy:.1f})">'
                   f"{esc(panel.ylabel)}</text>")  # fmt: skip
    if xlabels is not None:
        for i, (x, label) in enumerate(zip(f.px(np.array(xt)).tolist(), xlabels, strict=True)):
            out.append(f'<g class="xtick" id="{key}-xtick{i}"><path d="M{x:.1f} {bottom:.1f}v4" stroke="#333333"/>'
                       f'<text x="{x:.1f}" y="{bottom + FONT + 5:.1f}" text-anchor="middle">{esc(label)}</text></g>')  # fmt: skip


def _legend(out: list[str], f: _Frame, panel: Panel) -> None:
    entries = [(s.label, s.color, s.dash, False) for s in panel.lines if s.label]
    entries += [(p.label, p.color if isinstance(p.color, str) else "#777777", "", True) for p in panel.points if p.label]
    if not entries:
        return
    cols = max(1, min(panel.legend_columns, len(entries)))
    col_w = max(len(label) for label, *_ in entries) * _CHAR_W + 30
    rows = math.ceil(len(entries) / cols)
    x0, y0 = f.left + 8, f.top + 6
    out.append(f'<rect x="{x0 - 4:.1f}" y="{y0 - 2:.1f}" width="{cols * col_w:.1f}" height="{rows * (FONT + 5) + 4:.1f}" '
               'fill="#ffffff" fill-opacity="0.8"/>')  # fmt: skip
    for i, (label, color, dash, dot) in enumerate(entries):
        x = x0 + (i % cols) * col_w
        y = y0 + (i // cols) * (FONT + 5) + FONT / 2 + 1
        if dot:
            out.append(f'<path d="M{x + 7:.1f} {y:.1f}a3 3 0 1 0 6 0a3 3 0 1 0 -6 0" fill="{color}"/>')
        else:
            style = f' stroke-dasharray="{DASHES[dash]}"' if dash else ""
            out.append(f'<path d="M{x:.1f} {y:.1f}h20" stroke="{color}" stroke-width="1.6"{style}/>')
        out.append(f'<text x="{x + 25:.1f}" y="{y + FONT / 3:.1f}">{esc(label)}</text>')


def _colorbar(out: list[str], key: str, bar: ColorBar, x: float, top: float, height: float) -> None:
    stops = "".join(f'<stop offset="{i / (len(VIRIDIS) - 1):.3f}" stop-color="{c}"/>' for i, c in enumerate(VIRIDIS))
    out.append(f'<linearGradient id="{key}-cbar" x1="0" y1="1" x2="0" y2="0">{stops}</linearGradient>')
    out.append(f'<rect x="{x:.1f}" y="{top:.1f}" width="12" height="{height:.1f}" fill="url(#{key}-cbar)"/>')
    ticks = [t for t in nice_ticks(bar.low, bar.high) if bar.low <= t <= bar.high]
    span = (bar.high - bar.low) or 1.0
    for t, label in zip(ticks, tick_labels(ticks), strict=True):
        y = top + height - (t - bar.low) / span * height
        out.append(f'<path d="M{x + 12:.1f} {y:.1f}h3" stroke="#333333"/><text x="{x + 17:.1f}" y="{y + FONT / 3:.1f}">'
                   f"{label}</text>")  # fmt: skip
    cx = x + 62
    cy = top + height / 2
    out.append(f'<text x="{cx:.1f}" y="{cy:.1f}" text-anchor="middle" transform="rotate(-90 {cx:.1f} {cy:.1f})">'
               f"{esc(bar.label)}</text>")  # fmt: skip
