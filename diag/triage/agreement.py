"""Does the diagnosis answer the alert that opened the incident?

Why: a diagnosis is an analysis of whatever the source holds, but an incident is opened by an alert that
saw something. When the source cannot see what the alert saw -- a queue-wait SLO burning on a host whose
flight recorder holds no request rows (an untracked vLLM, or a tracker writing to another file) -- the
rules find nothing and the verdict would read ``healthy`` while the page is still firing. An on-call
engineer reading "healthy" under a page stops looking. So, with the alert in hand:

- the verdict is **never** ``healthy`` while the alert fires: it becomes ``inconclusive``, saying so;
- when no rule that could explain the alert could run, the diagnosis says what it **could not see** and
  where that signal would come from;
- when the alert states a class (cause alerts and the live diagnosis carry ``diag_class``), the check
  says whether the rules confirm it, found it only as a suspect, or concluded something else. A class the
  rules confirm (>= 0.5) is the incident's class even when another finding of the window ranks higher:
  an OOM kill minutes after a queue overload is an OOM incident, whose diagnosis also names the backlog.

The result is stored in the diagnosis document under ``alert_check`` and shown with the incident.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diag.rules.base import RULES, Rule
from diag.rules.engine import PRIMARY_CONFIDENCE, SUSPECT_CONFIDENCE

# What an SLO burn is about: request timing or outcomes. Its "own series" are the request rows (flight
# recorder) or the request histograms (Prometheus): a rule reading either could explain it.
REQUEST_SIGNALS = ("requests", "service:")


def _reads_requests(rule: Rule) -> bool:
    return any(s == "requests" or s.startswith(REQUEST_SIGNALS[1]) for s in (*rule.needs, *rule.needs_any))


def explaining_rules(labels: Mapping[str, str]) -> tuple[str, list[Rule]]:
    """(what the alert is about, in words; the rules that could explain it)."""
    stated = labels.get("diag_class", "")
    if stated:
        return f"class {stated}", [r for r in RULES.values() if r.cls == stated]
    if labels.get("slo"):
        return f"the {labels['slo']} SLO's requests", [r for r in RULES.values() if _reads_requests(r)]
    return "", []


def _alert_name(labels: Mapping[str, str]) -> str:
    name = labels.get("alertname", "the alert")
    extra = ", ".join(f"{k}={labels[k]}" for k in ("slo", "diag_class") if labels.get(k))
    return f"{name} ({extra})" if extra else name


def check(doc: dict[str, Any], labels: Mapping[str, str], *, firing: bool) -> dict[str, Any]:
    """Reconcile an analysis document (``Analysis.to_dict()``) with the alert; returns the ``alert_check`` entry.

    Adjusts ``doc["verdict"]`` in place when it reads ``healthy`` under a firing alert.
    """
    about, rules = explaining_rules(labels)
    name = _alert_name(labels)
    evaluated = set(doc.get("evaluated") or [])
    blind = bool(rules) and not any(r.id in evaluated for r in rules)
    missing = sorted({m for n in doc.get("not_evaluated") or [] if n.get("rule") in {r.id for r in rules}
                      for m in n.get("missing") or []})  # fmt: skip
    verdict = doc.setdefault("verdict", {})
    primary = verdict.get("primary")
    stated = labels.get("diag_class", "")
    best = max((f["confidence"] for f in doc.get("findings") or [] if f.get("class") == stated), default=0.0)
    if blind:
        status = "could_not_see"
        text = (f"{name} fires, but the diagnosis could not see {about}: no rule that could explain it had its signals "
                f"({', '.join(missing) or 'none recorded'}).")  # fmt: skip
        if any(m == "requests" or m.startswith(REQUEST_SIGNALS[1]) for m in missing):
            text += (" Request timings come from the tracker's rows in the flight recorder, or from the service's request"
                     " histograms in Prometheus (`diag triage serve --prometheus URL`).")  # fmt: skip
    elif stated and primary == stated:
        status, text = "confirms", f"the rules confirm {name}: {stated} at {best:.2f}"
    elif stated and best >= PRIMARY_CONFIDENCE:
        # confirmed, but something else in the window ranks higher (an earlier problem still inside the lookback):
        # the incident is about what its alert saw, and says what else the window holds
        other = max((f["confidence"] for f in doc.get("findings") or [] if f.get("class") == primary), default=0.0)
        status = "confirms"
        text = (f"the rules confirm {name}: {stated} at {best:.2f}; the window also shows {primary} at {other:.2f}, "
                "which this incident does not take as its class")  # fmt: skip
    elif stated and best >= SUSPECT_CONFIDENCE:
        status = "suspect"
        text = f"{name} states {stated}; the rules found it at {best:.2f}, below {PRIMARY_CONFIDENCE} (verdict: {primary})"
    elif stated:
        status = "differs"
        text = f"{name} states {stated}; the rules do not find it (verdict: {primary})"
    else:
        status, text = ("explained", f"{name}: verdict {primary}") if primary != "healthy" else ("unexplained", "")
    if firing and primary == "healthy":
        verdict["primary"] = "inconclusive"
        verdict.setdefault("suspects", [])
        if not text or status == "unexplained":
            text = (f"{name} fires, but no rule found a cause at {SUSPECT_CONFIDENCE} or more in this window: the alert's "
                    "condition holds and the diagnosis cannot say why")  # fmt: skip
        verdict["alert"] = text
    incident_class = stated if status == "confirms" else verdict["primary"]
    return {"alert": labels.get("alertname", ""), "stated_class": stated or None, "status": status, "text": text,
            "missing": missing, "incident_class": incident_class}  # fmt: skip
