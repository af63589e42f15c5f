"""One formatter for evidence values: the terminal view and the bundle report print the same text."""

from __future__ import annotations

import math

from rich.console import Console

from diag.bundle import report
from diag.rules.base import Evidence, Finding
from diag.rules.engine import Analysis
from diag.units import format_bytes, format_seconds, format_value


def test_bytes_use_binary_prefixes_and_a_missing_sample_is_a_dash() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536 * 1024**2) == "1.5 GiB"
    assert format_bytes(None) == format_bytes(math.nan) == format_bytes(math.inf) == "-"


def test_seconds_in_ms_below_ten_seconds() -> None:
    assert format_seconds(0.0123) == "12 ms"
    assert format_seconds(9.9994) == "9999 ms"
    assert format_seconds(10.0) == "10.0 s"
    assert format_seconds(123.45) == "123.5 s"


def test_values_by_unit() -> None:
    assert format_value(3 << 30, "bytes") == "3.0 GiB"
    assert format_value(2048.0, "bytes/s") == "2.0 KiB/s"
    assert format_value(0.25, "s") == "250 ms"
    assert format_value(12.5, "s") == "12.5 s"
    assert format_value(True, "") == "True"
    assert format_value(None) == "—"
    assert report.value is format_value  # the report's filter is the same function


def test_the_terminal_view_prints_bytes_as_the_report_does() -> None:
    from diag.views.analysis import render_analysis

    f = Finding("memory_leak", "memory.leak", 0.9, "leak", [Evidence("anon growth", 3 << 30, "bytes")])
    console = Console(record=True, width=200)
    render_analysis(Analysis("memory_leak", [], [f], [], (0.0, 60.0), "test"), console)
    text = console.export_text()
    assert "anon growth: 3.0 GiB" in text and str(3 << 30) not in text
