"""``diag gate --html``: the gate's result as one self-contained page, drawn with the bundle report's machinery.

What it shows: the verdict, the infrastructure and application gates (each check's state, the value read and
why), the steps x criteria table (PASS/FAIL and the measured value, the limit beside it), each step's diagnosis
(the primary class and the leading finding's evidence in one line), the neighbour check when the spec has one
(its verdict and criteria, the service's protection, its resident and mapped memory, major faults and stall before
the neighbour and while it held, the OOM kills, the diagnosis), where the first failed step's bundle went,
and four charts over the run with every step's boundaries marked -- the load asked, sent and served; the latency
quantiles; the memory PSI; the target's memory.

Why in the cli layer: the gate and the bundle are peers in the layer order and neither imports the other, so
the page that joins the gate's result to the bundle report's template environment, filters and SVG plotting
(``diag.bundle.report.environment``, ``diag.bundle.svgplot``) is put together here, one layer above both. The
series drawn are the gate's own arithmetic (``diag.gate.timeseries``); this module only draws them.

The same guarantees as the bundle's report.html: inline CSS and SVG, no script, nothing fetched (a
``default-src 'none'`` CSP). No prompt text reaches it (the gate keeps none: a request's result holds times and
counts only), and the target URL and command line are redacted (a URL's credentials, a token in an option).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from jinja2 import DictLoader
from markupsafe import Markup

from collectors.redact import redact_argv, redact_text
from diag.bundle import svgplot
from diag.bundle.charts import Chart, GiB, MiB
from diag.bundle.report import environment
from diag.gate.neighbour import NeighbourOutcome
from diag.gate.report import render
from diag.gate.runner import GateReport, StepReport
from diag.gate.timeseries import RunSeries, run_series
from diag.timeline import Series, Timeline
from diag.units import format_bytes, format_value
from diag.views.charts import PALETTE, reduce_minmax

BOUNDARY = "#888888"
LIMIT = "#c0392b"


# --------------------------------------------------------------------------- charts


def _line(x: np.ndarray, y: np.ndarray, color: str, label: str, dash: str = "") -> svgplot.Line:
    keep = np.isfinite(x) & np.isfinite(y)
    if keep.all():
        t, v = reduce_minmax(x, y)
        return svgplot.Line(t, v, color, label, dash, markers=t.size == 1)
    return svgplot.Line(x, y, color, label, dash, markers=int(keep.sum()) == 1)  # gaps kept: the pen lifts at NaN


def _series_line(s: Series, scale: float, color: str, label: str, dash: str = "") -> svgplot.Line:
    return _line(s.ts, s.values / scale, color, label, dash)


def _boundaries(panel: svgplot.Panel, run: RunSeries) -> None:
    """Every step's start and end as dotted verticals over the panel's own value range (the range drawn is the
    data's: a boundary never stretches the axis). Both ends: between two steps the gate judged the first one (and
    may have taken its bundle), and that pause, without load, shows as the gap between an end and a start."""
    ys = [v[np.isfinite(v)] for v in (line.y for line in panel.lines)]
    ys = [v for v in ys if v.size]
    lo = 0.0 if panel.y_from_zero or not ys else min(float(v.min()) for v in ys)
    hi = max((float(v.max()) for v in ys), default=1.0)
    if hi <= lo:
        hi = lo + 1.0
    edges: list[float] = []
    for s in run.steps:
        edges += [e for e in (s.start, s.end) if not edges or e - edges[-1] > 0.05]  # back-to-back steps: one line
    x = np.array([v for e in edges for v in (e, e, math.nan)])
    y = np.array([v for _ in edges for v in (lo, hi, math.nan)])
    panel.lines.append(svgplot.Line(x, y, BOUNDARY, "step boundaries", ":"))


def _figure(key: str, panel: svgplot.Panel, run: RunSeries) -> str:
    _boundaries(panel, run)
    return svgplot.figure(key, [panel], panel_height=210.0)


def load_chart(run: RunSeries) -> Chart | None:
    if not run.t.size:
        return None
    mid = run.t + run.bucket_s / 2
    panel = svgplot.Panel(ylabel="requests / s", y_from_zero=True, legend_columns=4)
    if np.isfinite(run.asked_rps).any():
        panel.lines.append(_line(mid, run.asked_rps, "#555555", "asked (spec rate)", "--"))
    panel.lines += [_line(mid, run.sent_rps, PALETTE[0], "sent"), _line(mid, run.ok_rps, PALETTE[2], "succeeded", "--")]
    return Chart("load", "Load: asked, sent and served", f"Requests per {run.bucket_s:g} s bucket by their scheduled time: "
                 "the spec's rate (open-loop steps), what the generator sent, and what succeeded. Sent below asked is the "
                 "generator (or max_in_flight) falling short; succeeded below sent is errors or timeouts.",
                 _figure("load", panel, run))  # fmt: skip


def latency_chart(run: RunSeries) -> Chart | None:
    if not np.isfinite(run.e2e_p99_s).any():
        return None
    mid = run.t + run.bucket_s / 2
    panel = svgplot.Panel(ylabel="seconds", y_from_zero=True, legend_columns=4)
    panel.lines += [_line(mid, run.e2e_p50_s, PALETTE[0], "e2e p50"), _line(mid, run.e2e_p99_s, PALETTE[1], "e2e p99")]
    if np.isfinite(run.ttft_p99_s).any():
        panel.lines.append(_line(mid, run.ttft_p99_s, PALETTE[3], "TTFT p99", "--"))
    return Chart("latency", "Latency quantiles over the run", f"Successful requests per {run.bucket_s:g} s bucket by their "
                 "scheduled time (latency counted from the schedule, so a late send is charged to it). A p99 that climbs "
                 "through a step is a queue growing.", _figure("latency", panel, run))  # fmt: skip


def psi_chart(run: RunSeries) -> Chart | None:
    if not run.psi:
        return None
    panel = svgplot.Panel(ylabel="% of time stalled (avg10)", y_from_zero=True)
    for i, (label, s) in enumerate(run.psi.items()):
        panel.lines.append(_series_line(s, 1.0, PALETTE[i % len(PALETTE)], label, "--" if "full" in label else ""))
    return Chart("psi", "Memory pressure (PSI)", "Share of wall time in which some (or all) tasks stalled waiting for "
                 "memory, as the host agent sampled it: the host's, and each watched cgroup's own.",
                 _figure("psi", panel, run))  # fmt: skip


def memory_chart(run: RunSeries) -> Chart | None:
    if not run.memory:
        return None
    peak = max(float(np.max(s.values)) for s in run.memory.values())
    scale, unit = (GiB, "GiB") if peak >= 4 * GiB else (MiB, "MiB")
    panel = svgplot.Panel(ylabel=unit, y_from_zero=True)
    for i, (label, s) in enumerate(run.memory.items()):
        panel.lines.append(_series_line(s, scale, PALETTE[i % len(PALETTE)], label))
    for label, s in run.memory_limits.items():
        panel.lines.append(_series_line(s, scale, "#555555", label, "--"))
    return Chart("memory", "Memory of the target", f"Memory in use by {run.memory_scope}; dashed lines are the ceilings "
                 "(a cgroup's limit, the host's total).", _figure("memory", panel, run))  # fmt: skip


def charts(run: RunSeries) -> list[Chart]:
    return [c for c in (load_chart(run), latency_chart(run), psi_chart(run), memory_chart(run)) if c is not None]


# --------------------------------------------------------------------------- the page


def _state(s: StepReport) -> str:
    return "INTERRUPTED" if s.load.interrupted else ("PASS" if s.passed else "FAIL")


def _evidence(s: StepReport) -> str:
    """The leading finding's first piece of evidence, as "what: value"."""
    a = s.analysis
    if a is None or a.primary == "healthy":
        return ""
    lead = next((f for f in a.findings if f.cls == a.primary), None) or (a.findings[0] if a.findings else None)
    if lead is None or not lead.evidence:
        return ""
    e = lead.evidence[0]
    return f"{e.what}: {format_value(e.value, e.unit)}"


