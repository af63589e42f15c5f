"""promtool unit tests generated with the rules: every SLO and tier, and every cause alert.

Neither Sloth nor Pyrra ships tests of what they generate; these make the generated rules prove
their own behaviour on Prometheus 2.42's ``promtool test rules`` (explicit ``interval``,
``group_eval_order``, no fuzzy float compare). Per SLO:

- healthy traffic -> no burn alert;
- a 50 % error burn -> every tier fires, with the exact labels and annotations;
- a full outage -> the fast page fires by its computed detection time (factor x budget x long window);
- a burn just above the slowest factor -> a ticket only;
- recovery -> the fast page clears once its short window is clean;
- zero traffic -> no alert and no ratio sample (no NaN);
- one error at low traffic -> no page (the min-events gate);
- series vanished -> the absent alert, but only while the target is up.

Expected firing sets come from a small model of the windows (``_Scenario.firing``) evaluated at
times chosen away from any threshold, so a one-sample difference in Prometheus' extrapolation
cannot flip an expectation. Counters start at 1e6 so extrapolation scales errors and requests alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote_plus

from alerts.cause_rules import cause_annotations, cause_labels
from alerts.causes import CAUSES, INCIDENT, Cause
from alerts.slo_names import (
    ABSENT_ALERT,
    BURN_ALERT,
    PERIOD_RATIO,
    RATIO,
    REQUESTS,
    TIER_LONG_RATIO,
    TIER_SHORT_RATIO,
    TIER_THRESHOLD,
)
from alerts.slo_rules import burn_alert, group_names, slo_rule_file, tier_can_fire, total_metric
from alerts.spec import SLO, Availability, Spec, Tier, duration_s, format_number

RATE = 1000  # requests per minute in the SLO scenarios
START = 1_000_000  # counters' first value
SERIES_LABELS = 'model="m1", route="/v1/completions", job="llm-api", instance="host-a:8000"'
OUT_LABELS = {"model": "m1", "job": "llm-api"}  # what the recording rules keep
MARGIN = 0.03  # relative distance from a threshold an assertion time must keep


def _minutes(window: str) -> int:
    return duration_s(window) // 60


def values_string(increments: Sequence[float], start: float = START) -> str:
    """promtool's expanding notation for a counter: ``start`` then one sample per increment, runs compressed."""
    parts = [format_number(start)]
    value = start
    i = 0
    while i < len(increments):
        step = increments[i]
        j = i
        while j + 1 < len(increments) and increments[j + 1] == step:
            j += 1
        n = j - i + 1
        parts.append(f"{format_number(value + step)}+{format_number(step)}x{n - 1}")
        value += step * n
        i = j + 1
    return " ".join(parts)


@dataclass
class _Scenario:
    """Per-minute request and error increments (index 0 = the first minute after t=0)."""

    requests: list[int]
    errors: list[int]

    def window(self, t: int, w: int) -> tuple[float, float, float]:
        """(requests, errors, extrapolated requests) over the window [t-w, t] in minutes, as increase() sees it."""
        lo = max(0, t - w)
        req = sum(self.requests[lo:t])
        err = sum(self.errors[lo:t])
        sampled = t - lo
        to_start = lo - (t - w)
        extra = to_start if to_start < 1.1 else 0.5
        return req, err, (req * (sampled + extra) / sampled if sampled else 0.0)

    def firing(self, slo: SLO, tiers: Sequence[Tier], period: str, t: int, gate: bool = True) -> list[Tier] | None:
        """Tiers firing at minute t, or None when some quantity sits too close to its threshold to tell."""
        out = []
        for tier in tiers:
            thr = tier.burn_factor(period) * slo.budget
            conds = []
            for w in (tier.long, tier.short):
                req, err, _ = self.window(t, _minutes(w))
                if req == 0:
                    conds.append(False)
                    continue
                ratio = err / req
                if abs(ratio - thr) <= MARGIN * thr:
                    return None
                conds.append(ratio > thr)
            _, _, extrapolated = self.window(t, _minutes(tier.long))
            if gate and tier.min_events and abs(extrapolated - tier.min_events) <= 0.1 * tier.min_events:
                return None
            if all(conds) and (not gate or extrapolated >= tier.min_events):
                out.append(tier)
        return out


