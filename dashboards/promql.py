"""PromQL building blocks for the dashboards, with every metric name checked against the catalog.

Why a checked helper instead of string literals: a renamed or misspelt metric silently empties a
panel, and users notice in the middle of an incident. ``m(name)`` refuses any name that is neither
in ``collectors.catalog`` (ours and the pinned upstream families), nor declared by an inference backend
in ``collectors.backends`` (vLLM, TGI, llama.cpp at their pinned commits), nor one of the SLO recording
rules every spec records (``alerts.slo_names.DASHBOARD_NAMES``: never a name that spells a period
or a tier's own window, which depend on the spec), and ``metric_names`` re-scans every finished
expression so a name typed into a raw string cannot slip through either.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass

from alerts.fleet_names import NAMES as FLEET_NAMES
from alerts.slo_names import DASHBOARD_NAMES
from collectors import backends
from collectors import catalog as cat

# Template variables every selector carries (dashboard-linter: job and instance matchers everywhere).
SEL = 'job=~"$job", instance=~"$instance"'
MODEL = 'model=~"$model"'
RATE = "$__rate_interval"


class UnknownMetric(ValueError):
    """A panel names a metric the catalog lacks; the message is the metric's name."""

    def __init__(self, name: str, where: str = "") -> None:
        self.name = name
        super().__init__(
            f"unknown metric {name}"
            + (f" in {where}" if where else "")
            + " (not in collectors/catalog.py, its upstream families, or the SLO recording rules every spec records)"
        )


@functools.cache
def known_metrics() -> dict[str, str]:
    """Every name a query may use -> where it comes from (ours, an upstream exporter and version, a rule)."""
    names = {name: "llm-diag" for name in cat.CATALOG}
    for fam in cat.EXTERNAL:
        names.setdefault(fam.name, f"{fam.exporter} {fam.versions}")
    for bfam in backends.FAMILIES.values():  # the inference backends' own families, as collectors.backends declares them
        names.setdefault(bfam.name, f"{backends.DIALECT_NAMES[bfam.dialect]} {bfam.versions}")
    for rule in DASHBOARD_NAMES:
        names[rule] = "llm-diag SLO recording rule"
    for rule in FLEET_NAMES:
        names[rule] = "llm-diag fleet recording rule"
    return names


def _series_names(name: str) -> set[str]:
    """Exposed series of a family: histograms add _bucket/_sum/_count."""
    spec = cat.CATALOG.get(name)
    kind = spec.type if spec else next((f.type for f in cat.EXTERNAL if f.name == name), "")
    if not kind and name in backends.FAMILIES:
        kind = backends.FAMILIES[name].type
    if kind == "histogram":
        return {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    if kind == "summary":
        return {name, f"{name}_sum", f"{name}_count"}
    return {name}


@functools.cache
def series_known() -> dict[str, str]:
    """Series names (histogram parts expanded) -> family name."""
    out: dict[str, str] = {}
    for fam in known_metrics():
        for s in _series_names(fam):
            out[s] = fam
    return out


def m(name: str) -> str:
    """A metric (or histogram series) name, refused when unknown."""
    if name not in series_known():
        raise UnknownMetric(name)
    return name


# --------------------------------------------------------------------------- scanning finished expressions

_FUNCS_AND_KEYWORDS = frozenset(
    {
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "limitk",
        "limit_ratio",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "and",
        "or",
        "unless",
        "offset",
        "atan2",
        "abs",
        "absent",
        "absent_over_time",
        "ceil",
        "changes",
        "clamp",
        "clamp_max",
        "clamp_min",
        "day_of_month",
        "day_of_week",
        "day_of_year",
        "days_in_month",
        "delta",
        "deriv",
        "exp",
        "floor",
        "histogram_quantile",
        "histogram_count",
        "histogram_sum",
        "histogram_fraction",
        "holt_winters",
        "hour",
        "idelta",
        "increase",
        "irate",
        "label_join",
        "label_replace",
        "ln",
        "log2",
        "log10",
        "minute",
        "month",
        "predict_linear",
        "rate",
        "resets",
        "round",
        "scalar",
        "sgn",
        "sort",
        "sort_desc",
        "sqrt",
        "time",
        "timestamp",
        "vector",
        "year",
        "avg_over_time",
        "min_over_time",
        "max_over_time",
        "sum_over_time",
        "count_over_time",
        "quantile_over_time",
        "stddev_over_time",
        "stdvar_over_time",
        "last_over_time",
        "present_over_time",
        "inf",
        "nan",
    }
)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w:$.])([A-Za-z_:][A-Za-z0-9_:]*)")


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (strings, matchers, ranges, grouping labels removed)."""
    text = _STRING.sub('""', expr)
    text = _BRACES.sub(" ", text)
    text = _BRACKETS.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for match in _IDENT.finditer(text):
        word = match.group(1)
        rest = text[match.end() :].lstrip()
        if word.lower() in _FUNCS_AND_KEYWORDS or rest.startswith("("):
            continue
        names.add(word)
    return names


def check_expr(expr: str, where: str = "") -> None:
    """Raise UnknownMetric for the first name in ``expr`` that is not known."""
    known = series_known()
    for name in sorted(metric_names(expr)):
        if name not in known:
            raise UnknownMetric(name, where)


# --------------------------------------------------------------------------- building expressions


def sel(name: str, *matchers: str) -> str:
    """``name{job, instance, extra...}`` with the dashboard's variables."""
    return f"{m(name)}{{{', '.join((SEL, *matchers))}}}"


def rate(name: str, *matchers: str, fn: str = "rate") -> str:
    return f"{fn}({sel(name, *matchers)}[{RATE}])"


def quantile(q: float, hist: str, *matchers: str, by: str = "le") -> str:
    """The correct quantile: per-bucket rates summed, then interpolated (never quantiles added)."""
    return f"histogram_quantile({q}, sum by ({by}) ({rate(hist + '_bucket', *matchers)}))"


def ratio(num: str, den: str) -> str:
    """NaN-safe division: an idle denominator drops the point instead of drawing NaN or +Inf."""
    return f"({num}) / ({den} > 0)"


def mean(hist: str, *matchers: str, by: str = "") -> str:
    """Mean of a histogram over the rate window: rate(_sum) / rate(_count), never rate(_sum) alone."""
    grp = f"sum by ({by}) " if by else "sum "
    return ratio(f"{grp}({rate(hist + '_sum', *matchers)})", f"{grp}({rate(hist + '_count', *matchers)})")


@dataclass(frozen=True)
class Query:
    """One panel target: alternatives tried in order (``ours or theirs``), a legend, an instant flag.

    ``alternatives`` are kept separately so the live tests can prove each source returns data on its own;
    ``expr`` joins them with ``or`` (``on`` labels when the series differ in their other labels).
    """

    alternatives: tuple[str, ...]
    legend: str = ""
    on: str = ""
    instant: bool = False
    heatmap: bool = False

    @property
    def expr(self) -> str:
        joiner = f" or on({self.on}) " if self.on else " or "
        return joiner.join(self.alternatives)


def q(*alternatives: str, legend: str = "", on: str = "", instant: bool = False, heatmap: bool = False) -> Query:
    for alt in alternatives:
        check_expr(alt)
    return Query(tuple(alternatives), legend, on, instant, heatmap)


def used_names(exprs: Iterable[str]) -> set[str]:
    out: set[str] = set()
    for e in exprs:
        out |= metric_names(e)
    return out