def _num(v: float | None, fmt: str) -> str:
    return "not readable" if v is None else fmt.format(v)


def neighbour_view(nb: NeighbourOutcome | None) -> dict[str, Any] | None:
    """The negative check in the reader's words: its state, each criterion, and a table of what the service's
    memory did before the neighbour and while it held its memory (from ``NeighbourOutcome.facts``)."""
    if nb is None:
        return None
    f = nb.facts or {}
    rows: list[dict[str, str]] = []
    for key, what, fmt in (
        ("resident_bytes", "resident memory of the service's processes (RSS)", None),
        ("file_resident_bytes", "file-backed resident memory (mapped weights)", None),
        ("group_usage_bytes", "the service group's usage (page cache included)", None),
        ("major_faults_per_s", "major page faults", "{:.1f}/s"),
        ("memory_stall_pct", "memory stall of the service's group (PSI some)", "{:.1f} %"),
    ):
        pair = f.get(key)
        if not pair or (pair.get("before") is None and pair.get("during") is None):
            continue
        cell = (lambda v: "not readable" if v is None else format_bytes(v)) if fmt is None else (lambda v, f_=fmt: _num(v, f_))
        rows.append({"what": what, "before": cell(pair.get("before")), "during": cell(pair.get("during"))})
    hog = f.get("neighbour") or {}
    parent = f.get("parent") or {}
    kills = f.get("oom_kills")
    return {
        "state": nb.state, "during": nb.during, "reason": nb.reason, "verdicts": nb.verdicts, "rows": rows,
        "protection": f.get("protection"), "service_group": f.get("service_group"), "hog": hog,
        "hog_memory": format_bytes(hog.get("memory_bytes")), "hog_limit": format_bytes(hog.get("limit_bytes")),
        "hog_peak": format_bytes(hog.get("peak_bytes")) if hog.get("peak_bytes") is not None else None,
        "parent": parent.get("path"),
        "parent_limit": "unlimited" if parent.get("limit_bytes") is None else format_bytes(parent["limit_bytes"]),
        "oom_kills": "unknown" if kills is None and f else kills, "hog_exit": f.get("hog_exit"),
        "leftover": f.get("leftover"), "diagnosis": nb.diagnosis, "primary": nb.primary, "window": nb.window,
        "evidence": nb.evidence if not f else [],  # the figures are tabulated; prose only where there are none
    }  # fmt: skip


