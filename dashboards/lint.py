"""A port of grafana/dashboard-linter's rules for Prometheus dashboards, plus our exclusions.

Why a port: the Go linter cannot be installed here, and its rules are exactly the portability
mistakes users hit with LLM dashboards (hard-coded datasources, missing job/instance scoping, fixed
rate windows, raw counters, no units). Rule names are the upstream ones so a violation can be
looked up in its documentation. Exclusions carry their reason, as the linter's ``.lint`` file does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from grafana_foundation_sdk.models import units as sdk_units

from alerts.slo_names import DASHBOARD_NAMES, WITHOUT_JOB
from collectors import catalog as cat
from dashboards.promql import metric_names

# Every unit constant Grafana's unit picker offers (the SDK generates them from Grafana's list).
VALID_UNITS: frozenset[str] = frozenset(v for k, v in vars(sdk_units).items() if not k.startswith("_") and isinstance(v, str))
UNIT_PANELS = frozenset({"stat", "singlestat", "graph", "timeseries", "gauge"})
DATASOURCE_UIDS = frozenset({"$datasource", "${datasource}"})
_RATE_RANGE = re.compile(r"\b(rate|irate)\s*\(")
_SELECTOR = re.compile(r"(?<![\w:$.])([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^{}]*\})?")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')

# Selectors exempt from a rule, with the reason (the linter's exclusions).
EXCLUSIONS: dict[str, tuple[frozenset[str], str]] = {
    "target-instance-rule": (
        DASHBOARD_NAMES,
        "SLO recording rules aggregate instances away (labels slo, model, job): the SLO is the service's, not a host's",
    ),
    "target-job-rule": (
        WITHOUT_JOB,
        "the SLO objective and the tiers' thresholds are constants per slo and model, recorded without a job",
    ),
}


@dataclass(frozen=True)
class Violation:
    rule: str
    dashboard: str
    panel: str
    message: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.dashboard} / {self.panel}: {self.message}"


def _counters() -> frozenset[str]:
    names = {n for n, s in cat.CATALOG.items() if s.type == "counter"}
    names |= {f.name for f in cat.EXTERNAL if f.type == "counter" or f.name.startswith("node_vmstat_")}
    return frozenset(names)


def _vars(dash: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dash.get("templating", {}).get("list", [])}


def _template_rules(dash: dict[str, Any], uid: str) -> Iterable[Violation]:
    variables = _vars(dash)
    ds = variables.get("datasource")
    if ds is None or ds.get("type") != "datasource" or ds.get("query") != "prometheus":
        yield Violation("template-datasource-rule", uid, "-", "needs a prometheus datasource variable named 'datasource'")
    elif ds.get("label") != "Data source":
        yield Violation("template-datasource-rule", uid, "-", "the datasource variable must be labelled 'Data source'")
    for name, label in (("job", "Job"), ("instance", "Instance")):
        v = variables.get(name)
        rule = f"template-{name}-rule"
        if v is None or v.get("type") != "query":
            yield Violation(rule, uid, "-", f"needs a query variable '{name}'")
            continue
        if (v.get("datasource") or {}).get("uid") not in DATASOURCE_UIDS:
            yield Violation(rule, uid, "-", f"variable {name} must use the templated datasource")
        if v.get("label") != label:
            yield Violation(rule, uid, "-", f"variable {name} must be labelled {label!r}")
        if not v.get("multi") or v.get("allValue") != ".+" or not v.get("includeAll"):
            yield Violation(rule, uid, "-", f"variable {name} must be multi-select with All = '.+'")
    for v in variables.values():
        if v.get("type") != "query":
            continue
        if v.get("refresh") != 2:
            yield Violation("template-on-time-change-reload-rule", uid, "-", f"variable {v['name']} must refresh on time change")
        query = v.get("query", "")
        m = re.fullmatch(r"label_values\((.+),\s*([A-Za-z_][A-Za-z0-9_]*)\)", query)
        result = re.fullmatch(r"query_result\((.+)\)", query)
        if result is not None:  # values cut from the result's text by the variable's regex: one capture group needed
            if not _balanced(result.group(1)) or not re.fullmatch(r"/.*\(.+\).*/", v.get("regex", "")):
                problem = "query_result() needs balanced PromQL and a /regex/ with a capture group"
                yield Violation("template-label-promql-rule", uid, "-", f"variable {v['name']}: {problem}")
        elif m is None or not _balanced(m.group(1)):
            yield Violation("template-label-promql-rule", uid, "-", f"variable {v['name']}: unparseable query {query!r}")


def _balanced(expr: str) -> bool:
    text = _STRING.sub('""', expr)
    if text.count('"') % 2:
        return False
    stack = []
    pairs = {")": "(", "]": "[", "}": "{"}
    for ch in text:
        if ch in "([{":
            stack.append(ch)
        elif ch in pairs and (not stack or stack.pop() != pairs[ch]):
            return False
    return not stack


def _enclosing_function(text: str, pos: int) -> str:
    """Name of the innermost call whose parentheses enclose ``pos`` ('' at top level)."""
    depth = 0
    for i in range(pos - 1, -1, -1):
        ch = text[i]
        if ch == ")":
            depth += 1
        elif ch == "(":
            if depth == 0:
                m = re.search(r"([A-Za-z_]+)\s*$", text[:i])
                return m.group(1) if m else ""
            depth -= 1
    return ""


def _target_rules(expr: str, uid: str, title: str) -> Iterable[Violation]:
    if not _balanced(expr):
        yield Violation("target-promql-rule", uid, title, f"unbalanced expression: {expr}")
        return
    text = _STRING.sub(lambda s: '"' + "x" * (len(s.group(0)) - 2) + '"', expr)  # same length, no brackets inside
    for m in _RATE_RANGE.finditer(text):
        end = _matching(text, m.end() - 1)
        inner = expr[m.end() : end]
        ranges = re.findall(r"\[([^\[\]]*)\]\s*$", inner)
        if not ranges or ranges[0] != "$__rate_interval":
            yield Violation("target-rate-interval-rule", uid, title, f"{m.group(1)}() must use [$__rate_interval]: {inner}")
    names = metric_names(expr)
    counters = _counters()
    for m in _SELECTOR.finditer(text):
        name = m.group(1)
        if name not in names:
            continue
        matchers = expr[m.start(2) : m.end(2)] if m.group(2) else ""
        for rule, label in (("target-job-rule", "job"), ("target-instance-rule", "instance")):
            exempt = EXCLUSIONS.get(rule, (frozenset(), ""))[0]
            if name not in exempt and f'{label}=~"${label}"' not in matchers:
                yield Violation(rule, uid, title, f'{name} has no {label}=~"${label}" matcher')
        is_counter = name.endswith("_total") or name in counters
        if is_counter and _enclosing_function(text, m.start()) not in ("rate", "irate", "increase"):
            yield Violation("target-counter-agg-rule", uid, title, f"counter {name} must be inside rate/irate/increase")


def _matching(text: str, open_pos: int) -> int:
    depth = 0
    for i in range(open_pos, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    return len(text)


def lint(dash: dict[str, Any]) -> list[Violation]:
    """Every violation of the ported rules in one dashboard JSON (empty = clean)."""
    uid = dash.get("uid", "?")
    out = list(_template_rules(dash, uid))
    if dash.get("editable") is not False:
        out.append(Violation("uneditable-dashboard", uid, "-", "editable must be false (changes belong in the generator)"))
    for p in dash.get("panels", []):
        if p.get("type") == "row":
            continue
        title = p.get("title", "")
        if (p.get("datasource") or {}).get("uid") not in DATASOURCE_UIDS:
            out.append(Violation("panel-datasource-rule", uid, title, "panels must use the templated datasource"))
        if not title or not p.get("description"):
            out.append(Violation("panel-title-description-rule", uid, title, "title and description are required"))
        if p.get("type") in UNIT_PANELS:
            unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit")
            if unit not in VALID_UNITS and not p.get("fieldConfig", {}).get("defaults", {}).get("mappings"):
                out.append(Violation("panel-units-rule", uid, title, f"unit {unit!r} is not one of Grafana's units"))
        targets = p.get("targets") or []
        if not targets:
            out.append(Violation("panel-no-targets-rule", uid, title, "no targets"))
        for t in targets:
            if (t.get("datasource") or {}).get("uid", "${datasource}") not in DATASOURCE_UIDS:
                out.append(Violation("panel-datasource-rule", uid, title, "targets must use the templated datasource"))
            out.extend(_target_rules(t.get("expr", ""), uid, title))
    return out