def _series(spec: Spec, slo: SLO, sc: _Scenario) -> list[dict[str, str]]:
    good = [r - e for r, e in zip(sc.requests, sc.errors, strict=True)]
    sel = SERIES_LABELS if spec.model_label == "model" else SERIES_LABELS.replace("model=", f"{spec.model_label}=")
    if isinstance(slo.sli, Availability):
        m, label = slo.sli.metric, slo.sli.label
        bad = next((v for v in ("error", "abort", "failed") if v not in slo.sli.good), "bad")
        return [
            {"series": f'{m}{{{label}="{slo.sli.good[0]}", {sel}}}', "values": values_string(good)},
            {"series": f'{m}{{{label}="{bad}", {sel}}}', "values": values_string(sc.errors)},
        ]
    m, le = slo.sli.metric, format_number(slo.sli.threshold)
    le = le if "." in le else f"{le}.0"  # as prometheus_client renders an integer bound
    return [
        {"series": f"{m}_count{{{sel}}}", "values": values_string(sc.requests)},
        {"series": f'{m}_bucket{{le="{le}", {sel}}}', "values": values_string(good)},
    ]


def _burn_labels(spec: Spec, slo: SLO, tier: Tier) -> dict[str, str]:
    factor = format_number(tier.burn_factor(spec.period))
    return {**spec.labels, **slo.labels, **OUT_LABELS, "slo": slo.name, "tier": tier.name, "severity": tier.severity,
            "long_window": tier.long, "short_window": tier.short, "burn_factor": factor}  # fmt: skip


def _labels_text(labels: dict[str, str]) -> str:
    return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def _alerts_expr_test(spec: Spec, slo: SLO, tiers: Sequence[Tier], t: int) -> dict[str, Any]:
    """Assert the exact set of firing burn alerts (all labels) at minute t through the ALERTS series."""
    samples = []
    for tier in tiers:
        labels = {"__name__": "ALERTS", "alertname": BURN_ALERT, "alertstate": "firing", **_burn_labels(spec, slo, tier)}
        samples.append({"labels": _labels_text(labels), "value": 1})
    return {"expr": f'ALERTS{{alertname="{BURN_ALERT}", alertstate="firing", slo="{slo.name}"}}', "eval_time": f"{t}m",
            "exp_samples": samples}  # fmt: skip


def _pick(sc: _Scenario, slo: SLO, tiers: Sequence[Tier], period: str, t: int, step: int = 1) -> tuple[int, list[Tier]]:
    """The first minute from t (moving by step) whose firing set is unambiguous."""
    for k in range(30):
        got = sc.firing(slo, tiers, period, t + k * step)
        if got is not None:
            return t + k * step, got
    raise ValueError(f"slo {slo.name}: no unambiguous assertion time near minute {t}")


def humanize_duration(seconds: float) -> str:
    """Prometheus' humanizeDuration for values >= 1 s (what the burn alert's summary prints)."""
    s = int(seconds)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d {hours}h {minutes}m {s}s"
    if hours:
        return f"{hours}h {minutes}m {s}s"
    if minutes:
        return f"{minutes}m {s}s"
    return f"{s}s"


def _render(template: str, labels: dict[str, str], value: str = "") -> str:
    """Prometheus' rendering of the templates the generator writes (labels, ``urlquery``, ``humanizeDuration``)."""
    out = template.replace("{{ $value | humanizeDuration }}", value)
    for k, v in labels.items():
        out = out.replace("{{ $labels." + k + " | urlquery }}", quote_plus(v, safe=""))  # Go's url.QueryEscape
        out = out.replace("{{ $labels." + k + " }}", v)
    return out