def view(report: GateReport, run: RunSeries, argv: Sequence[str]) -> dict[str, Any]:
    """What the template shows, every string already in the reader's words."""
    criteria: list[str] = []
    for s in report.steps:
        for v in s.verdicts:
            if v.criterion not in criteria:
                criteria.append(v.criterion)
    rows = []
    for s, w in zip(report.steps, run.steps, strict=True):
        cells = {v.criterion: v for v in s.verdicts}
        a = s.analysis
        rows.append({
            "name": s.step.name, "load": s.step.describe(), "state": _state(s), "window": w,
            "cells": [cells.get(c) for c in criteria], "failed": [v for v in s.verdicts if not v.passed],
            "measured": s.figures(), "primary": a.primary if a else "not diagnosed", "diagnosis": s.diagnosis(),
            "evidence": _evidence(s),
        })  # fmt: skip
    verdict = render(report).rsplit("\n", 1)[-1]  # the table's own last line: one wording of the verdict
    cls = "healthy" if report.passed else ("unknown" if report.interrupted else "")
    from diag.bundle.core import tool_version

    return {
        "verdict": verdict, "cls": cls, "report": report, "criteria": criteria, "rows": rows,
        "not_run": [s.name for s in report.spec.steps[len(report.steps) :]], "run": run,
        "target": redact_text(report.target)[0] + report.spec.endpoint, "spec": report.spec.source,
        "command": redact_argv(["diag", *argv[1:]]), "version": tool_version(), "created": time.time(),
        "bundle": report.bundle, "gates": list(report.gates.values()), "neighbour": neighbour_view(report.neighbour),
    }  # fmt: skip


def run_timeline(recorder: Path, report: GateReport) -> tuple[Timeline | None, str]:
    """The host's side of the whole run from the gate's flight recorder, or why it could not be read."""
    from diag.sources import load_recorder

    if not report.steps:
        return None, ""
    start, end = report.steps[0].window[0], report.steps[-1].window[1]
    until = end + 5.0
    try:
        return load_recorder(recorder, since_s=until - start + 5.0, until=until, workers=1), ""
    except Exception as exc:  # the page still shows the client's side
        return None, f"the host's samples could not be read from the recorder ({type(exc).__name__}: {exc})"


