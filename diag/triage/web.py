"""The receiver's read-only web page: incidents with status, class, evidence and timeline.

Why so strict about escaping: every label value on the page came from an alert, and anyone who can
make an alert fire controls them. Jinja2 autoescaping covers text and attributes; the page also
carries a Content-Security-Policy with no script source at all, so even a missed escape could not
run script. There is no JavaScript: the charts are inline SVG drawn here from the evidence excerpts.
"""

from __future__ import annotations

import json
import sqlite3
import time
from typing import Any

from jinja2 import DictLoader, Environment, select_autoescape

from diag.triage.outbox import NOT_DIAGNOSED
from diag.triage.store import get_incident, get_setting, list_incidents

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

_BASE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{{ title }} · llm-diag triage</title>
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;width:100%}
td,th{border-bottom:1px solid #ddd;padding:.3em .5em;text-align:left;vertical-align:top}
.s-open{color:#b00;font-weight:600}.s-resolving{color:#c60}.s-resolved{color:#070}.s-closed{color:#666}
code{background:#f4f4f4;padding:0 .2em}.flap{background:#fd0;padding:0 .3em}.muted{color:#777}
.fail{background:#fdd;color:#900;padding:0 .3em;white-space:nowrap}.warn{background:#fde7c0;padding:.5em;border:1px solid #e3b04b}
svg{background:#fafafa;border:1px solid #eee}
</style></head><body>
<p><a href="/">Incidents</a> · generated {{ now }}</p>
{% block body %}{% endblock %}
</body></html>
"""

_LIST = """{% extends "base" %}{% block body %}
<h1>Incidents</h1>
{% if previous_store %}<p class="warn" id="store-reset">The incident store was unreadable and was started afresh;
the old file was kept as <code>{{ previous_store }}</code>.</p>{% endif %}
{% if not incidents %}<p class="muted">No incidents recorded.</p>{% else %}
<table id="incidents"><tr><th>#</th><th>Status</th>
<th>Class</th><th>Title</th><th>Alerts</th><th>Reopened</th><th>Updated</th></tr>
{% for i in incidents %}<tr class="incident">
<td><a href="/incidents/{{ i.id }}">{{ i.id }}</a></td>
<td class="s-{{ i.status }}">{{ i.status }}{% if i.resolution %} ({{ i.resolution }}){% endif %}
{% if i.flapping %} <span class="flap">flapping</span>{% endif %}
{% if i.ticket_failures %} <span class="fail">ticket failed</span>{% endif %}</td>
<td>{{ i.diag_class or diag_label(i.diag_state) }}</td>
<td>{{ i.title }}</td><td>{{ i.alert_count }}</td><td>{{ i.reopen_count }}</td><td>{{ when(i.updated_at) }}</td>
</tr>{% endfor %}</table>{% endif %}
{% endblock %}"""

_DETAIL = """{% extends "base" %}{% block body %}
<h1>Incident {{ inc.id }}: {{ inc.title }}</h1>
<p class="s-{{ inc.status }}">{{ inc.status }}{% if inc.resolution %} ({{ inc.resolution }}){% endif %}
{% if inc.flapping %} <span class="flap">flapping</span>{% endif %} · reopened {{ inc.reopen_count }}× ·
started {{ when(inc.starts_at) }}</p>
<p>Key: {% for k, v in key_labels.items() %}<code>{{ k }}={{ v }}</code> {% endfor %}</p>
<p>Labels: {% for k, v in labels.items() %}<code>{{ k }}={{ v }}</code> {% endfor %}</p>
{% for k, v in annotations.items() %}<p>{{ k }}: {{ v }}</p>{% endfor %}
{% if safe_link(inc.generator_url) %}<p><a href="{{ inc.generator_url }}" rel="noreferrer">source expression</a></p>{% endif %}
<h2>Diagnosis</h2>
{% if diag %}<p id="verdict">Verdict: <b>{{ inc.diag_class }}</b>
{% if diag.verdict is mapping and diag.verdict.contributing %}
· contributing: {{ diag.verdict.contributing|join(", ") }}{% endif %}
· analysed {{ when(inc.diag_at) }} from {{ diag.triage.source if diag.triage else "" }}</p>
{% for f in diag.findings or [] %}<h3>{{ f["class"] }} ({{ "%.0f"|format((f.confidence or 0) * 100) }} %) — {{ f.rule }}</h3>
<p>{{ f.summary }}</p><ul>
{% for e in f.evidence or [] %}<li>{{ e.what }}: {{ e.value }} {{ e.unit }}
{% if e.series %}<br>{{ spark(e.series) }}{% endif %}</li>{% endfor %}
</ul>{% if f.rules_out %}<p class="muted">Rules out: {{ f.rules_out|join("; ") }}</p>{% endif %}{% endfor %}
{% if diag.not_evaluated %}<p class="muted">Not evaluated: {% for n in diag.not_evaluated %}{{ n.rule }}
(missing {{ (n.missing or [])|join(", ") }}){% if not loop.last %}; {% endif %}{% endfor %}</p>{% endif %}
{% elif inc.diag_state == "failed" %}<p>Diagnosis failed: {{ inc.diag_error }}</p>
{% elif inc.diag_state == "off" %}<p class="muted" id="diagnosis-off">Not diagnosed (--no-diagnosis): the receiver runs
without diagnosis.</p>
{% else %}<p class="muted">Diagnosis {{ inc.diag_state }}…</p>{% endif %}
{% if inc.bundle_path %}<p>Bundle: <code>{{ inc.bundle_path }}</code></p>{% endif %}
<h2>Tickets</h2>{% if tickets %}<ul>{% for t in tickets %}<li>{{ t.sink }}:
{% if safe_link(t.url) %}<a href="{{ t.url }}" rel="noreferrer">{{ t.external_id }}</a>{% else %}{{ t.external_id }}{% endif %}
</li>{% endfor %}</ul>{% elif not failures %}<p class="muted">none</p>{% endif %}
{% if failures %}<ul id="ticket-failures">{% for f in failures %}<li><span class="fail">{{ f.sink }} {{ f.action }}
failed, not retried</span> ({{ when(f.failed_at) }}): {{ f.error }}</li>{% endfor %}</ul>
<p class="muted">Fix the cause, then <code>diag tickets retry {{ inc.id }}</code>.</p>{% endif %}
<h2>Alerts</h2><table><tr><th>Fingerprint</th><th>Status</th><th>Starts</th><th>Labels</th></tr>
{% for a in alerts %}<tr><td><code>{{ a.fingerprint }}</code></td><td>{{ a.status }}</td><td>{{ when(a.starts_at) }}</td>
<td>{% for k, v in a.labels.items() %}<code>{{ k }}={{ v }}</code> {% endfor %}</td></tr>{% endfor %}</table>
<h2>Timeline</h2>
<table id="timeline">{% for e in events %}<tr><td>{{ when(e.ts) }}</td><td>{{ e.kind }}</td><td>{{ e.text }}</td></tr>
{% endfor %}</table>
{% endblock %}"""


def _diag_label(state: str) -> str:
    """The class column while there is no class: why not."""
    if state in ("pending", "running"):
        return "diagnosing…"
    return NOT_DIAGNOSED if state == "off" else state


def _when(ts: float | None) -> str:
    return "—" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def _safe_link(url: str | None) -> bool:
    """Only http(s) links become anchors: a ``javascript:`` generator URL stays text."""
    return bool(url) and str(url).lower().startswith(("http://", "https://"))


def _spark(series: Any) -> str:
    """A 240x40 inline SVG polyline of an evidence excerpt ``[[ts, value], ...]`` (numbers only, so nothing to escape)."""
    from markupsafe import Markup

    try:
        pts = [(float(t), float(v)) for t, v in series if v is not None]
    except (TypeError, ValueError):
        return ""
    if len(pts) < 2:
        return ""
    t0, t1 = pts[0][0], pts[-1][0]
    lo, hi = min(v for _, v in pts), max(v for _, v in pts)
    span_t, span_v = (t1 - t0) or 1.0, (hi - lo) or 1.0
    coords = " ".join(f"{(t - t0) / span_t * 236 + 2:.1f},{38 - (v - lo) / span_v * 36:.1f}" for t, v in pts)
    return Markup(
        f'<svg width="240" height="40" role="img">'
        f'<polyline fill="none" stroke="#36c" stroke-width="1.5" points="{coords}"/></svg>'
    )


_ENV = Environment(
    loader=DictLoader({"base": _BASE, "list": _LIST, "detail": _DETAIL}),
    autoescape=select_autoescape(default=True, default_for_string=True),
)
_ENV.globals.update(when=_when, safe_link=_safe_link, spark=_spark, diag_label=_diag_label)


def render_list(db: sqlite3.Connection) -> str:
    return _ENV.get_template("list").render(
        title="Incidents", incidents=list_incidents(db), previous_store=get_setting(db, "previous_store"), now=_when(time.time())
    )


def render_incident(db: sqlite3.Connection, incident_id: int) -> str | None:
    view = get_incident(db, incident_id)
    if view is None:
        return None
    row = view.row
    return _ENV.get_template("detail").render(
        title=f"Incident {row['id']}",
        inc=row,
        key_labels=json.loads(row["key_labels"]),
        labels=json.loads(row["labels"]),
        annotations=json.loads(row["annotations"]),
        diag=view.diagnosis,
        alerts=[{**a, "labels": json.loads(a["labels"])} for a in view.alerts],
        events=view.events,
        tickets=view.tickets,
        failures=view.ticket_failures,
        now=_when(time.time()),
    )
