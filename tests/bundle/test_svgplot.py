"""The report's plotting path: what it draws is what the data says (gaps stay gaps, ticks are round and readable),
and one page can carry many of its figures (every id prefixed with the figure's key, every label escaped)."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import numpy as np

from diag.bundle import svgplot

T0 = 1_780_000_000.0


def _figure(*lines: svgplot.Line, key: str = "k") -> str:
    return svgplot.figure(key, [svgplot.Panel(list(lines), ylabel="GiB")])


def test_a_missing_value_breaks_the_line_instead_of_bridging_it() -> None:
    y = np.array([1.0, 2.0, np.nan, 4.0, 5.0])
    svg = _figure(svgplot.Line(T0 + np.arange(5.0), y, "#1f77b4", "used"))
    (d,) = [m for m in re.findall(r'<path d="([^"]*)" fill="none" stroke="#1f77b4"', svg)]
    assert d.count("M") == 2 and d.count("L") == 2  # two segments of two points each


def test_every_id_is_prefixed_and_the_figure_is_well_formed_xml() -> None:
    svg = svgplot.figure("throughput", [svgplot.Panel(points=[svgplot.Points(np.arange(5.0), np.arange(5.0),
                                                                             svgplot.viridis(np.linspace(0, 1, 5)))])],
                         is_time=False, colorbar=svgplot.ColorBar(0, 300, "seconds"))  # fmt: skip
    ids = re.findall(r'id="([^"]+)"', svg)
    assert ids and all(i.startswith("throughput-") for i in ids)
    assert all(ref.startswith("throughput-") for ref in re.findall(r"url\(#([^)]+)\)", svg))
    ET.fromstring(svg)  # parses


def test_labels_from_the_host_are_escaped() -> None:
    svg = _figure(svgplot.Line(T0 + np.arange(3.0), np.ones(3), "#000000", '/a<b>&"c" usage'))
    assert "/a&lt;b&gt;&amp;&quot;c&quot; usage" in svg
    ET.fromstring(svg)


def test_big_values_get_short_round_tick_labels() -> None:
    svg = _figure(svgplot.Line(T0 + np.arange(10.0), np.linspace(7.9e9, 8.3e9, 10), "#000000"))
    labels = re.findall(r'text-anchor="end">([^<]+)</text>', svg)
    assert labels and all(re.fullmatch(r"\d+\.\dG", label) for label in labels), labels
    assert svgplot.tick_labels(svgplot.nice_ticks(0, 1)) == ["0.00", "0.25", "0.50", "0.75", "1.00"]
    assert svgplot.tick_labels(svgplot.nice_ticks(-5, 1200)) == ["0", "500", "1000"]


def test_viridis_runs_from_dark_purple_to_yellow() -> None:
    assert svgplot.viridis(np.array([0.0, 1.0, 2.0, np.nan])) == ["#440154", "#fde725", "#fde725", "#440154"]
