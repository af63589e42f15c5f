"""The SLO recording rules' names, windows and periods: the one contract the alert generator writes and the dashboards read.

Why one module: the rules are generated from a user's spec (any period of ``PERIODS``, tiers with any windows),
while the dashboards are generated once and committed. Two copies of these names had already drifted (a 28d spec
recorded ``...ratio28d`` while the dashboards read ``...ratio30d``, an empty panel). So the names are split in two:

- names that depend on the spec (``ratio<W>`` for a tier's own window, ``ratio<period>``): recorded for those who
  query them by hand, never read by a dashboard;
- names every valid spec records, whatever its period and tiers (``DASHBOARD_NAMES``): the fixed ``WINDOWS``, the
  period under a period-free name (with the period in a ``period`` label), and each tier's long and short window
  ratios and its threshold under tier-free names (with ``tier`` and ``window`` labels). A dashboard may query only
  these, so one committed set of dashboards is right for every spec.

This module imports nothing: ``alerts`` (which writes the rules) and ``dashboards`` (which queries them) both read it.
"""

from __future__ import annotations

PERIODS: tuple[str, ...] = ("30d", "28d", "7d")
# Windows every SLO gets recording rules for, whatever its tiers: the dashboards' burn-rate panels read these.
WINDOWS: tuple[str, ...] = ("5m", "30m", "1h", "2h", "6h", "1d", "3d")

ERRORS = "llmdiag:slo_errors:increase{w}"
REQUESTS = "llmdiag:slo_requests:increase{w}"
RATIO = "llmdiag:slo_error_ratio:ratio{w}"
OBJECTIVE = "llmdiag:slo_objective:ratio"
# The period's error ratio under a name that does not spell the period (label ``period`` says which).
PERIOD_RATIO = "llmdiag:slo_error_ratio:ratio_period"
# Each tier's long and short window error ratios (labels ``tier``, ``window``) and its alert threshold
# (burn factor x error budget; labels ``tier``, ``severity``, ``long_window``, ``short_window``, ``burn_factor``).
TIER_LONG_RATIO = "llmdiag:slo_tier_error_ratio:long"
TIER_SHORT_RATIO = "llmdiag:slo_tier_error_ratio:short"
TIER_THRESHOLD = "llmdiag:slo_tier_threshold:ratio"

BURN_ALERT = "LLMDiagSLOBurn"
ABSENT_ALERT = "LLMDiagSLOMetricAbsent"

# Recorded without a ``job`` label: constants per SLO and model (the objective) or per SLO, model and tier.
WITHOUT_JOB: frozenset[str] = frozenset({OBJECTIVE, TIER_THRESHOLD})


def window_names(window: str) -> tuple[str, str, str]:
    """(errors, requests, ratio) recorded for one window."""
    return ERRORS.format(w=window), REQUESTS.format(w=window), RATIO.format(w=window)


# What a dashboard may query: recorded by every valid spec, whatever its period and tiers.
DASHBOARD_NAMES: frozenset[str] = frozenset(
    {n for w in WINDOWS for n in window_names(w)} | {OBJECTIVE, PERIOD_RATIO, TIER_LONG_RATIO, TIER_SHORT_RATIO, TIER_THRESHOLD}
)


def recorded_names(windows: tuple[str, ...], period: str) -> frozenset[str]:
    """Every name the rules of a spec with these windows and this period record."""
    names = {n for w in (*windows, period) for n in window_names(w)}
    return frozenset(names | DASHBOARD_NAMES)