def render_html(report: GateReport, tl: Timeline | None, *, pids: Sequence[int] = (), cgroups: Sequence[str] = (),
                argv: Sequence[str] | None = None, notes: Sequence[str] = ()) -> str:  # fmt: skip
    """The page, from the run's report and the Timeline of its window (None: the client's side only)."""
    run = run_series(report, tl, pids, cgroups)
    drawn = charts(run)
    env = environment().overlay(loader=DictLoader({"gate.html.j2": TEMPLATE}))
    v = view(report, run, list(argv if argv is not None else sys.argv))
    return env.get_template("gate.html.j2").render(
        **v, notes=[*report.notes, *notes],
        charts=[{"key": c.key, "title": c.title, "caption": c.caption, "svg": Markup(c.svg)} for c in drawn],
    )  # fmt: skip


TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; img-src data:">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{{ verdict }} — diag gate</title>
<style>
  body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0 auto; max-width: 1100px; padding: 1.5rem; color: #1b1b1b; overflow-wrap: break-word; }
  h1 { font-size: 1.3rem; margin: 0 0 .3rem; }
  h2 { font-size: 1.1rem; margin-top: 2rem; border-bottom: 1px solid #ddd; padding-bottom: .2rem; }
  h3 { font-size: 1rem; margin: 1.2rem 0 .3rem; }
  .verdict { border-left: 6px solid #c0392b; background: #fdf2f0; padding: .8rem 1rem; border-radius: 4px; font-weight: 700; font-size: 1.15rem; }
  .verdict.healthy { border-color: #27ae60; background: #eefaf2; }
  .verdict.unknown { border-color: #7f8c8d; background: #f4f6f6; }
  .meta { color: #555; font-size: .9rem; }
  .warn { background: #fff6db; border: 1px solid #e8c95a; padding: .5rem .8rem; border-radius: 4px; margin: .6rem 0; }
  table { border-collapse: collapse; width: 100%; font-size: .88rem; margin: .4rem 0; }
  th, td { text-align: left; padding: .25rem .45rem; border-bottom: 1px solid #eee; vertical-align: top; overflow-wrap: anywhere; }
  th { background: #f6f6f6; }
  td.num { text-align: right; white-space: nowrap; }
  .limit { color: #555; font-size: .8rem; display: block; }
  .bad { color: #c0392b; font-weight: 600; }
  .ok { color: #27ae60; }
  .dim { color: #777; }
  .warnstate { color: #b7791f; font-weight: 600; }
  table.gate tr > :nth-child(-n+2) { white-space: nowrap; }
  table.diagnosis tr > :nth-child(-n+3) { white-space: nowrap; }  /* step, result, class: one word each, never broken */
  figure { margin: 1rem 0; }
  figure svg { max-width: 100%; height: auto; }
  figcaption { color: #555; font-size: .85rem; }
  code { background: #f3f3f3; padding: 0 .25rem; border-radius: 3px; font-size: .85em; }
</style>
</head>
<body>
<header>
  <h1>diag gate against <code>{{ target }}</code></h1>
  <div class="meta">Spec <code>{{ spec }}</code> · {{ report.steps | length }} of {{ report.spec.steps | length }} steps run{% if run.steps %} · {{ run.span[0] | when_full }} – {{ run.span[1] | when }} UTC ({{ (run.span[1] - run.span[0]) | duration }}){% endif %}</div>
</header>

<section class="verdict {{ cls }}" id="verdict">{{ verdict }}</section>
{% for n in notes %}
<div class="warn"><strong>Note:</strong> {{ n }}</div>
{% endfor %}
{% if bundle is not none and bundle.path %}
<p id="bundle">Incident bundle of the run up to the first failed step: <code>{{ bundle.path }}</code>{% if bundle.archive %} (archive <code>{{ bundle.archive }}</code>){% endif %}; its report.html has the rules' full evidence.</p>
{% endif %}

{% for g in gates %}
<h2 id="gate-{{ g.name }}">{{ g.name | capitalize }} gate: <span class="{{ 'ok' if g.passed else 'bad' }}">{{ "PASS" if g.passed else "FAIL" }}</span></h2>
{% if g.stopped %}<div class="warn"><strong>Stopped here:</strong> {{ g.stopped }}</div>{% endif %}
<table class="gate">
  <thead><tr><th>check</th><th>state</th><th>value read</th><th>why</th></tr></thead>
  <tbody>
  {% for c in g.checks %}
    <tr id="check-{{ g.name }}-{{ c.name }}"><td>{{ c.name }}</td><td class="{{ {'PASS': 'ok', 'FAIL': 'bad', 'WARN': 'warnstate'}.get(c.state, 'dim') }}">{{ c.state }}</td><td>{{ c.value }}</td><td>{{ c.detail }}</td></tr>
  {% endfor %}
  </tbody>
</table>
{% endfor %}

<h2 id="criteria">Steps and criteria</h2>
<table class="criteria">
  <thead><tr><th>step</th><th>load</th><th>result</th>{% for c in criteria %}<th>{{ c }}</th>{% endfor %}</tr></thead>
  <tbody>
  {% for r in rows %}
    <tr id="step-{{ r.name }}"><td>{{ r.name }}</td><td>{{ r.load }}</td>
      <td class="{{ 'ok' if r.state == 'PASS' else 'bad' }}">{{ r.state }}</td>
      {% for v in r.cells %}{% if v is none %}<td class="dim">-</td>{% else %}<td class="{{ 'ok' if v.passed else 'bad' }}" title="{{ v.note }}">{{ "PASS" if v.passed else "FAIL" }} {{ v.measured }}<span class="limit">limit {{ v.limit }}</span></td>{% endif %}{% endfor %}
    </tr>
  {% endfor %}
  {% for name in not_run %}
    <tr id="step-{{ name }}"><td>{{ name }}</td><td></td><td class="dim">NOT RUN</td>{% for c in criteria %}<td class="dim">-</td>{% endfor %}</tr>
  {% endfor %}
  </tbody>
</table>

<h2 id="diagnosis">Diagnosis of each step</h2>
<p>The rules engine over each step's window (the host agent's samples, the service's metrics or request rows when it has them).</p>
<table class="diagnosis">
  <thead><tr><th>step</th><th>result</th><th>primary</th><th>why</th></tr></thead>
  <tbody>
  {% for r in rows %}
    <tr><td>{{ r.name }}</td><td class="{{ 'ok' if r.state == 'PASS' else 'bad' }}">{{ r.state }}</td><td><strong>{{ r.primary }}</strong></td>
      <td>{{ r.diagnosis }}{% if r.evidence %}<br><span class="dim">{{ r.evidence }}</span>{% endif %}
      {% for v in r.failed %}<br><span class="bad">{{ v.criterion }} {{ v.measured }}, limit {{ v.limit }}</span>{% if v.note %} <span class="dim">({{ v.note }})</span>{% endif %}{% endfor %}</td></tr>
  {% endfor %}
  </tbody>
</table>

{% if neighbour %}{% set nb = neighbour %}
<h2 id="neighbour">Neighbour during {{ nb.during }}: <span class="{{ {'PASS': 'ok', 'FAIL': 'bad'}.get(nb.state, 'dim') }}">{{ nb.state }}</span></h2>
<p>The negative check: a bounded memory hog in a sibling of the service's memory cgroup, during step <strong>{{ nb.during }}</strong>'s load{% if nb.window %}, holding its memory {{ nb.window[0] | when }}–{{ nb.window[1] | when }} UTC{% endif %}; the service's memory and latency before it against while it held.</p>
{% if nb.reason %}<div class="warn"><strong>{{ nb.state }}:</strong> {{ nb.reason }}{% if nb.state == "NOT RUN" %} — the gate does not pass on a check it did not make.{% endif %}</div>{% endif %}
{% if nb.verdicts %}
<table class="neighbour-criteria">
  <thead><tr><th>criterion</th><th>result</th><th>measured</th><th>limit</th><th>how</th></tr></thead>
  <tbody>
  {% for v in nb.verdicts %}
    <tr id="neighbour-{{ v.criterion }}"><td>{{ v.criterion }}</td><td class="{{ 'ok' if v.passed else 'bad' }}">{{ "PASS" if v.passed else "FAIL" }}</td><td class="num">{{ v.measured }}</td><td class="num">{{ v.limit }}</td><td class="dim">{{ v.note }}</td></tr>
  {% endfor %}
  </tbody>
</table>
{% endif %}
{% if nb.hog %}
<ul class="neighbour-setup">
  <li id="neighbour-hog">Neighbour: {{ nb.hog_memory }} touched in <code>{{ nb.hog.group }}</code> (hard limit {{ nb.hog_limit }}), ready {{ nb.hog.ready_s | value("s") }} after its start, held {{ nb.hog.held_s | value("s") }}{% if nb.hog_peak %}; its group's usage at the peak {{ nb.hog_peak }}{% endif %}.</li>
  <li id="neighbour-protection">Protection of <code>{{ nb.service_group }}</code>: {{ nb.protection }}.</li>
  <li id="neighbour-parent">Shared parent <code>{{ nb.parent }}</code>: limit {{ nb.parent_limit }}{% if nb.parent_limit != "unlimited" %} — the neighbour's pages count against the service's limit{% endif %}.</li>
</ul>
{% endif %}
{% if nb.rows %}
<table class="neighbour-memory">
  <thead><tr><th>the service</th><th>before the neighbour</th><th>while it held its memory</th></tr></thead>
  <tbody>
  {% for r in nb.rows %}<tr><td>{{ r.what }}</td><td class="num">{{ r.before }}</td><td class="num">{{ r.during }}</td></tr>{% endfor %}
  </tbody>
</table>
<p class="meta">Memory before: the median over the seconds before the neighbour started; during: the lowest while it held (what reclaim took). Faults and stall: rates over each window.</p>
{% endif %}
{% if nb.hog %}<p id="neighbour-oom">OOM kills in the service during the hold: <strong class="{{ 'ok' if nb.oom_kills == 0 else 'bad' }}">{{ nb.oom_kills }}</strong></p>{% endif %}
{% if nb.hog_exit %}<div class="warn">{{ nb.hog_exit }}</div>{% endif %}
{% if nb.leftover %}<div class="warn"><strong>Left over:</strong> the neighbour's group could not be removed: {{ nb.leftover }}</div>{% endif %}
{% for e in nb.evidence %}<p class="dim">{{ e }}</p>{% endfor %}
{% if nb.diagnosis %}<p id="neighbour-diagnosis">Diagnosis of the step it ran in: <strong>{{ nb.primary or "not diagnosed" }}</strong> — {{ nb.diagnosis }}</p>{% endif %}
{% endif %}

<h2 id="measured">What each step measured</h2>
<table class="measured">
  <thead><tr><th>step</th><th>window (UTC)</th><th>sent</th><th>ok</th><th>errors</th><th>dropped</th><th>achieved req/s</th><th>e2e p50</th><th>e2e p99</th><th>send lag p99</th><th>drain</th></tr></thead>
  <tbody>
  {% for r in rows %}{% set m = r.measured %}
    <tr><td>{{ r.name }}</td><td>{% if r.window %}{{ r.window.start | when }}–{{ r.window.end | when }}{% endif %}</td><td class="num">{{ m.sent }}</td><td class="num">{{ m.ok }}</td>
      <td class="num">{{ m.errors }}</td><td class="num">{{ m.dropped }}</td><td class="num">{{ m.achieved_rps }}</td>
      <td class="num">{{ m.e2e_p50_s | value("s") }}</td><td class="num">{{ m.e2e_p99_s | value("s") }}</td>
      <td class="num">{{ m.send_lag_p99_s | value("s") }}</td><td class="num">{{ m.drain_s | value("s") }}</td></tr>
  {% endfor %}
  </tbody>
</table>

<h2 id="charts">Charts</h2>
{% if run.steps %}<p class="meta">Dotted verticals are the steps' starts and ends (UTC): {% for s in run.steps %}<strong>{{ s.name }}</strong> {{ s.start | when }}–{{ s.end | when }} ({{ s.state }}){{ ", " if not loop.last }}{% endfor %}. A gap between two steps is the gate judging the first{{ " and taking its bundle" if bundle is not none and bundle.path }}, with no load sent.</p>{% endif %}
{% if not charts %}<p>Nothing to draw: no step ran.</p>{% endif %}
{% for c in charts %}
<figure id="chart-{{ c.key }}" class="chart" role="img" aria-label="{{ c.title }}">
  <h3>{{ c.title }}</h3>
  {{ c.svg }}
  <figcaption>{{ c.caption }}</figcaption>
</figure>
{% endfor %}

<h2 id="about">About this run</h2>
<ul>
  <li>Tool: llm-diag {{ version }}; command: <code>{{ command }}</code>; page written {{ created | when_full }}.</li>
  <li>No prompt or completion text is kept by the gate (times and token counts only); credentials in the target or the command line are redacted.</li>
  <li>The same result as JSON: <code>diag gate ... --json PATH</code>.</li>
</ul>
</body>
</html>
"""  # noqa: E501 - markup lines read better whole than wrapped
