"""SLO recording rules and multiwindow multi-burn-rate alerts, from a validated spec.

Why each shape:
- *Increases*, not rates, are recorded per window, and the error ratio is errors / requests of the
  same window: a ratio of sums. The period (30d) is the sum of the 5-minute increases (a subquery at
  5m steps, Pyrra's cheap form), again divided as sums -- never an average of 5-minute ratios, which
  over-weights quiet hours (Sloth's known flaw).
- The denominator is guarded with ``> 0``: zero traffic gives *no* ratio sample, never NaN, so it
  neither alerts nor poisons the period.
- Errors fall back to ``0 * requests`` when no error series exists yet, so a clean service has a
  ratio of 0 rather than a gap.
- One alert rule per tier with stable labels (``tier``, ``severity``, windows, factor), so
  Alertmanager can inhibit slower tiers by the faster one and a person can tell which pair fired.
- Every tier is gated on a minimum number of requests in its long window: one failure among three
  requests is 33 % errors but not an outage worth a page.
- The alert's value is the time until the whole period's budget is gone at the long window's error
  ratio, so the annotation can say it in words ("gone in 2d 0h").
"""

from __future__ import annotations

from typing import Any

from alerts.links import PanelRef, panel_url
from alerts.slo_names import (
    ABSENT_ALERT,
    BURN_ALERT,
    ERRORS,
    OBJECTIVE,
    PERIOD_RATIO,
    RATIO,
    REQUESTS,
    TIER_LONG_RATIO,
    TIER_SHORT_RATIO,
    TIER_THRESHOLD,
)
from alerts.spec import SLO, Availability, Latency, RawRatio, Spec, Tier, duration_s, format_number
from dashboards.definitions import EVENTS_PANEL, TIER_PANEL, UIDS
from dashboards.promql import metric_names

# The panel each SLO alert links to, with the dashboard variables its labels fill.
BURN_PANEL = PanelRef(UIDS["slo"], TIER_PANEL, ("slo", "model", "job"))
ABSENT_PANEL = PanelRef(UIDS["slo"], EVENTS_PANEL, ("job",))  # and the SLO's name, written in
ABSENT_FOR = "10m"  # rides out a restart or a deploy: the series come back within seconds
ABSENT_LOOKBACK = "1d"  # a job counts as serving this SLI when its series existed within this long


def _matchers(*parts: str) -> str:
    inner = ", ".join(p for p in parts if p)
    return "{" + inner + "}" if inner else ""


def le_matcher(threshold: float) -> str:
    """``le`` matcher that survives Prometheus 3's normalisation of integer bounds (``1.0`` -> ``1``).

    A fractional bound is written as the exporters write it -- the float's shortest round-trip text, which is what
    prometheus_client and metrics-rs print (TGI's ``0.00015000000000000001``), not a rounded decimal."""
    if threshold == int(threshold):
        return f'le=~"{int(threshold)}(\\\\.0)?"'
    return f'le="{le_text(threshold)}"'


def le_text(threshold: float) -> str:
    """The ``le`` label value of a fractional bucket bound as an exporter writes it."""
    return repr(float(threshold))


def _by_model(spec: Spec, inner: str) -> str:
    """Sum by job and model, renaming the spec's model label to ``model`` first when it differs."""
    if spec.model_label != "model":
        inner = f'label_replace({inner}, "model", "$1", "{spec.model_label}", "(.*)")'
    return f"sum by (job, model) ({inner})"


def sli_exprs(spec: Spec, slo: SLO, window: str) -> tuple[str, str]:
    """(errors, requests) increase expressions of one SLO over one window."""
    sli = slo.sli
    if isinstance(sli, RawRatio):  # the user's counts over the window, summed by job and model as the other forms are
        bad, every = sli.render(window)
        total = _by_model(spec, every)
        return f"{_by_model(spec, bad)}\nor\n0 * {total}", total
    if isinstance(sli, Availability):
        good = "|".join(sli.good)
        total = _by_model(spec, f"increase({sli.metric}{_matchers(spec.selector)}[{window}])")
        bad_matcher = f'{sli.label}!~"{good}"'
        bad = _by_model(spec, f"increase({sli.metric}{_matchers(spec.selector, bad_matcher)}[{window}])")
        return f"{bad}\nor\n0 * {total}", total
    assert isinstance(sli, Latency)
    total = _by_model(spec, f"increase({sli.metric}_count{_matchers(spec.selector)}[{window}])")
    fast = _by_model(spec, f"increase({sli.metric}_bucket{_matchers(spec.selector, le_matcher(sli.threshold))}[{window}])")
    return f"clamp_min(\n  {total}\n  -\n  {fast},\n  0\n)", total


