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
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote_plus

from alerts.cause_rules import cause_annotations, cause_labels
from alerts.causes import CAUSES, INCIDENT, Cause
from alerts.engine_causes import RULE_FILE, EngineCause, engine_annotations, engine_causes, engine_labels, replaced_by_engine
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
from alerts.slo_rules import THRESHOLD_MARGIN, burn_alert, group_names, le_text, slo_rule_file, tier_can_fire, total_metric
from alerts.spec import SLO, Availability, RawRatio, Spec, Tier, duration_s, format_number

RATE = 1000  # requests per minute in the SLO scenarios
START = 1_000_000  # counters' first value
SERIES_LABELS = 'model="m1", route="/v1/completions", job="llm-api", instance="host-a:8000"'
OUT_LABELS = {"model": "m1", "job": "llm-api"}  # what the recording rules keep
MARGIN = THRESHOLD_MARGIN  # relative distance from a threshold an assertion time must keep (the generator's own)


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
    assert not isinstance(slo.sli, RawRatio)
    m, threshold = slo.sli.metric, slo.sli.threshold
    le = f"{int(threshold)}.0" if threshold == int(threshold) else le_text(threshold)  # as exporters render bounds
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
    if isinstance(slo.sli, RawRatio):
        return raw_ratio_tests(spec, slo)
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


def test_files(spec: Spec, incident_classes: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
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
        "tests": [cause_test(spec, c) for c in (*CAUSES, INCIDENT) if not replaced_by_engine(spec, c)],
    }  # fmt: skip
    causes = engine_causes(spec, incident_classes)
    if causes:
        files[f"engine-{spec.engine}.test.yaml"] = {
            "rule_files": [f"../{RULE_FILE.format(engine=spec.engine)}"], "evaluation_interval": "1m",
            "tests": [engine_test(spec, c) for c in causes],
        }  # fmt: skip
    return files


# --------------------------------------------------------------------------- an engine's own cause alerts

ENGINE_SERIES = 'model_name="m1", engine="0", job="vllm", instance="host-a:8000"'
ENGINE_OUT = {"job": "vllm", "instance": "host-a:8000"}


def _engine_example(cause: EngineCause) -> tuple[list[tuple[str, str]], dict[str, str], dict[str, str]]:
    """(input series, the alert's labels from its expression, values of its annotation templates) of one cause:
    quiet for 10 minutes, then the condition held from minute 10 on."""
    from alerts import engine_causes as ec
    from collectors import backends as b

    if cause.alert == ec.KV_ALERT:  # at the ceiling while preempting 0.1/s, both from minute 10
        series = [(f"{b.VLLM_KV_USAGE.name}{{{ENGINE_SERIES}}}", "0.5x10 0.97x30"),
                  (f"{b.VLLM_PREEMPTIONS.name}{{{ENGINE_SERIES}}}", "0x10 6+6x30")]  # fmt: skip
        return series, {**ENGINE_OUT, "model_name": "m1"}, {"{{ $value | humanizePercentage }}": "97%"}
    if cause.alert == ec.QUEUE_ALERT:
        q, i = b.VLLM_QUEUE_TIME.name, b.VLLM_INFERENCE_TIME.name
        series = [(f"{q}_sum{{{ENGINE_SERIES}}}", "0+1x10 70+60x30"),  # waits 2 s a request from minute 10, runs 0.33 s
                  (f"{q}_count{{{ENGINE_SERIES}}}", "0+30x40"), (f"{i}_sum{{{ENGINE_SERIES}}}", "0+10x40")]  # fmt: skip
        return series, {**ENGINE_OUT, "model_name": "m1"}, {}
    series = [(f"{b.VLLM_PREEMPTIONS.name}{{{ENGINE_SERIES}}}", "0x10 6+6x30")]
    return series, dict(ENGINE_OUT), {'{{ $value | printf "%.2f" }}': "0.10"}


def engine_test(spec: Spec, cause: EngineCause) -> dict[str, Any]:
    series, out, values = _engine_example(cause)
    labels = {**out, **engine_labels(spec, cause)}
    ann = {}
    for k, v in engine_annotations(spec, cause).items():
        for template, text in values.items():
            v = v.replace(template, text)
        ann[k] = _render(v, out)
    fires_at = f"{10 + duration_s(cause.for_) // 60 + 6}m"
    return {
        "name": f"{cause.alert} ({cause.diag_class or 'no incident class'}): quiet at 8m, fires at {fires_at}",
        "interval": "1m",
        "input_series": [{"series": name, "values": v} for name, v in series],
        "alert_rule_test": [
            {"eval_time": "8m", "alertname": cause.alert, "exp_alerts": []},
            {"eval_time": fires_at, "alertname": cause.alert, "exp_alerts": [{"exp_labels": labels, "exp_annotations": ann}]},
        ],
    }


# --------------------------------------------------------------------------- a raw (Sloth-style) ratio

