"""Report charts: time ticks are distinct, readable and in order for any window from 10 s to 30 days, even with
only one to three points (an axis widened to days around them would read 00:00:00 on every tick)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from diag.bundle import charts
from diag.timeline import Series

NOON = datetime(2026, 2, 3, 12, 0, 0, tzinfo=UTC)
_TICK_RE = re.compile(r'<g class="xtick" id="memory-xtick\d+"><path d="M([0-9.]+) [^"]*"[^>]*/><text[^>]*>([^<]*)</text>')


def _ticks(start: datetime, window_s: float, points: int) -> list[tuple[float, str]]:
    """(x position in the SVG, label) of each x tick of the memory chart drawn from ``points`` samples."""
    ts = np.linspace(start.timestamp(), start.timestamp() + window_s, points)
    chart = charts.memory_chart(charts.ChartData(host={"used": Series(ts, np.full(points, 2.0**30))}))
    assert chart is not None
    return [(float(x), label) for x, label in _TICK_RE.findall(chart.svg)]


def _decode(label: str, start: datetime) -> datetime:
    """The instant a label names, the missing fields (year, date) taken from the window's start."""
    candidates = [(label, fmt) for fmt in ("%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M")]
    candidates += [(f"{start.year}-{label}", f"%Y-{fmt}") for fmt in ("%m-%d %H:%M:%S", "%m-%d %H:%M")]
    candidates += [(f"{start:%Y-%m-%d} {label}", f"%Y-%m-%d {fmt}") for fmt in ("%H:%M:%S", "%H:%M")]
    for text, fmt in candidates:
        try:
            return datetime.strptime(text, fmt).replace(tzinfo=UTC)
        except ValueError:
            continue
    raise AssertionError(f"tick label {label!r} is not a time")


@pytest.mark.parametrize(
    ("window_s", "shape"),
    [
        (10, r"\d\d:\d\d:\d\d"),
        (60, r"\d\d:\d\d:\d\d"),
        (3600, r"\d\d:\d\d"),
        (86400, r"\d\d-\d\d \d\d:\d\d"),
        (30 * 86400, r"\d\d-\d\d \d\d:\d\d"),
    ],
)
@pytest.mark.parametrize("points", [2, 3])
def test_ticks_are_distinct_readable_and_in_order(window_s: float, shape: str, points: int) -> None:
    ticks = _ticks(NOON, window_s, points)
    assert len(ticks) >= 3, ticks
    xs = [x for x, _ in ticks]
    labels = [label for _, label in ticks]
    assert xs == sorted(xs)
    assert len(set(labels)) == len(labels), labels
    assert all(re.fullmatch(shape, label) for label in labels), labels
    when = [_decode(label, NOON) for label in labels]
    assert when == sorted(when), labels
    # the ticks cover the data's window, not days around it
    assert when[0] >= NOON - timedelta(seconds=window_s) and when[-1] <= NOON + timedelta(seconds=2 * window_s)


@pytest.mark.parametrize("points", [1, 2])
def test_a_single_instant_gets_a_seconds_axis_around_it(points: int) -> None:
    ticks = _ticks(NOON, 0, points)
    labels = [label for _, label in ticks]
    assert len(labels) >= 3 and len(set(labels)) == len(labels), labels
    assert all(re.fullmatch(r"\d\d:\d\d:\d\d", label) for label in labels), labels
    assert {label[:5] for label in labels} <= {"11:59", "12:00"}, labels


def test_a_window_across_new_year_names_the_year() -> None:
    start = datetime(2026, 12, 20, 12, 0, 0, tzinfo=UTC)
    labels = [label for _, label in _ticks(start, 30 * 86400, 3)]
    assert len(set(labels)) == len(labels)
    when = [_decode(label, start) for label in labels]
    assert when == sorted(when), labels