def recording_group(spec: Spec, slo: SLO) -> dict[str, Any]:
    """Increases and ratios per window for one SLO, in dependency order (a group evaluates in order)."""
    rules: list[dict[str, Any]] = []
    labels = {"slo": slo.name}
    sel = f'{{slo="{slo.name}"}}'
    for w in spec.windows:
        errors, requests = sli_exprs(spec, slo, w)
        rules.append({"record": ERRORS.format(w=w), "expr": errors, "labels": labels})
        rules.append({"record": REQUESTS.format(w=w), "expr": requests, "labels": labels})
        rules.append({"record": RATIO.format(w=w),
                      "expr": f"{ERRORS.format(w=w)}{sel}\n/\n({REQUESTS.format(w=w)}{sel} > 0)", "labels": labels})  # fmt: skip
    objective = format_number(slo.objective / 100)
    per_model = f"max by (model) (0 * {REQUESTS.format(w='5m')}{sel})"
    rules.append({"record": OBJECTIVE, "labels": labels, "expr": f"{per_model} + {objective}"})
    rules += tier_series(spec, slo, per_model)
    return {"name": f"llmdiag-slo-{slo.name}", "rules": rules}


def tier_series(spec: Spec, slo: SLO, per_model: str) -> list[dict[str, Any]]:
    """Each tier's windows and threshold under names that spell neither (labels say which): what dashboards read.

    Copies of series recorded above (a selector, no new arithmetic), so a dashboard drawn for the default
    tiers is right for custom tiers too, and the threshold it draws is the one the alert compares with."""
    rules: list[dict[str, Any]] = []
    sel = f'{{slo="{slo.name}"}}'
    for tier in slo.tiers:
        factor = tier.burn_factor(spec.period)
        tier_labels = {"slo": slo.name, "tier": tier.name}
        rules.append({"record": TIER_LONG_RATIO, "labels": {**tier_labels, "window": tier.long},
                      "expr": f"{RATIO.format(w=tier.long)}{sel}"})  # fmt: skip
        rules.append({"record": TIER_SHORT_RATIO, "labels": {**tier_labels, "window": tier.short},
                      "expr": f"{RATIO.format(w=tier.short)}{sel}"})  # fmt: skip
        rules.append({"record": TIER_THRESHOLD,
                      "labels": {**tier_labels, "severity": tier.severity, "long_window": tier.long,
                                 "short_window": tier.short, "burn_factor": format_number(factor)},
                      "expr": f"{per_model} + {format_number(round(factor * slo.budget, 10))}"})  # fmt: skip
    return rules


def period_group(spec: Spec, slo: SLO) -> dict[str, Any]:
    """The period's increases as sums of 5m increases; evaluated every 5m (each costs a 30-day subquery)."""
    p = spec.period
    sel = f'{{slo="{slo.name}"}}'
    labels = {"slo": slo.name}
    rules: list[dict[str, Any]] = [
        {"record": name.format(w=p), "labels": labels, "expr": f"sum_over_time({name.format(w='5m')}{sel}[{p}:5m])"}
        for name in (ERRORS, REQUESTS)
    ]
    rules.append({"record": RATIO.format(w=p), "labels": labels,
                  "expr": f"{ERRORS.format(w=p)}{sel}\n/\n({REQUESTS.format(w=p)}{sel} > 0)"})  # fmt: skip
    # The same ratio under a name that does not spell the period: the dashboards read it, whatever the spec's period.
    rules.append({"record": PERIOD_RATIO, "labels": {**labels, "period": p}, "expr": f"{RATIO.format(w=p)}{sel}"})
    return {"name": f"llmdiag-slo-{slo.name}-period", "interval": "5m", "rules": rules}


# The highest error ratio a burn alert may wait for. At 100 % or more it can never fire (e.g. 14.4 x a 10 % budget);
# just under, it fires only in a total outage -- which the availability of every other signal already shows -- and
# its generated promtool tests could not place a moment on either side of a threshold that close to every request:
# those tests keep every assertion THRESHOLD_MARGIN (relative) away from a threshold, so a threshold must leave that
# much room under 100 %.
THRESHOLD_MARGIN = 0.03
MAX_FIRING_RATIO = 1 - THRESHOLD_MARGIN


def tier_can_fire(slo: SLO, tier: Tier, period: str) -> bool:
    """Whether the tier's threshold (burn factor x budget) is an error ratio a real incident can cross: under 97 %."""
    return tier.burn_factor(period) * slo.budget < MAX_FIRING_RATIO


def _period_words(period: str) -> str:
    return f"{duration_s(period) // 86400}-day"