_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^{}]*\})?\s*\[")
_MATCHER = re.compile(r'([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
# Values tried for a regex matcher, in order, when its alternatives are not plain words: status codes and classes,
# outcomes, finish reasons. A query whose matcher none of them satisfies gets no generated test (with a warning).
CANDIDATES = ("5xx", "500", "503", "error", "abort", "failed", "2xx", "200", "ok", "stop", "success", "4xx", "x")


def _selector(query: str) -> tuple[str, list[tuple[str, str, str]]] | None:
    """(metric, matchers) of the one range selector a query reads, or None when it reads none or several."""
    found = _SELECTOR.findall(query.replace("{{.window}}", "5m"))
    if len(found) != 1:
        return None
    name, braces = found[0]
    return name, _MATCHER.findall(braces or "")


def _satisfies(labels: dict[str, str], matchers: list[tuple[str, str, str]]) -> bool:
    for label, op, value in matchers:
        hit = re.fullmatch(value, labels.get(label, "")) is not None if "~" in op else labels.get(label, "") == value
        if hit != (op in ("=", "=~")):
            return False
    return True


def _labels_for(matchers: list[tuple[str, str, str]], base: dict[str, str], avoid: list[tuple[str, str, str]] | None = None,
                ) -> dict[str, str] | None:  # fmt: skip
    """Labels that satisfy ``matchers`` (and, with ``avoid``, do not satisfy those), or None."""
    labels = dict(base)
    for label, op, value in matchers:
        if op == "=":
            labels[label] = value
        elif op == "=~":
            options = [v for v in value.split("|") if re.fullmatch(r"[\w.-]*", v)] + list(CANDIDATES)
            pick = next((v for v in options if re.fullmatch(value, v)), None)
            if pick is None:
                return None
            labels[label] = pick
    if avoid is not None and _satisfies(labels, avoid):
        for label, op, _ in avoid:
            if op in ("=", "=~") and label not in {m[0] for m in matchers}:
                for v in CANDIDATES:
                    trial = {**labels, label: v}
                    if not _satisfies(trial, avoid) and _satisfies(trial, matchers):
                        labels = trial
                        break
    if not _satisfies(labels, matchers) or (avoid is not None and _satisfies(labels, avoid)):
        return None
    return labels


def raw_series(spec: Spec, slo: SLO, sc: _Scenario) -> list[dict[str, str]] | None:
    """Input series that make a raw ratio's error query count ``sc.errors`` and its total query ``sc.requests``, or None
    when they cannot be built from the queries' selectors (then the SLO gets no generated test)."""
    assert isinstance(slo.sli, RawRatio)
    err, tot = _selector(slo.sli.error_query), _selector(slo.sli.total_query)
    if err is None or tot is None:
        return None
    base = {"model" if spec.model_label == "model" else spec.model_label: "m1", "job": "llm-api", "instance": "host-a:8000"}
    bad = _labels_for(err[1], base)
    if bad is None:
        return None
    if err[0] != tot[0]:
        good = _labels_for(tot[1], base)
        if good is None:
            return None
        return [{"series": f"{err[0]}{_labels_text(bad)}", "values": values_string(sc.errors)},
                {"series": f"{tot[0]}{_labels_text(good)}", "values": values_string(sc.requests)}]  # fmt: skip
    if not _satisfies(bad, tot[1]):
        return None
    good = _labels_for(tot[1], base, avoid=err[1])
    if good is None:
        return None
    rest = [r - e for r, e in zip(sc.requests, sc.errors, strict=True)]
    return [{"series": f"{err[0]}{_labels_text(bad)}", "values": values_string(sc.errors)},
            {"series": f"{tot[0]}{_labels_text(good)}", "values": values_string(rest)}]  # fmt: skip


def raw_ratio_tests(spec: Spec, slo: SLO) -> list[dict[str, Any]]:
    """A raw ratio's rules proven on series built from its own selectors: every request failing fires exactly the
    tiers the window model predicts, healthy traffic fires none, zero traffic records no ratio. Asserted by tier
    (``count by (tier)``), not by exact labels: what the user's queries keep of job and model is theirs to say."""
    tiers = [t for t in slo.tiers if tier_can_fire(slo, t, spec.period)]
    if not tiers or any(duration_s(w) % 60 for t in tiers for w in (t.long, t.short)):
        return []
    tests: list[dict[str, Any]] = []
    firing_q = f'count by (tier) (ALERTS{{alertname="{BURN_ALERT}", alertstate="firing", slo="{slo.name}"}})'

    def group(name: str, sc: _Scenario, **body: Any) -> dict[str, Any] | None:
        series = raw_series(spec, slo, sc)
        return None if series is None else {"name": f"{slo.name}: {name}", "interval": "1m", "input_series": series, **body}

    sc = _Scenario([RATE] * 40, [RATE] * 40)
    t, firing = _pick(sc, slo, tiers, spec.period, 30)
    exprs = [{"expr": firing_q, "eval_time": f"{t}m",
              "exp_samples": [{"labels": _labels_text({"tier": x.name}), "value": 1} for x in firing]},
             {"expr": f'max({RATIO.format(w="5m")}{{slo="{slo.name}"}})', "eval_time": f"{t}m",
              "exp_samples": [{"labels": "{}", "value": 1}]}]  # fmt: skip
    tests.append(group("every request failing fires the tiers the windows predict (raw ratio)", sc, promql_expr_test=exprs))
    n = 8 * 60
    sc = _Scenario([RATE] * n, [max(1, round(0.2 * slo.budget * RATE))] * n)
    if all(sc.firing(slo, tiers, spec.period, m) == [] for m in (30, 120, n)):
        quiet = [{"eval_time": f"{m}m", "alertname": BURN_ALERT, "exp_alerts": []} for m in (30, 120, n)]
        tests.append(group("healthy traffic fires nothing (raw ratio)", sc, alert_rule_test=quiet))
    sc = _Scenario([0] * 120, [0] * 120)
    zero = [{"expr": f'{RATIO.format(w=w)}{{slo="{slo.name}"}}', "eval_time": "100m", "exp_samples": []} for w in ("5m", "1h")]
    tests.append(group("zero traffic: no alert, no ratio (raw ratio)", sc, promql_expr_test=zero,
                       alert_rule_test=[{"eval_time": "100m", "alertname": BURN_ALERT, "exp_alerts": []}]))  # fmt: skip
    return [x for x in tests if x is not None]
