"""``numstats.median``, ``theil_slope`` and the tie counts are what numpy and ``theilslopes`` give, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from diag.rules import numstats


def _cases() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    cases: list[np.ndarray] = [np.array([x]) for x in (0.0, -0.0, 1.5, np.inf)]
    for n in (2, 3, 4, 5, 8, 9, 48, 49, 300, 301):
        cases.append(rng.normal(1e9, 3e6, n))  # memory-sized values: the halving of a sum can round
        cases.append(rng.integers(0, 5, n).astype(np.float64))  # ties
        cases.append(np.nextafter(np.full(n, 1e308), np.inf) * rng.choice([-1.0, 1.0], n))  # sums overflow
        with_nan = rng.normal(size=n)
        with_nan[rng.integers(0, n)] = np.nan
        cases.append(with_nan)
        cases.append(np.r_[rng.normal(size=n - 1), np.inf])
    cases += [np.array([np.inf, -np.inf]), np.array([-0.0, -0.0]), np.array([-0.0, 0.0, -0.0])]
    return cases


@pytest.mark.parametrize("values", _cases(), ids=lambda v: f"n{v.size}")
def test_median_is_numpys_bit_for_bit(values: np.ndarray) -> None:
    want = np.median(values)
    got = numstats.median(values)
    assert got.tobytes() == np.float64(want).tobytes() or (np.isnan(got) and np.isnan(want))
    kept = values.copy()
    numstats.median(values)
    np.testing.assert_array_equal(values, kept)  # the input is left alone unless overwrite_input


def test_median_of_integers_and_lists_matches() -> None:
    ints = np.array([3, 1, 4, 1, 5, 9, 2, 6])
    assert numstats.median(ints) == np.median(ints) == 3.5
    assert numstats.median([2, 7, 1]) == np.median([2, 7, 1]) == 2.0
    two = numstats.median([1.0, 2.0])
    assert type(two) is np.float64 and two == 1.5  # numpy's own type, as np.median returns


@pytest.mark.parametrize("n", [2, 3, 8, 48, 200])
def test_theil_slope_is_theilslopes_slope_and_ties_are_uniques(n: int) -> None:
    rng = np.random.default_rng(n)
    for y, x in (
        (rng.normal(1e8, 1e6, n), np.sort(rng.uniform(0, 300, n))),
        (rng.integers(0, 4, n).astype(np.float64), rng.integers(0, 3, n).astype(np.float64)),  # ties in x and y
        (rng.normal(size=n), np.zeros(n)),  # all x equal: NaN
    ):
        want = numstats.theilslopes(y, x).slope
        got = numstats.theil_slope(y, x)
        assert np.float64(got).tobytes() == np.float64(want).tobytes() or (np.isnan(got) and np.isnan(want))
        _, counts = np.unique(y, return_counts=True)
        np.testing.assert_array_equal(numstats._tie_counts(y), counts[counts > 1])


@pytest.mark.parametrize("values", _cases(), ids=lambda v: f"n{v.size}")
def test_finite_median_is_numpys_median_of_the_finite_values(values: np.ndarray) -> None:
    finite = values[np.isfinite(values)]
    got = numstats.finite_median(values)
    if finite.size == 0:
        assert np.isnan(got)
    else:
        assert np.float64(got).tobytes() == np.float64(np.median(finite)).tobytes()
    assert isinstance(got, float)


def test_finite_median_leaves_out_nan_and_infinities_and_keeps_the_input() -> None:
    values = np.array([np.nan, 1.0, np.inf, 3.0, -np.inf, 2.0, 10.0])
    kept = values.copy()
    assert numstats.finite_median(values) == 2.5  # of 1, 2, 3, 10
    np.testing.assert_array_equal(values, kept)
    assert np.isnan(numstats.finite_median([np.nan, np.inf]))
    assert np.isnan(numstats.finite_median([]))
