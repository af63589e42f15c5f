"""Rule groups for the cause alerts and the live diagnosis alert (definitions in ``alerts.causes``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from alerts.causes import CAUSES, INCIDENT, Cause, info_query
from alerts.links import panel_url
from alerts.spec import Spec
from collectors import catalog as cat


class UnknownIncidentClass(ValueError):
    """A cause alert names a class the rules engine does not know: the triage link would be broken."""


def cause_labels(spec: Spec, cause: Cause) -> dict[str, str]:
    labels = {**spec.labels, "severity": cause.severity, **cause.extra_labels}
    if cause.diag_class is not None:
        labels["diag_class"] = cause.diag_class
    return labels


def cause_annotations(spec: Spec, cause: Cause) -> dict[str, str]:
    out = {"summary": cause.summary, "severity_reason": cause.severity_reason}
    if cause is INCIDENT:
        out["evidence"] = info_query("evidence")
        out["confidence"] = info_query("Value", cat.INCIDENT_CONFIDENCE.name)
    if spec.runbook_url:
        out["runbook_url"] = spec.runbook_url
    if spec.grafana_url:
        out["dashboard_url"] = panel_url(spec.grafana_url, cause.panel)
    return out


def cause_rule(spec: Spec, cause: Cause) -> dict[str, Any]:
    rule: dict[str, Any] = {"alert": cause.alert, "expr": cause.expr}
    if cause.for_ != "0s":
        rule["for"] = cause.for_
    rule["labels"] = cause_labels(spec, cause)
    rule["annotations"] = cause_annotations(spec, cause)
    return rule


def cause_rule_groups(spec: Spec, incident_classes: Iterable[str]) -> list[dict[str, Any]]:
    """The cause alerts, checked against the rules engine's incident classes (passed in: alerts/ imports no diag)."""
    known = set(incident_classes)
    for cause in CAUSES:
        if cause.diag_class is not None and cause.diag_class not in known:
            raise UnknownIncidentClass(f"cause alert {cause.alert}: diag_class {cause.diag_class!r} is not an incident class "
                                       f"of the rules engine ({', '.join(sorted(known))})")  # fmt: skip
    return [
        {"name": "llmdiag-causes", "rules": [cause_rule(spec, c) for c in CAUSES]},
        {"name": "llmdiag-diagnosis", "rules": [cause_rule(spec, INCIDENT)]},
    ]
