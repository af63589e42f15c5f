"""The few statistics the rules need, in numpy + stdlib: so that ``diag analyze``/``diag bundle`` never import scipy.

Why not scipy: importing ``scipy.stats`` alone costs ~97 MiB of peak RSS (``scipy.optimize`` ~75 MiB)
against 25 MiB for numpy, and the bundle has to stay under 150 MiB on a machine that is already
short of memory. The rules use only a handful of functions, each small enough to write here.

Each function mirrors one scipy definition (named in its docstring, scipy 1.17) closely enough that
a rule cannot tell them apart: the same pairs, ranks, tie corrections and order of floating-point
operations where that is cheap. tests/diag/test_numstats.py checks them against scipy (a test-only
dependency) on generated inputs, and that importing and running the rules loads no scipy.

Only what the call sites use is implemented: ``kendalltau`` returns the tau-b statistic (no
p-value), ``fisher_exact`` the one-sided ``alternative='greater'`` p-value, ``spearmanr`` the
statistic and its two-sided t-test p-value.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any, NamedTuple

import numpy as np

_NORMAL = NormalDist()
_PAIR_BLOCK = 1 << 16  # Theil-Sen: pair differences are formed this many at a time (0.5 MiB per temporary)


# --------------------------------------------------------------------------- normal distribution


def norm_sf(x: float) -> float:
    """Upper tail P(Z > x) of the standard normal, as ``scipy.stats.norm.sf`` (= ``ndtr(-x)``).

    ``0.5 * erfc(x / sqrt 2)`` keeps full relative precision far into the upper tail, where
    ``1 - cdf`` would round to 0; it agrees with scipy to ~1e-13 relative even at x = 30.
    """
    return 0.5 * math.erfc(x / math.sqrt(2.0))


def norm_ppf(p: float) -> float:
    """Quantile of the standard normal, as ``scipy.stats.norm.ppf``: -inf at 0, inf at 1, NaN outside [0, 1].

    ``statistics.NormalDist.inv_cdf`` (Wichura's AS241) agrees with scipy's ``ndtri`` to a few ulp.
    """
    if p == 0.0:
        return -math.inf
    if p == 1.0:
        return math.inf
    if not 0.0 < p < 1.0:
        return math.nan
    return _NORMAL.inv_cdf(p)


# --------------------------------------------------------------------------- median


def median(a: Any, overwrite_input: bool = False) -> np.float64:
    """``np.median`` of a 1-D array (or sequence), bit for bit, at a fraction of its cost on small inputs.

    Why: the rules take the median of a few hundred short series per analysis (every process's
    USS, every trough spacing), and ``np.median``'s generic axis handling costs ~20 us a call --
    most of the live diagnosis's time in them. Same arithmetic: the middle value, or the two middle
    values added and halved, each sum started from +0.0 (``np.mean``); NaN when any value is NaN;
    empty inputs go to ``np.median`` itself (its warning and NaN).
    """
    arr = np.asarray(a, dtype=np.float64).ravel() if not (isinstance(a, np.ndarray) and a.dtype == np.float64) else a
    n = arr.size
    if n == 0 or arr.ndim != 1:
        return np.float64(np.median(arr))
    part = arr if overwrite_input else arr.copy()
    h = n // 2
    part.partition([h - 1, h, n - 1] if n % 2 == 0 and n > 1 else [h, n - 1])  # the largest last: NaN sorts there
    if part[n - 1] != part[n - 1]:
        return np.float64(np.nan)
    zero = np.float64(0.0)  # np.mean's sum starts from +0.0: a median of -0.0 is +0.0
    return zero + part[h] if n % 2 else (zero + part[h - 1] + part[h]) / np.float64(2.0)


def finite_median(a: Any) -> float:
    """The median of the finite values (NaN and infinities left out), NaN when none is left.

    Why apart from ``median``: request tables carry NaN for what a request never reached (no start,
    no inference time), and a quartile's median must speak for the requests that have the value.
    """
    arr = np.asarray(a, dtype=np.float64)
    arr = arr[np.isfinite(arr)]
    return float(median(arr, overwrite_input=True)) if arr.size else math.nan


# --------------------------------------------------------------------------- ranks


def rankdata(a: np.ndarray) -> np.ndarray:
    """Ranks 1..n with ties given their average rank, as ``scipy.stats.rankdata(a)`` (method='average').

    Like scipy's default ``nan_policy='propagate'``: any NaN makes every rank NaN. Ranks are exact
    (integers and half-integers), so they match scipy bit for bit.
    """
    arr = np.asarray(a).ravel()
    if arr.dtype.kind in "fc" and np.isnan(arr).any():
        return np.full(arr.size, np.nan)
    sorter = np.argsort(arr, kind="stable")
    inv = np.empty(sorter.size, dtype=np.intp)
    inv[sorter] = np.arange(sorter.size, dtype=np.intp)
    arr = arr[sorter]
    obs = np.r_[True, arr[1:] != arr[:-1]]
    dense = obs.cumsum()[inv]
    count = np.r_[np.nonzero(obs)[0], len(obs)]
    return 0.5 * (count[dense] + count[dense - 1] + 1)


def _dense_ranks(v: np.ndarray) -> np.ndarray:
    """1-based dense ranks of an already sorted array (equal values share a rank)."""
    return np.r_[True, v[1:] != v[:-1]].cumsum(dtype=np.intp)


def _tie_counts(v: np.ndarray) -> np.ndarray:
    """Sizes of the groups of equal values that have at least two members (no NaN: the callers refuse them).

    A sort and a diff, as ``np.unique(return_counts=True)`` does inside, without its overhead (a
    Theil-Sen line asks three times, and the rules draw a few hundred lines per analysis).
    """
    if v.size == 0:
        return np.empty(0, dtype=np.int64)
    s = np.sort(v)
    counts = np.diff(np.flatnonzero(np.r_[True, s[1:] != s[:-1], True]))
    return counts[counts > 1].astype(np.int64)


# --------------------------------------------------------------------------- Theil-Sen


class TheilSlopes(NamedTuple):
    slope: float
    intercept: float
    low_slope: float
    high_slope: float


def _pair_slopes(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Slopes (y_j - y_i) / (x_j - x_i) over every pair with x_j > x_i, in no particular order.

    The same pairs and the same two subtractions and one division per pair as scipy, so each slope
    is bit-identical. Memory is the result (8 bytes a pair: 15 MiB at n = 2000) plus ~2 MiB of
    block temporaries: ~18 MiB at peak, where scipy's n x n matrices take ~95 MiB.
    """
    order = np.argsort(x, kind="stable")
    xs, ys = x[order], y[order]
    n = xs.size
    ties = _tie_counts(xs)
    total = n * (n - 1) // 2 - int((ties * (ties - 1) // 2).sum())
    out = np.empty(total, dtype=np.float64)
    rows = max(1, _PAIR_BLOCK // max(n, 1))
    k = 0
    for i0 in range(0, n - 1, rows):
        i1 = min(n - 1, i0 + rows)
        # after sorting, x_j > x_i only for j > i: the columns start at i0 + 1
        dx = xs[None, i0 + 1 :] - xs[i0:i1, None]
        keep = dx > 0
        dy = ys[None, i0 + 1 :] - ys[i0:i1, None]
        m = int(keep.sum())
        with np.errstate(over="ignore"):  # a huge rise over a tiny step is an infinite slope, as in scipy
            np.divide(dy[keep], dx[keep], out=out[k : k + m])
        k += m
    return out[:k]


def theil_slope(y: np.ndarray, x: np.ndarray) -> float:
    """``theilslopes(y, x).slope`` alone (no confidence band): what a detrending step needs, at less cost."""
    yv = np.array(y, dtype=np.float64).ravel()
    xv = np.array(x, dtype=np.float64).ravel()
    if xv.size != yv.size:
        raise ValueError("x and y must have the same length")
    if yv.size < 2 or np.isnan(xv).any() or np.isnan(yv).any():
        return math.nan
    slopes = _pair_slopes(xv, yv)
    return float(median(slopes, overwrite_input=True)) if slopes.size else math.nan


def theilslopes(y: np.ndarray, x: np.ndarray | None = None, alpha: float = 0.95) -> TheilSlopes:
    """Theil-Sen line and the confidence band of its slope, as ``scipy.stats.theilslopes`` (method='separate').

    slope: median of the slopes of all pairs with x_j > x_i (pairs tied in x are skipped);
    intercept: median(y) - slope * median(x); low/high: Sen (1968) eq. 2.6 order statistics of the
    pair slopes at confidence ``alpha``, with the x- and y-tie corrections of the variance. NaN in
    either input, fewer than 2 points, or all x equal: every field NaN (scipy's 'propagate').

    O(n^2) pairs, as scipy's: the rules call it on at most a few dozen troughs, and
    ``diag.rules.config`` strides its input down to 2000 points (~18 MiB at peak, see
    ``_pair_slopes``). The order statistics are found by in-place partitioning, not a sort.
    """
    yv = np.array(y, dtype=np.float64).ravel()
    xv = np.arange(yv.size, dtype=np.float64) if x is None else np.array(x, dtype=np.float64).ravel()
    if xv.size != yv.size:
        raise ValueError("x and y must have the same length")
    nan = TheilSlopes(math.nan, math.nan, math.nan, math.nan)
    if yv.size < 2 or np.isnan(xv).any() or np.isnan(yv).any():
        return nan
    slopes = _pair_slopes(xv, yv)
    nt = slopes.size
    if nt == 0:
        return nan
    medslope = median(slopes, overwrite_input=True)
    medinter = median(yv) - medslope * median(xv)
    a = 1.0 - alpha if alpha > 0.5 else alpha
    z = norm_ppf(a / 2.0)
    ny = yv.size
    tx, ty = _tie_counts(xv), _tie_counts(yv)
    ties_x, ties_y = int((tx * (tx - 1) * (2 * tx + 5)).sum()), int((ty * (ty - 1) * (2 * ty + 5)).sum())
    sigsq = 1 / 18.0 * (ny * (ny - 1) * (2 * ny + 5) - ties_x - ties_y)
    if not (sigsq >= 0 and math.isfinite(z)):
        return TheilSlopes(float(medslope), float(medinter), math.nan, math.nan)
    sigma = math.sqrt(sigsq)
    ru = min(int(np.round((nt - z * sigma) / 2.0)), nt - 1)
    rl = max(int(np.round((nt + z * sigma) / 2.0)) - 1, 0)
    slopes.partition(sorted({rl, ru}))
    return TheilSlopes(float(medslope), float(medinter), float(slopes[rl]), float(slopes[ru]))


# --------------------------------------------------------------------------- rank correlations


class Spearman(NamedTuple):
    statistic: float
    pvalue: float  # two-sided


def spearmanr(a: np.ndarray, b: np.ndarray) -> Spearman:
    """Spearman's rho and its two-sided p-value, as ``scipy.stats.spearmanr(a, b)``.

    rho is the Pearson correlation (``np.corrcoef``, as scipy) of the average ranks; the p-value is
    scipy's t approximation: t = rho * sqrt((n - 2) / ((1 + rho)(1 - rho))) on n - 2 degrees of
    freedom, p = 2 * P(T > |t|). Fewer than 2 points, a constant input or any NaN: (NaN, NaN);
    with 2 points the p-value is NaN (no degrees of freedom), as in scipy.
    """
    av = np.asarray(a, dtype=np.float64).ravel()
    bv = np.asarray(b, dtype=np.float64).ravel()
    if av.size != bv.size:
        raise ValueError("a and b must have the same length")
    n = av.size
    if n <= 1 or (av[0] == av).all() or (bv[0] == bv).all() or np.isnan(av).any() or np.isnan(bv).any():
        return Spearman(math.nan, math.nan)
    ranked = np.column_stack((rankdata(av), rankdata(bv)))
    rs = np.corrcoef(ranked, rowvar=False)[1, 0]
    dof = n - 2
    with np.errstate(divide="ignore", invalid="ignore"):  # rho = +-1: t is infinite (p = 0); n = 2: 0/0, NaN
        t = rs * np.sqrt(np.clip(dof / ((rs + 1.0) * (1.0 - rs)), 0.0, None))
    return Spearman(float(rs), 2.0 * student_t_sf(abs(float(t)), dof))


def _inversions(r: np.ndarray) -> int:
    """Pairs i < j with r[i] > r[j] (r: non-negative integer ranks), by a bottom-up merge sort in numpy.

    At each level every block of width w is sorted; for each element of a right block a binary
    search counts the larger elements of its left partner, then the pairs of blocks are merged by
    one sort of (pair index, value) keys. log2(n) levels of an O(n log n) sort: 20 000 points take
    a few milliseconds, with a handful of n-sized arrays in memory.
    """
    n = r.size
    a = r.astype(np.int64)
    base = int(a.max()) + 1 if n else 1
    pos = np.arange(n, dtype=np.int64)
    total = 0
    w = 1
    while w < n:
        pair = pos // (2 * w)
        right = (pos // w) % 2 == 1
        key = pair * base + a  # left blocks, in order, are globally sorted: keys of pair p < keys of pair p + 1
        left_keys, left_pair = key[~right], pair[~right]
        ends = np.searchsorted(left_pair, pair[right], "right")  # one past the last left element of the same pair
        total += int((ends - np.searchsorted(left_keys, key[right], "right")).sum())
        a = np.sort(key) - pair * base  # each pair's elements stay in its own positions, now sorted
        w *= 2
    return total


def kendalltau(x: np.ndarray, y: np.ndarray) -> float:
    """Kendall's tau-b statistic, as ``scipy.stats.kendalltau(x, y).statistic`` (variant='b').

    Only the statistic: the one call site (``diag.rules.requestload``) reads nothing else, so no
    p-value is computed. (C - D) / sqrt((P - Tx)(P - Ty)) with the discordant pairs D counted by
    merge-sort inversions (O(n log^2 n)) and scipy's tie bookkeeping, clipped to [-1, 1]. Fewer
    than 2 points, any NaN, or one input constant: NaN.
    """
    xv = np.asarray(x, dtype=np.float64).ravel()
    yv = np.asarray(y, dtype=np.float64).ravel()
    if xv.size != yv.size:
        raise ValueError("x and y must have the same length")
    size = xv.size
    if size < 2 or np.isnan(xv).any() or np.isnan(yv).any():
        return math.nan
    perm = np.argsort(yv)
    xv, yv = xv[perm], yv[perm]
    yr = _dense_ranks(yv)
    perm = np.argsort(xv, kind="stable")  # ties in x keep y ascending: no discordance within an x tie
    xv, yr = xv[perm], yr[perm]
    xr = _dense_ranks(xv)
    dis = _inversions(yr)
    obs = np.r_[True, (xr[1:] != xr[:-1]) | (yr[1:] != yr[:-1]), True]
    cnt = np.diff(np.nonzero(obs)[0]).astype(np.int64)
    ntie = int((cnt * (cnt - 1) // 2).sum())
    cx, cy = np.bincount(xr).astype(np.int64), np.bincount(yr).astype(np.int64)
    xtie = int((cx * (cx - 1) // 2).sum())
    ytie = int((cy * (cy - 1) // 2).sum())
    tot = size * (size - 1) // 2
    if xtie == tot or ytie == tot:
        return math.nan
    con_minus_dis = tot - xtie - ytie + ntie - 2 * dis
    tau = con_minus_dis / np.sqrt(np.float64(tot - xtie)) / np.sqrt(np.float64(tot - ytie))
    return float(min(1.0, max(-1.0, tau)))


# --------------------------------------------------------------------------- Student's t


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz), for x < (a + 1) / (a + b + 2)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c = 1.0
    d = 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 100_000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return h


def _betainc(a: float, b: float, x: float, y: float) -> float:
    """Regularised incomplete beta I_x(a, b); ``y`` = 1 - x, passed separately so neither loses precision."""
    if x <= 0.0:
        return 0.0
    if y <= 0.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - _betainc(b, a, y, x)
    log_x = math.log(x) if x < 0.5 else math.log1p(-y)
    log_y = math.log(y) if y < 0.5 else math.log1p(-x)
    lbeta = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    return math.exp(a * log_x + b * log_y - lbeta) / a * _betacf(a, b, x)


def student_t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with ``df`` degrees of freedom, as ``scipy.special.stdtr(df, -t)``.

    0.5 * I_{df/(df+t^2)}(df/2, 1/2) by the incomplete beta continued fraction. Relative error
    ~1e-13 up to df ~ 1e4 (the lgamma difference grows with df: ~1e-10 at df ~ 1e5). NaN for
    df <= 0 or NaN t.
    """
    if not df > 0 or math.isnan(t):
        return math.nan
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    tt = t * t
    tail = 0.5 * _betainc(0.5 * df, 0.5, df / (df + tt), tt / (df + tt)) if math.isfinite(tt) else 0.0
    return tail if t >= 0 else 1.0 - tail


# --------------------------------------------------------------------------- Fisher's exact test


_WALK_CHUNK = 1 << 14
_NEGLIGIBLE = -800.0  # log of a term relative to the reference: exp() is 0 below about -745


def _hypergeom_log_ratio(j: np.ndarray, m_pop: int, k_succ: int, n_draw: int) -> np.ndarray:
    """log(pmf(j + 1) / pmf(j)) of the hypergeometric distribution."""
    jf = j.astype(np.float64)
    return np.log(((k_succ - jf) * (n_draw - jf)) / ((jf + 1.0) * (m_pop - k_succ - n_draw + jf + 1.0)))


def _hypergeom_at_least(a: int, m_pop: int, k_succ: int, n_draw: int) -> float:
    """P(X >= a) for X ~ Hypergeometric(population ``m_pop``, ``k_succ`` successes, ``n_draw`` draws).

    Why not lgamma: log C(1e6, .) has magnitude ~1e6, so its rounding alone would cost ~1e-10
    relative. Instead every term is taken relative to the mode's through the exact pmf ratios
    (log-concave: each step away from the mode is smaller), walked outwards from the mode in chunks
    and stopped once the terms are negligible, so memory stays O(chunk) whatever the table.
    """
    lo, hi = max(0, n_draw - (m_pop - k_succ)), min(k_succ, n_draw)
    if a <= lo:
        return 1.0
    if a > hi:
        return 0.0
    mode = min(max((n_draw + 1) * (k_succ + 1) // (m_pop + 2), lo), hi)
    den = 1.0  # sum of pmf(x) / pmf(mode)
    num = 1.0 if a <= mode else 0.0  # sum over x >= a, relative to the mode (a <= mode) or to pmf(a) (a > mode)
    ref: float | None = None  # log pmf(a) / pmf(mode), once the walk reaches a (a > mode)
    # upwards: x = mode + 1 .. hi
    prev = 0.0
    for start in range(mode, hi, _WALK_CHUNK):
        j = np.arange(start, min(start + _WALK_CHUNK, hi), dtype=np.int64)
        lt = prev + np.cumsum(_hypergeom_log_ratio(j, m_pop, k_succ, n_draw))
        xs = j + 1
        prev = float(lt[-1])
        terms = np.exp(lt)
        den += float(terms.sum())
        if a <= mode:
            num += float(terms.sum())
        else:
            sel = xs >= a
            if sel.any():
                ref = float(lt[sel][0]) if ref is None else ref
                num += float(np.exp(lt[sel] - ref).sum())
        if prev < _NEGLIGIBLE and (a <= mode or (ref is not None and prev - ref < _NEGLIGIBLE)):
            break
    # downwards: x = mode - 1 .. lo
    prev = 0.0
    for end in range(mode, lo, -_WALK_CHUNK):
        j = np.arange(end - 1, max(end - _WALK_CHUNK, lo) - 1, -1, dtype=np.int64)
        lt = prev - np.cumsum(_hypergeom_log_ratio(j, m_pop, k_succ, n_draw))
        prev = float(lt[-1])
        den += float(np.exp(lt).sum())
        if a <= mode:
            num += float(np.exp(lt[j >= a]).sum())
        if prev < _NEGLIGIBLE:
            break
    if a <= mode:
        return min(1.0, num / den)
    if ref is None or num <= 0:
        return 0.0
    return min(1.0, math.exp(ref + math.log(num) - math.log(den)))


def fisher_exact(table: list[list[int]] | np.ndarray, alternative: str = "greater") -> float:
    """One-sided p-value of Fisher's exact test on a 2x2 table, as ``scipy.stats.fisher_exact(table, 'greater').pvalue``.

    P(top-left cell >= observed) given the margins (hypergeometric); 1.0 when a row or column sum is
    0, as scipy. Only ``alternative='greater'`` -- the one the oversized-context rule uses; scipy's
    two-sided p (sum of the tables at most as likely as the observed one) is not implemented.
    """
    if alternative != "greater":
        raise ValueError("only alternative='greater' is implemented")
    c = np.asarray(table, dtype=np.int64)
    if c.shape != (2, 2):
        raise ValueError("fisher_exact needs a 2x2 table")
    if np.any(c < 0):
        raise ValueError("all values in the table must be non-negative")
    if 0 in c.sum(axis=0) or 0 in c.sum(axis=1):
        return 1.0
    a, b, cc, d = (int(v) for v in c.ravel())
    return _hypergeom_at_least(a, a + b + cc + d, a + b, a + cc)


# --------------------------------------------------------------------------- USL least squares


class UslParams(NamedTuple):
    lam: float
    sigma: float
    kappa: float
    cost: float  # sum of squared weighted residuals: sum(((model - x) / x_sigma)^2)


_USL_LOWER = np.array([1e-12, 0.0, 0.0])
_USL_UPPER = np.array([np.inf, 1.0, np.inf])


def _usl_model(n: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """USL X(N) = lam*N / (1 + sigma*(N-1) + kappa*N*(N-1)) and its Jacobian in (lam, sigma, kappa)."""
    lam, sigma, kappa = p
    den = 1.0 + sigma * (n - 1.0) + kappa * n * (n - 1.0)
    f = lam * n / den
    jac = np.column_stack((n / den, -f * (n - 1.0) / den, -f * n * (n - 1.0) / den))
    return f, jac


def _usl_cost(n: np.ndarray, x: np.ndarray, w: np.ndarray, p: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    with np.errstate(all="ignore"):
        f, jac = _usl_model(n, p)
        r = (f - x) * w
        cost = float(r @ r)
    return (cost if math.isfinite(cost) else math.inf), r, jac * w[:, None]


def _projected_lm(n: np.ndarray, x: np.ndarray, w: np.ndarray, p0: np.ndarray, max_iter: int = 300) -> tuple[np.ndarray, float]:
    """Levenberg-Marquardt with the box projected out: a parameter on a bound whose gradient points
    outwards is frozen for that step, the others take a Marquardt-scaled step that is clipped to the
    box and kept only if it lowers the cost. Three parameters: each step is a 3x3 solve."""
    p = np.clip(p0.astype(np.float64), _USL_LOWER, _USL_UPPER)
    cost, r, jac = _usl_cost(n, x, w, p)
    if not math.isfinite(cost):
        return p, cost
    mu = 1e-3
    for _ in range(max_iter):
        g = jac.T @ r
        free = ~(((p <= _USL_LOWER) & (g > 0)) | ((p >= _USL_UPPER) & (g < 0)))
        if not free.any():
            break
        jf = jac[:, free]
        a = jf.T @ jf
        scale = np.maximum(np.diag(a), 1e-300)
        if float(np.max(np.abs(g[free]) / np.sqrt(scale))) <= 1e-13 * math.sqrt(max(cost, 1e-300)):
            break  # scaled gradient ~0: a stationary point within the box
        accepted, drop, moved = False, 0.0, 0.0
        while mu < 1e20:
            try:
                step = np.linalg.solve(a + mu * np.diag(scale), -g[free])
            except np.linalg.LinAlgError:
                mu *= 10.0
                continue
            trial = p.copy()
            trial[free] += step
            trial = np.clip(trial, _USL_LOWER, _USL_UPPER)
            t_cost, t_r, t_jac = _usl_cost(n, x, w, trial)
            if t_cost < cost:
                moved = float(np.max(np.abs(trial - p) / np.maximum(np.abs(p), 1e-12)))
                drop = cost - t_cost
                p, r, jac = trial, t_r, t_jac
                cost = t_cost
                mu = max(mu * 0.3, 1e-15)
                accepted = True
                break
            mu *= 10.0
        if not accepted or (drop <= 1e-15 * cost and moved <= 1e-12):
            break
    return p, cost


def _nnls_small(a: np.ndarray, b: np.ndarray, must: int = 0) -> np.ndarray | None:
    """Non-negative least squares for a handful of columns by trying every active set (2^k solves).

    Column ``must`` always stays in the model. None when no subset gives a non-negative solution.
    """
    k = a.shape[1]
    best, best_rss = None, math.inf
    for mask in range(1, 1 << k):
        if not mask >> must & 1:
            continue
        cols = [i for i in range(k) if mask >> i & 1]
        coef, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
        if np.any(coef < 0) or not np.all(np.isfinite(coef)):
            continue
        full = np.zeros(k)
        full[cols] = coef
        rss = float(np.sum((a @ full - b) ** 2))
        if rss < best_rss:
            best, best_rss = full, rss
    return best


def _usl_linear_start(n: np.ndarray, x: np.ndarray, w: np.ndarray) -> np.ndarray | None:
    """USL parameters from its linearised form N/X = a + b(N-1) + cN(N-1) (a = 1/lam, b = sigma/lam,
    c = kappa/lam), solved by non-negative least squares. Each row is weighted by w*X^2/N, which turns
    an error in N/X back into (about) the same weighted error in X that the real fit minimises."""
    ok = (x > 0) & (n > 0)
    if ok.sum() < 3:
        return None
    nn, xx = n[ok], x[ok]
    rw = w[ok] * xx * xx / nn
    design = np.column_stack((np.ones_like(nn), nn - 1.0, nn * (nn - 1.0))) * rw[:, None]
    coef = _nnls_small(design, nn / xx * rw, must=0)
    if coef is None or coef[0] <= 0:
        return None
    return np.array([1.0 / coef[0], min(coef[1] / coef[0], 1.0), coef[2] / coef[0]])


def usl_fit(n: np.ndarray, x: np.ndarray, x_sigma: np.ndarray, p0: tuple[float, float, float]) -> UslParams | None:
    """Bounded weighted least squares of the USL, replacing ``scipy.optimize.curve_fit(usl, n, x, p0,
    sigma=x_sigma, bounds=([1e-12, 0, 0], [inf, 1, inf]))``: minimises sum(((X(N) - x) / x_sigma)^2)
    with lam > 0, 0 <= sigma <= 1, kappa >= 0.

    Two starts -- ``p0`` (as the caller gave curve_fit) and the linearised USL's non-negative least
    squares solution -- each refined by projected Levenberg-Marquardt; the lower cost wins. None
    when neither start gives a finite cost.

    Converged to ~1e-15 relative cost, far tighter than curve_fit's ftol of 1e-8, so the answer is
    the optimum rather than wherever a path stopped: on the replay fixtures and in the tests its
    cost is equal to curve_fit's or lower. When no finite optimum exists -- throughput that rises
    and then collapses, so that lam and kappa run off to infinity at a fixed ratio -- both fits
    return huge lam and kappa (N* ~ 0), at different magnitudes.
    """
    nv = np.asarray(n, dtype=np.float64)
    xv = np.asarray(x, dtype=np.float64)
    w = 1.0 / np.asarray(x_sigma, dtype=np.float64)
    starts = [np.asarray(p0, dtype=np.float64)]
    linear = _usl_linear_start(nv, xv, w)
    if linear is not None:
        starts.append(linear)
    best: tuple[np.ndarray, float] | None = None
    for start in starts:
        p, cost = _projected_lm(nv, xv, w, start)
        if math.isfinite(cost) and (best is None or cost < best[1]):
            best = (p, cost)
    if best is None:
        return None
    lam, sigma, kappa = (float(v) for v in best[0])
    return UslParams(lam, sigma, kappa, best[1])
