"""diag.rules.numstats against scipy (a test-only dependency here), and the guard that the rules never import scipy.

Why: the rules engine dropped scipy to keep ``diag bundle`` under its memory budget, and its
verdicts must not move. Each replacement is checked on generated inputs -- ties, constant arrays,
n = 0/1/2, NaN -- against the scipy function it mirrors: bit-for-bit where the arithmetic is the same
(ranks, Theil-Sen pairs, tau-b), to 1e-9 relative where scipy evaluates a distribution its own way
(Student t, hypergeometric). The USL fit is judged by what matters, its weighted SSE against
curve_fit's. The last test replays the scenario fixtures in a fresh interpreter and asserts that
scipy was never loaded.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tracemalloc
import warnings
from fractions import Fraction
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diag.rules import numstats
from diag.rules.usl import concurrency_levels, fit_usl, usl

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "scenarios"
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _sps() -> ModuleType:
    """scipy.stats, or skip: scipy is only the reference here, not a dependency of diag/."""
    return pytest.importorskip("scipy.stats")


def _same(a: float, b: float, rtol: float = 0.0, atol: float = 0.0) -> bool:
    """Equal (both NaN counts as equal), or within ``rtol`` relative / ``atol`` absolute."""
    a, b = float(a), float(b)
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or abs(a - b) <= max(rtol * max(abs(a), abs(b)), atol)


TINY_P = 1e-300  # below this scipy's distribution code flushes p to 0 where ours returns a subnormal: both mean "never"


# Values drawn from a few levels make ties likely; finite floats cover the rest. NaN is added separately.
_tied = st.sampled_from([-2.0, 0.0, 0.5, 1.0, 3.0, 1e6])
_value = st.one_of(_tied, st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False))


@st.composite
def _pairs(draw: st.DrawFn, max_n: int = 40, nan: bool = True) -> tuple[np.ndarray, np.ndarray]:
    n = draw(st.integers(0, max_n))
    x = np.array(draw(st.lists(_value, min_size=n, max_size=n)), dtype=np.float64)
    y = np.array(draw(st.lists(_value, min_size=n, max_size=n)), dtype=np.float64)
    if nan and n and draw(st.integers(0, 9)) == 0:  # now and then a NaN, as an unfiltered caller would pass
        y[draw(st.integers(0, n - 1))] = np.nan
    return x, y


# --------------------------------------------------------------------------- normal distribution


@SETTINGS
@given(st.floats(-37.0, 37.0))  # beyond 37 the tail is subnormal (< 1e-300)
def test_norm_sf_matches_scipy(x: float) -> None:
    assert _same(numstats.norm_sf(x), _sps().norm.sf(x), 1e-12)


@SETTINGS
@given(st.one_of(st.floats(1e-300, 1.0 - 1e-16), st.sampled_from([0.0, 1.0, 0.5, 0.975, 0.025, 1 - 0.95 / 2])))
def test_norm_ppf_matches_scipy(p: float) -> None:
    assert _same(numstats.norm_ppf(p), _sps().norm.ppf(p), 1e-14)


def test_norm_ppf_outside_unit_interval_is_nan() -> None:
    assert math.isnan(numstats.norm_ppf(-0.1)) and math.isnan(numstats.norm_ppf(1.5)) and math.isnan(numstats.norm_ppf(math.nan))


# --------------------------------------------------------------------------- ranks


@SETTINGS
@given(_pairs(max_n=60))
def test_rankdata_is_scipys_average_ranks(xy: tuple[np.ndarray, np.ndarray]) -> None:
    _, y = xy
    assert np.array_equal(numstats.rankdata(y), _sps().rankdata(y), equal_nan=True)


# --------------------------------------------------------------------------- Theil-Sen


def _theil_equal(y: np.ndarray, x: np.ndarray | None) -> None:
    sps = _sps()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scipy warns on all-equal x / too few points; numstats just says NaN
        ref = sps.theilslopes(y, x)
    got = numstats.theilslopes(y, x)
    for field, a, b in zip(got._fields, got, ref, strict=True):
        assert _same(a, b, 1e-12), (field, a, b)


@SETTINGS
@given(_pairs(max_n=40))
def test_theilslopes_matches_scipy_with_ties_and_nan(xy: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = xy
    _theil_equal(y, x)


@SETTINGS
@given(st.lists(_value, min_size=0, max_size=30))
def test_theilslopes_default_x_matches_scipy(y: list[float]) -> None:
    _theil_equal(np.array(y, dtype=np.float64), None)


def test_theilslopes_degenerate_inputs() -> None:
    for x, y in [([], []), ([1.0], [2.0]), ([1.0, 2.0], [0.0, 1.0]), ([3.0, 3.0, 3.0], [1.0, 2.0, 3.0]), ([1, 2, 3], [5, 5, 5])]:
        _theil_equal(np.array(y, dtype=np.float64), np.array(x, dtype=np.float64))
    assert numstats.theilslopes([0.0, 1.0], [0.0, 1.0]).slope == 1.0
    assert math.isnan(numstats.theilslopes([1.0, 2.0, 3.0], [4.0, 4.0, 4.0]).slope)  # every x tied: no pair has a slope


def test_theilslopes_2000_points_matches_scipy_in_bounded_memory() -> None:
    """The config rule's largest input (it strides to 2000 buckets): same answer, pair slopes only in memory."""
    rng = np.random.default_rng(7)
    x = np.round(rng.uniform(0, 50, 2000), 1)  # ties in x, as time-averaged concurrency has
    y = 3e6 * x + rng.standard_cauchy(2000) * 1e6
    tracemalloc.start()
    try:
        got = numstats.theilslopes(y, x)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20 * 2**20, f"peak {peak / 2**20:.1f} MiB"  # 15 MiB of pair slopes + block temporaries (scipy: ~95)
    ref = _sps().theilslopes(y, x)
    assert tuple(got) == pytest.approx(tuple(float(v) for v in ref), rel=1e-12)


