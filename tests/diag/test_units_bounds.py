"""Bounds in option messages are spelled so the option reads them back: ``format_duration``/``format_size``
round-trip through ``parse_duration``/``parse_size`` and pick the largest whole unit."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from diag.units import format_duration, format_size, parse_duration, parse_size


@given(st.integers(min_value=1, max_value=10**7), st.sampled_from([0.001, 1.0, 60.0, 3600.0, 86400.0]))
def test_a_duration_bound_reads_back_exactly(count: int, unit: float) -> None:
    seconds = count * unit
    assert parse_duration(format_duration(seconds)) == seconds


@given(st.integers(min_value=1, max_value=2**50))
def test_a_size_bound_reads_back_exactly(value: int) -> None:
    assert parse_size(format_size(value)) == value


def test_the_largest_whole_unit_is_used() -> None:
    assert [format_duration(s) for s in (0.01, 2, 90, 3600, 400 * 86400)] == ["10ms", "2s", "90s", "1h", "400d"]
    assert [format_size(v) for v in (64 * 1024, 256 << 20, 1 << 30, 1000)] == ["64KiB", "256MiB", "1GiB", "1000"]
