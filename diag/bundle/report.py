"""report.md and report.html: the verdict in plain words first, for someone who was not there.

Thin by design (ARCHITECTURE.md "Outputs are thin"): it renders the findings document the bundle
wrote (``findings.json``, already redacted) and draws the timeline's records; it derives no verdict.
The HTML is one self-contained file: inline CSS, charts as inline SVG, no script, no fonts or images
fetched -- a Content-Security-Policy of ``default-src 'none'`` makes any accidental fetch fail
instead of phoning home from an air-gapped incident room.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from markupsafe import Markup

from diag.bundle.charts import ChartData
from diag.bundle.redactor import rule_label
from diag.units import format_bytes, format_value
from diag.views.analysis import PLAIN, verdict_headline

value = format_value  # the templates' name for it

TEMPLATES = Path(__file__).parent / "templates"
MAX_EVIDENCE_CHARTS = 12

# Why a rule could not be evaluated, in words, by the signal it lacked (first prefix that matches).
WHY_MISSING: tuple[tuple[str, str], ...] = (
    ("requests", "no per-request timings: the serving process is not instrumented with the llm-diag tracker"),
    ("batches", "no batch records: the server's batcher is not instrumented"),
    ("routing", "no MoE routing records: not a mixture-of-experts model, or routing is not instrumented"),
    ("loader", "no model-loader events: the loader is not instrumented"),
    ("torch", "no torch memory snapshots: no GPU, or the tracker's torch hooks are off"),
    ("cuda_ooms", "no CUDA OOM errors recorded (and no torch snapshots)"),
    ("config", "no ServiceConfig record: the server did not describe its settings at start-up"),
    ("process:model_files", "no process holding a model file was seen"),
    ("process:", "no process samples"),
    ("processes", "no process samples"),
    ("cgroup:", "no samples of the service's cgroup: pass --pid or --cgroup, and run the agent with them"),
    ("gpu", "no GPU samples (no NVIDIA GPU or NVML here)"),
    ("ooms", "kernel OOM kills were not watched: no agent history and /dev/kmsg unreadable"),
    ("host:", "no host samples"),
    ("service:", "no aggregated service series"),
)


def why_missing(signal: str) -> str:
    for prefix, why in WHY_MISSING:
        if signal.startswith(prefix) or prefix in signal:
            return why
    if signal.startswith("rule error"):
        return "the rule failed on this data (a bug: please report it with this bundle)"
    return "signal not present in the records"


@dataclass
class ReportData:
    bundle_name: str
    host: str
    created: float
    window: tuple[float, float]
    since_s: float
    version: str
    command: str
    analysis: dict[str, Any] | None  # the findings.json document (redacted), None if the analysis failed
    analysis_error: str | None
    runs: list[dict[str, Any]]
    redaction: dict[str, Any]
    self_cgroup: dict[str, Any]
    record_counts: dict[str, int]
    warnings: list[str] = field(default_factory=list)
    files: list[dict[str, Any]] = field(default_factory=list)


# --------------------------------------------------------------------------- formatting helpers


def when(ts: Any) -> str:
    if not isinstance(ts, (int, float)) or not math.isfinite(ts):
        return "?"
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).strftime("%H:%M:%S")


def when_full(ts: Any) -> str:
    if not isinstance(ts, (int, float)) or not math.isfinite(ts):
        return "?"
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def duration(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)):
        return "?"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def environment() -> Environment:
    """The templates' environment: HTML autoescaped, undefined names an error, the report's filters. Public so
    another page (``diag gate --html``) renders with the same filters through ``environment().overlay(loader=...)``."""
    env = Environment(
        loader=FileSystemLoader(str(TEMPLATES)),
        autoescape=select_autoescape(enabled_extensions=("html.j2",), default_for_string=False),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters.update(when=when, when_full=when_full, value=value, duration=duration, bytes=format_bytes, rule_label=rule_label)
    return env


# --------------------------------------------------------------------------- the view model


def view(data: ReportData) -> dict[str, Any]:
    """Everything the two templates show, computed once so the Markdown and the HTML say the same."""
    analysis = data.analysis or {}
    verdict = analysis.get("verdict") or {}
    primary = verdict.get("primary") or ("unknown" if data.analysis is None else "healthy")
    findings = list(analysis.get("findings") or [])
    strong = [f for f in findings if (f.get("confidence") or 0) >= 0.5]
    weak = [f for f in findings if (f.get("confidence") or 0) < 0.5]
    actions: list[str] = []
    for f in sorted(strong, key=lambda f: f.get("class") != primary):
        for r in f.get("remediation") or []:
            if r not in actions:
                actions.append(r)
    not_evaluated = [
        {**item, "why": sorted({why_missing(str(m)) for m in item.get("missing") or []})}
        for item in analysis.get("not_evaluated") or []
    ]
    problems = [r for r in data.runs if r.get("status") not in ("ok",)]
    counts = {k: sum(1 for r in data.runs if r.get("status") == k) for k in ("ok", "skipped", "timeout", "error")}
    if primary == "unknown":
        headline = "No verdict: the analysis did not complete (" + (data.analysis_error or "unknown error") + ")."
    else:
        headline = verdict_headline(primary, verdict.get("suspects") or [], verdict.get("too_little_data") or [])
    return {
        "d": data,
        "primary": primary,
        "headline": headline,
        "contributing": [(c, PLAIN.get(c, c)) for c in verdict.get("contributing") or []],
        "strong": strong,
        "weak": weak,
        "actions": actions,
        "not_evaluated": not_evaluated,
        "too_little": list(verdict.get("too_little_data") or []),
        "evaluated": analysis.get("evaluated") or [],
        "problems": problems,
        "counts": counts,
        "window_s": max(0.0, data.window[1] - data.window[0]),
    }


def render_markdown(data: ReportData) -> str:
    return environment().get_template("report.md.j2").render(**view(data))


def render_html(data: ReportData, chart_data: ChartData | None) -> tuple[str, int]:
    """The HTML page and how many charts it carries (none without ``chart_data``)."""
    from diag.bundle.charts import evidence_chart, overview_charts

    v = view(data)
    charts = overview_charts(chart_data) if chart_data is not None else []
    ev_charts: dict[str, Markup] = {}
    n = 0
    for fi, f in enumerate(v["strong"] + v["weak"]):
        for ei, e in enumerate(f.get("evidence") or []):
            if n >= MAX_EVIDENCE_CHARTS or not e.get("series"):
                continue
            svg = evidence_chart(f"ev{fi}-{ei}", str(e.get("what", "")), str(e.get("unit", "")), e["series"])
            if svg:
                ev_charts[f"{fi}-{ei}"] = Markup(svg)
                n += 1
    html = (
        environment()
        .get_template("report.html.j2")
        .render(
            **v,
            charts=[{"key": c.key, "title": c.title, "caption": c.caption, "svg": Markup(c.svg)} for c in charts],
            ev_charts=ev_charts,
        )
    )
    return html, len(charts) + n