def slo_tests(spec: Spec, slo: SLO) -> list[dict[str, Any]]:
    tiers = [t for t in slo.tiers if tier_can_fire(slo, t, spec.period)]
    if not tiers or any(duration_s(w) % 60 for t in tiers for w in (t.long, t.short)):
        return []  # the scenarios step by whole minutes
    period = spec.period
    b = slo.budget
    fast, slowest = tiers[0], tiers[-1]
    tests: list[dict[str, Any]] = []

    def group(name: str, sc: _Scenario, **body: Any) -> dict[str, Any]:
        return {"name": f"{slo.name}: {name}", "interval": "1m", "input_series": _series(spec, slo, sc), **body}

    # healthy: a fifth of the budget, for 8 hours
    n = 8 * 60
    healthy_err = max(1, round(0.2 * b * RATE))
    sc = _Scenario([RATE] * n, [healthy_err] * n)
    checks = [30, 120, n]
    if all(sc.firing(slo, tiers, period, t) == [] for t in checks):
        quiet = [{"eval_time": f"{t}m", "alertname": BURN_ALERT, "exp_alerts": []} for t in checks]
        tests.append(group("healthy traffic fires nothing", sc, alert_rule_test=quiet))

    # every request fails: every tier fires; labels and annotations checked in full (the ratio is exactly 1,
    # so the alert's value -- the time the budget lasts -- is exact too)
    sc = _Scenario([RATE] * 40, [RATE] * 40)
    t, firing = _pick(sc, slo, tiers, period, 30)
    if firing == tiers:
        exp = []
        for tier in tiers:
            labels = _burn_labels(spec, slo, tier)
            value = humanize_duration(duration_s(period) * b)
            annotations = {k: _render(v, labels, value) for k, v in burn_alert(spec, slo, tier)["annotations"].items()}
            exp.append({"exp_labels": labels, "exp_annotations": annotations})
        rule_test = [{"eval_time": f"{t}m", "alertname": BURN_ALERT, "exp_alerts": exp}]
        series = _dashboard_series_tests(spec, slo, fast, t)
        tests.append(group("every request failing fires every tier, labelled and annotated; the dashboards' series agree",
                           sc, alert_rule_test=rule_test, promql_expr_test=series))  # fmt: skip

    # full outage after 2 h of clean traffic: the fast page by factor x budget x long window
    clean, outage, after = 120, 20, 60
    sc = _Scenario([RATE] * (clean + outage + after), [0] * clean + [RATE] * outage + [0] * after)
    detect = fast.burn_factor(period) * b * _minutes(fast.long)  # minutes, at a 100 % error ratio
    if detect + 2 < outage:
        by, firing_by = _pick(sc, slo, tiers, period, clean + math.ceil(detect) + 1)
        before, firing_before = _pick(sc, slo, tiers, period, clean + max(1, math.floor(detect) - 1), step=-1)
        isolated = fast in firing_by and fast not in firing_before
        exprs = [_alerts_expr_test(spec, slo, firing_before, before), _alerts_expr_test(spec, slo, firing_by, by)]
        # recovery: once the short window holds no error, the fast page clears
        rec, firing_rec = _pick(sc, slo, tiers, period, clean + outage + _minutes(fast.short) + 2)
        exprs.append(_alerts_expr_test(spec, slo, firing_rec, rec))
        if isolated and fast not in firing_rec:  # custom tiers may not separate; then this case is left out
            tests.append(group(f"full outage pages by {format_number(round(detect, 2))} min (fast tier), then clears on recovery",
                           sc, promql_expr_test=exprs))  # fmt: skip

    # a burn just above the slowest tier's factor: ticket only
    if slowest.severity == "ticket":
        err = math.ceil(1.2 * slowest.burn_factor(period) * b * RATE)
        hours = max(8, _minutes(slowest.short) // 60 + 2)
        sc = _Scenario([RATE] * hours * 60, [err] * hours * 60)
        t, firing = _pick(sc, slo, tiers, period, hours * 60, step=-1)
        if firing and all(x.severity == "ticket" for x in firing):
            tests.append(group(f"a burn of {format_number(round(err / RATE / b, 2))}x the budget opens a ticket, no page", sc,
                               promql_expr_test=[_alerts_expr_test(spec, slo, firing, t)]))  # fmt: skip

    # zero traffic: no alert, no ratio sample, no NaN
    sc = _Scenario([0] * 120, [0] * 120)
    zero_exprs = [
        {"expr": f'{RATIO.format(w=w)}{{slo="{slo.name}"}}', "eval_time": "100m", "exp_samples": []} for w in ("5m", "1h")
    ] + [
        {"expr": f'{REQUESTS.format(w="1h")}{{slo="{slo.name}"}}', "eval_time": "100m",
         "exp_samples": [{"labels": _labels_text({"__name__": REQUESTS.format(w="1h"), "slo": slo.name, **OUT_LABELS}),
                          "value": 0}]},
        {"expr": f'count({RATIO.format(w="1h")} != {RATIO.format(w="1h")})', "eval_time": "100m", "exp_samples": []},
    ]  # fmt: skip
    tests.append(group("zero traffic: no alert, no ratio, no NaN", sc, promql_expr_test=zero_exprs,
                       alert_rule_test=[{"eval_time": "100m", "alertname": BURN_ALERT, "exp_alerts": []}]))  # fmt: skip

    # one error among a handful of requests: 100 % errors over 5m, but below every tier's min_events
    reqs = [1 if i % 5 == 4 else 0 for i in range(120)]
    errs = [1 if i == 64 else 0 for i in range(120)]
    sc = _Scenario(reqs, errs)
    at = (66, 68)
    gated = [sc.firing(slo, tiers, period, m) for m in at]
    ungated = [sc.firing(slo, tiers, period, m, gate=False) for m in at]
    if all(g == [] for g in gated) and all(u and u[0].severity == "page" for u in ungated):  # only when the gate is what saves it
        quiet = [{"eval_time": f"{m}m", "alertname": BURN_ALERT, "exp_alerts": []} for m in at]
        tests.append(group("one error among 13 requests pages nobody (min-events gate)", sc, alert_rule_test=quiet))

    # the SLI's series vanish while the job is up: absent alert; with the job down: nothing
    absent = _absent_test(spec, slo)
    tests.extend(absent)
    return tests


def _dashboard_series_tests(spec: Spec, slo: SLO, tier: Tier, t: int) -> list[dict[str, Any]]:
    """With every request failing: the period-free and tier-free series the dashboards read hold the alert's numbers
    (ratio 1 over the tier's windows and the period, the tier's threshold), labelled with what they stand for."""
    out = []
    threshold = round(tier.burn_factor(spec.period) * slo.budget, 10)
    for name, extra, value in (
        (TIER_LONG_RATIO, {"tier": tier.name, "window": tier.long, "job": "llm-api"}, 1),
        (TIER_SHORT_RATIO, {"tier": tier.name, "window": tier.short, "job": "llm-api"}, 1),
        (TIER_THRESHOLD, {"tier": tier.name, "severity": tier.severity, "long_window": tier.long,
                          "short_window": tier.short, "burn_factor": format_number(tier.burn_factor(spec.period))},
         threshold),
        (PERIOD_RATIO, {"period": spec.period, "job": "llm-api"}, 1),
    ):  # fmt: skip
        labels = {"__name__": name, "slo": slo.name, "model": OUT_LABELS["model"], **extra}
        selector = f'{name}{{slo="{slo.name}"' + (f', tier="{tier.name}"}}' if "tier" in extra else "}")
        out.append({"expr": selector, "eval_time": f"{t}m", "exp_samples": [{"labels": _labels_text(labels), "value": value}]})
    return out


def _absent_test(spec: Spec, slo: SLO) -> list[dict[str, Any]]:
    from alerts.slo_rules import absent_alert

    sel = SERIES_LABELS if spec.model_label == "model" else SERIES_LABELS.replace("model=", f"{spec.model_label}=")
    metric = total_metric(slo)
    rule = absent_alert(spec, slo)
    labels = {**spec.labels, **slo.labels, "slo": slo.name, "severity": "ticket", "job": "llm-api"}
    ann = {k: _render(v, labels) for k, v in rule["annotations"].items()}
    present = f"{metric}{{{sel}}}"
    up = 'up{job="llm-api", instance="host-a:8000"}'
    vanish = {"series": present, "values": f"{START}+10x60 stale"}
    return [
        {"name": f"{slo.name}: series vanished while the target is up -> absent alert after {rule['for']}", "interval": "1m",
         "input_series": [vanish, {"series": up, "values": "1x120"}],
         "alert_rule_test": [{"eval_time": "65m", "alertname": ABSENT_ALERT, "exp_alerts": []},
                             {"eval_time": "80m", "alertname": ABSENT_ALERT, "exp_alerts": [{"exp_labels": labels,
                                                                                              "exp_annotations": ann}]}]},
        {"name": f"{slo.name}: series vanished with the target down -> no absent alert", "interval": "1m",
         "input_series": [vanish, {"series": up, "values": "1x60 0x60"}],
         "alert_rule_test": [{"eval_time": "80m", "alertname": ABSENT_ALERT, "exp_alerts": []}]},
    ]  # fmt: skip


def cause_test(spec: Spec, cause: Cause) -> dict[str, Any]:
    ex = cause.example
    labels = {**ex.labels, **{k: _render(v, ex.labels) for k, v in cause_labels(spec, cause).items()}}
    ann = {k: ex.annotations.get(k, _render(v, ex.labels)) for k, v in cause_annotations(spec, cause).items()}
    return {
        "name": f"{cause.alert} ({cause.diag_class or 'llm-diag itself'}): quiet at {ex.quiet_at}, fires at {ex.fires_at}",
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in ex.series],
        "alert_rule_test": [
            {"eval_time": ex.quiet_at, "alertname": cause.alert, "exp_alerts": []},
            {"eval_time": ex.fires_at, "alertname": cause.alert, "exp_alerts": [{"exp_labels": labels, "exp_annotations": ann}]},
        ],
    }


def test_files(spec: Spec) -> dict[str, dict[str, Any]]:
    """File name -> promtool test document."""
    files: dict[str, dict[str, Any]] = {}
    for slo in spec.slos:
        tests = slo_tests(spec, slo)
        if tests:
            files[f"slo-{slo.name}.test.yaml"] = {"rule_files": [f"../{slo_rule_file(slo)}"], "evaluation_interval": "1m",
                                                  "group_eval_order": group_names(slo), "tests": tests}  # fmt: skip
    files["causes.test.yaml"] = {
        "rule_files": ["../causes.rules.yaml"], "evaluation_interval": "1m",
        "group_eval_order": ["llmdiag-causes", "llmdiag-diagnosis"],
        "tests": [cause_test(spec, c) for c in (*CAUSES, INCIDENT)],
    }  # fmt: skip
    return files