def burn_alert(spec: Spec, slo: SLO, tier: Tier) -> dict[str, Any]:
    factor = tier.burn_factor(spec.period)
    threshold = format_number(round(factor * slo.budget, 10))
    sel = f'{{slo="{slo.name}"}}'
    budget_s = format_number(round(duration_s(spec.period) * slo.budget, 6))
    expr = (
        f"(\n  {budget_s}\n  /\n  ({RATIO.format(w=tier.long)}{sel} > {threshold})\n)\n"
        f"and on (slo, model, job)\n  ({RATIO.format(w=tier.short)}{sel} > {threshold})\n"
        f"and on (slo, model, job)\n  ({REQUESTS.format(w=tier.long)}{sel} >= {tier.min_events})"
    )
    labels = {**spec.labels, **slo.labels, "slo": slo.name, "tier": tier.name, "severity": tier.severity,
              "long_window": tier.long, "short_window": tier.short, "burn_factor": format_number(factor)}  # fmt: skip
    what = slo.description or f"the {slo.name} SLO"
    annotations = {
        "summary": (f"{slo.name} SLO of {{{{ $labels.model }}}} burns its error budget {format_number(factor)}x too fast: "
                    f"at this rate the {_period_words(spec.period)} budget is gone in {{{{ $value | humanizeDuration }}}}"),
        "description": (f"{what} Objective {format_number(slo.objective)} %. Errors over both the last {tier.long} and "
                        f"{tier.short} exceed {threshold} of requests ({format_number(factor)} x the "
                        f"{format_number(slo.budget)} budget); tier {tier.name} has spent {format_number(tier.budget_percent)} % "
                        f"of the {_period_words(spec.period)} budget when it fires. Job {{{{ $labels.job }}}}."),
    }  # fmt: skip
    if spec.runbook_url:
        annotations["runbook_url"] = spec.runbook_url
    if spec.grafana_url:
        annotations["dashboard_url"] = panel_url(spec.grafana_url, BURN_PANEL)
    return {"alert": BURN_ALERT, "expr": expr, "labels": labels, "annotations": annotations}


def total_metric(slo: SLO) -> str | None:
    """The series whose presence says the SLI is exported at all (a raw ratio: the first its total query reads)."""
    if isinstance(slo.sli, RawRatio):
        names = sorted(metric_names(slo.sli.total_query.replace("{{.window}}", "5m")))
        return names[0] if names else None
    return slo.sli.metric if isinstance(slo.sli, Availability) else f"{slo.sli.metric}_count"


def absent_alert(spec: Spec, slo: SLO) -> dict[str, Any]:
    """The SLI's series vanished from a job that had them, while that job's targets are still up.

    Only while up: a target that is down is the agent-down alert's business, and an idle or
    never-deployed service must not page (the noise that made users switch Pyrra's off).
    """
    m = f"{total_metric(slo)}{_matchers(spec.selector) if not isinstance(slo.sli, RawRatio) else ''}"
    expr = (
        f"(\n  count by (job) (present_over_time({m}[{ABSENT_LOOKBACK}]))\n  unless on (job)\n  count by (job) ({m})\n)\n"
        f"and on (job)\n  (max by (job) (up) == 1)"
    )
    return {
        "alert": ABSENT_ALERT, "expr": expr, "for": ABSENT_FOR,
        "labels": {**spec.labels, **slo.labels, "slo": slo.name, "severity": "ticket"},
        "annotations": {
            "summary": f"{total_metric(slo)} vanished from job {{{{ $labels.job }}}} while it is up: the {slo.name} SLO is blind",
            "description": "The series existed within the last day and the job's targets answer scrapes, so the "
                           "exporter stopped exporting them (tracking disabled, renamed metric, crashed worker).",
            **({"runbook_url": spec.runbook_url} if spec.runbook_url else {}),
            **({"dashboard_url": panel_url(spec.grafana_url, ABSENT_PANEL, {"slo": slo.name})} if spec.grafana_url else {}),
        },
    }  # fmt: skip


def slo_rule_file(slo: SLO) -> str:
    return f"slo-{slo.name}.rules.yaml"


def group_names(slo: SLO) -> list[str]:
    """The groups of one SLO's rule file, in evaluation order (recording, period, alerts)."""
    return [f"llmdiag-slo-{slo.name}", f"llmdiag-slo-{slo.name}-period", f"llmdiag-slo-{slo.name}-alerts"]


def slo_rule_groups(spec: Spec, slo: SLO) -> tuple[list[dict[str, Any]], list[str]]:
    """One SLO's groups (its own rule file, so its tests load only its rules) plus warnings.

    Tiers that can never fire are left out, with a warning.
    """
    alerts: list[dict[str, Any]] = []
    warnings: list[str] = []
    for tier in slo.tiers:
        if tier_can_fire(slo, tier, spec.period):
            alerts.append(burn_alert(spec, slo, tier))
        else:
            never = tier.burn_factor(spec.period) * slo.budget >= 1
            what, why = (
                ("can never fire", ">= 100 % errors")
                if never
                else ("would fire only in a total outage", f">= {MAX_FIRING_RATIO * 100:g} % errors")
            )
            warnings.append(f"slo {slo.name}: tier {tier.name} {what} ({format_number(tier.burn_factor(spec.period))}"
                            f" x a {format_number(slo.budget)} budget {why}); left out")  # fmt: skip
    if total_metric(slo) is not None:  # a raw total query that reads no metric by name has nothing to watch
        alerts.append(absent_alert(spec, slo))
    groups = [recording_group(spec, slo), period_group(spec, slo), {"name": group_names(slo)[2], "rules": alerts}]
    return groups, warnings