# --------------------------------------------------------------------------- Spearman, Student t


@SETTINGS
@given(_pairs(max_n=60))
def test_spearmanr_matches_scipy(xy: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = xy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # constant input
        ref = _sps().spearmanr(x, y)
    got = numstats.spearmanr(x, y)
    assert _same(got.statistic, ref.statistic, 1e-12), (got, ref)
    assert _same(got.pvalue, ref.pvalue, 1e-9, TINY_P), (got, ref)


def test_spearmanr_large_correlated_sample() -> None:
    rng = np.random.default_rng(3)
    for n in (12, 400, 5000):
        a = rng.normal(size=n)
        b = 0.1 * a + rng.normal(size=n)
        ref, got = _sps().spearmanr(a, b), numstats.spearmanr(a, b)
        assert _same(got.statistic, ref.statistic, 1e-12) and _same(got.pvalue, ref.pvalue, 1e-9, TINY_P), (n, got, ref)
    perfect = numstats.spearmanr(np.arange(10.0), np.arange(10.0) ** 3)  # monotone: rho 1 (to corrcoef's rounding), p ~0
    ref = _sps().spearmanr(np.arange(10.0), np.arange(10.0) ** 3)
    assert perfect.statistic == pytest.approx(1.0) and perfect.pvalue < 1e-50
    assert _same(perfect.statistic, ref.statistic, 1e-12) and _same(perfect.pvalue, ref.pvalue, 1e-9, TINY_P)


@SETTINGS
@given(st.floats(-60.0, 60.0), st.sampled_from([1, 2, 3, 5, 8, 13, 30, 100, 1000, 9998]))
def test_student_t_sf_matches_scipy(t: float, df: int) -> None:
    special = pytest.importorskip("scipy.special")
    ours = numstats.student_t_sf(t, df)
    # Relative 1e-9 (the tails), or 5e-9 absolute in the body: near t = 0 scipy's stdtr itself is off by up to
    # ~2.4e-9 (df 1, t 3.78e-9: exactly 0.5 where the Cauchy's closed form, 0.5 - atan(t)/pi, gives ours,
    # 0.4999999987957; the largest gap over 22 000 |t| from 1e-12 to 1e-5 in every df here was 2.37e-9).
    assert _same(ours, special.stdtr(df, -t), 1e-9, max(TINY_P, 5e-9))
    if df == 1:  # the Cauchy: exact to rounding
        assert _same(ours, 0.5 - math.atan(t) / math.pi, 1e-12, TINY_P)


# --------------------------------------------------------------------------- Kendall tau-b


@SETTINGS
@given(_pairs(max_n=60))
def test_kendalltau_matches_scipy(xy: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = xy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scipy warns on fewer than 2 points
        ref = _sps().kendalltau(x, y).statistic
    assert _same(numstats.kendalltau(x, y), ref, 1e-12)


def test_kendalltau_at_the_call_sites_size() -> None:
    """The request rule strides to 20 000 rows: load levels (many ties) against service times."""
    rng = np.random.default_rng(11)
    load = rng.integers(0, 40, 20_000).astype(np.float64)
    service = np.round(0.05 + 0.002 * load + rng.exponential(0.02, load.size), 3)
    assert _same(numstats.kendalltau(load, service), _sps().kendalltau(load, service).statistic, 1e-12)
    assert numstats.kendalltau(load, -load) == -1.0
    assert math.isnan(numstats.kendalltau(load, np.full(load.size, 2.0)))  # constant: undefined, as scipy


# --------------------------------------------------------------------------- Fisher's exact test


@SETTINGS
@given(st.lists(st.integers(0, 300), min_size=4, max_size=4))
def test_fisher_exact_greater_matches_scipy(cells: list[int]) -> None:
    table = [cells[:2], cells[2:]]
    ref = _sps().fisher_exact(table, alternative="greater").pvalue
    assert _same(numstats.fisher_exact(table, alternative="greater"), ref, 1e-9, TINY_P), table


def _exact_greater(a: int, b: int, c: int, d: int) -> float:
    """P(top-left >= a) with exact rational arithmetic: the reference both implementations are held to."""
    m, k, n = a + b + c + d, a + b, a + c
    total, term, x = Fraction(0), Fraction(1), a
    while x <= min(k, n) and (term > Fraction(1, 10**30) * total or total == 0):
        total += term
        term *= Fraction((k - x) * (n - x), (x + 1) * (m - k - n + x + 1))
        x += 1
    return float(math.comb(k, a) * math.comb(m - k, n - a) * total / math.comb(m, n))


@pytest.mark.parametrize(
    "cells",
    [(11, 0, 3, 96), (30, 70, 40, 860), (5, 0, 0, 5), (300, 2000, 9000, 80000), (40, 60, 50, 70), (2000, 30000, 50000, 918000)],
)
def test_fisher_exact_greater_is_exact_on_large_tables(cells: tuple[int, int, int, int]) -> None:
    """The last table is a day of requests: there scipy's own p is ~1e-10 off the exact value; ours is not."""
    got = numstats.fisher_exact([list(cells[:2]), list(cells[2:])])
    assert _same(got, _exact_greater(*cells), 1e-12)


def test_fisher_exact_edges() -> None:
    assert numstats.fisher_exact([[0, 5], [0, 7]]) == 1.0  # a column sum of 0: no information, as scipy
    assert numstats.fisher_exact([[0, 0], [3, 7]]) == 1.0
    with pytest.raises(ValueError):
        numstats.fisher_exact([[1, 2], [3, 4]], alternative="two-sided")  # not implemented: no call site uses it
    with pytest.raises(ValueError):
        numstats.fisher_exact([[1, -2], [3, 4]])


# --------------------------------------------------------------------------- USL fit


def _curve_fit_cost(n: np.ndarray, x: np.ndarray, x_sigma: np.ndarray, p0: tuple[float, float, float]) -> float:
    optimize = pytest.importorskip("scipy.optimize")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            popt, _ = optimize.curve_fit(
                usl, n, x, p0=p0, sigma=x_sigma, bounds=([1e-12, 0.0, 0.0], [np.inf, 1.0, np.inf]), maxfev=5000
            )
    except RuntimeError:
        return math.inf  # curve_fit gave up; any finite fit of ours is then better
    return float((((usl(n, *popt) - x) / x_sigma) ** 2).sum())


def _usl_case(n: np.ndarray, x: np.ndarray, counts: np.ndarray) -> tuple[float, float]:
    x_sigma = 1.0 / np.sqrt(counts)
    lam0 = float(x[np.argmin(n)] / max(n.min(), 1e-9)) or float(x.max())
    p0 = (max(lam0, 1e-9), 0.05, 1e-3)
    fit = numstats.usl_fit(n, x, x_sigma, p0)
    assert fit is not None
    assert fit.lam > 0 and 0.0 <= fit.sigma <= 1.0 and fit.kappa >= 0.0
    ours = float((((usl(n, fit.lam, fit.sigma, fit.kappa) - x) / x_sigma) ** 2).sum())
    assert ours == pytest.approx(fit.cost, rel=1e-9, abs=1e-12)
    return ours, _curve_fit_cost(n, x, x_sigma, p0)


@pytest.mark.parametrize("seed", range(12))
def test_usl_fit_is_at_least_as_good_as_curve_fit_on_noisy_usl_data(seed: int) -> None:
    rng = np.random.default_rng(seed)
    lam, sigma, kappa = rng.uniform(0.5, 20), rng.uniform(0, 0.6), 10 ** rng.uniform(-5, -1)
    n = np.sort(rng.choice(np.arange(1, 33), size=int(rng.integers(4, 20)), replace=False)).astype(np.float64)
    counts = rng.integers(1, 60, n.size).astype(np.float64)
    x = np.clip(usl(n, lam, sigma, kappa) * (1 + rng.normal(0, 0.08, n.size) / np.sqrt(counts)), 0, None)
    ours, theirs = _usl_case(n, x, counts)
    assert ours <= theirs * 1.01 + 1e-9, (ours, theirs)


@pytest.mark.parametrize(
    "case",
    ["flat", "linear", "four_levels", "retrograde_cliff", "zeros_then_flat", "single_busy_level"],
)
def test_usl_fit_degenerate_inputs(case: str) -> None:
    n = np.arange(1.0, 13.0)
    counts = np.full(n.size, 10.0)
    if case == "flat":
        x = np.full(n.size, 7.0)
    elif case == "linear":
        x = 2.5 * n
    elif case == "four_levels":
        n, counts = np.array([1.0, 2.0, 4.0, 8.0]), np.array([5.0, 9.0, 30.0, 2.0])
        x = np.array([3.1, 5.9, 9.8, 11.0])
    elif case == "retrograde_cliff":  # rises, then collapses: the fit runs along a ridge (lam, kappa -> inf)
        n, counts = np.array([9.0, 11.0, 11.8, 13.0, 13.9, 15.8]), np.array([3.0, 3.0, 9.0, 9.0, 3.0, 2.0])
        x = np.array([56.0, 118.5, 120.5, 143.0, 39.7, 8.0])
    elif case == "zeros_then_flat":
        x = np.where(n < 4, 0.0, 5.0)
    else:
        counts = np.where(n == 12, 500.0, 1.0)
        x = np.minimum(n, 6.0)
    ours, theirs = _usl_case(n, x, counts)
    assert ours <= theirs * 1.01 + 1e-9, (ours, theirs)


def test_usl_fit_recovers_the_true_parameters_without_noise() -> None:
    n = np.arange(1.0, 25.0)
    x = usl(n, 12.0, 0.08, 0.004)
    fit = numstats.usl_fit(n, x, np.ones(n.size), (12.0, 0.05, 1e-3))
    assert fit is not None
    assert (fit.lam, fit.sigma, fit.kappa) == pytest.approx((12.0, 0.08, 0.004), rel=1e-6)
    flat = numstats.usl_fit(n, np.full(n.size, 4.0), np.ones(n.size), (4.0, 0.05, 1e-3))
    assert flat is not None and flat.sigma == pytest.approx(1.0) and flat.kappa == pytest.approx(0.0, abs=1e-9)


def test_fit_usl_on_buckets_finds_the_retrograde_peak() -> None:
    """Through fit_usl (bucket -> level grouping) as the request rules call it: N* where the true curve peaks."""
    rng = np.random.default_rng(5)
    n = rng.uniform(0.6, 24, 600)
    x = usl(n, 10.0, 0.05, 0.01) * rng.normal(1, 0.03, n.size)
    fit = fit_usl(n, x)
    assert fit is not None and fit.retrograde
    assert fit.n_star == pytest.approx(math.sqrt(0.95 / 0.01), rel=0.1)
    levels, level_x, counts = concurrency_levels(n, x)
    ours, theirs = _usl_case(levels, level_x, counts)
    assert ours <= theirs * 1.01 + 1e-9


# --------------------------------------------------------------------------- the guard: no scipy in the rules


_REPLAY = """
import json, sys
from pathlib import Path
from diag.rules.engine import analyze
from diag.demo.scenarios.recording import read_jsonl_gz
from diag.timeline import timeline_from_records
primaries = {}
for path in sorted(Path(sys.argv[1]).glob("*.jsonl.gz")):
    primaries[path.name] = analyze(timeline_from_records(read_jsonl_gz(path), source=path.name)).primary
print(json.dumps({"scipy": sorted(m for m in sys.modules if m == "scipy" or m.startswith("scipy.")), "primaries": primaries}))
"""


@pytest.mark.process
def test_rules_engine_runs_every_fixture_without_importing_scipy() -> None:
    """A fresh interpreter: import the engine, analyze every replay fixture (every rule family runs), no scipy loaded."""
    out = subprocess.run(
        [sys.executable, "-c", _REPLAY, str(FIXTURES)], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(result["primaries"]) >= 5, result  # the fixtures were found and analysed
    assert result["scipy"] == [], f"scipy modules loaded by the rules: {result['scipy'][:5]}"
