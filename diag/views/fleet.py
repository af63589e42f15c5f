"""A fleet's verdicts as one ranked table (``diag analyze --fleet``): sick targets first, by confidence.

Why a table and not N analyses: the question is "which of my nodes are sick, and why?", so each target is one
row -- its verdict, the class, how sure, and the one sentence of evidence that carries it -- and the reader
opens the full analysis (``diag analyze --selector`` on that target, or the ``analysis`` in ``--json``) only
for the rows that matter. A target with too little data is a row saying so: dropping it would read as healthy.
The rows restate what the rules concluded; nothing is judged here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from diag.rules.classes import HEALTHY, INCONCLUSIVE
from diag.rules.engine import Analysis
from diag.views.analysis import verdict_headline

TOO_LITTLE_DATA = "too_little_data"  # the fleet table's status for a target with fewer steps than the fleet minimum
NOT_ANALYSED = "not_analysed"  # a target whose analysis failed: listed with the error, the rest of the fleet goes on
_STYLE = {HEALTHY: "green", INCONCLUSIVE: "yellow", TOO_LITTLE_DATA: "yellow", NOT_ANALYSED: "yellow"}
_RANK = {NOT_ANALYSED: 1, INCONCLUSIVE: 2, TOO_LITTLE_DATA: 3, HEALTHY: 4}  # every incident class ranks 0: sick first


def fleet_row(target: str, points: int, min_points: int, analysis: Analysis) -> dict[str, Any]:
    """One target's row: verdict, class, confidence, the one-line evidence, and its whole analysis document.

    A target whose longest series has fewer than ``min_points`` steps is ``too_little_data`` unless the rules
    named a class anyway (a finding at the primary level stands on its own evidence)."""
    primary = analysis.primary
    cls, confidence, evidence = "", 0.0, ""
    if primary not in (HEALTHY, INCONCLUSIVE):
        top = next((f for f in analysis.findings if f.cls == primary), None)
        cls = primary
        confidence = top.confidence if top is not None else 0.0
        evidence = top.summary if top is not None else ""
    elif points < min_points:
        primary = TOO_LITTLE_DATA
        evidence = f"only {points} steps of data in the window (the fleet table needs {min_points})"
    elif primary == INCONCLUSIVE:
        if analysis.suspects:
            top_suspect = analysis.suspects[0]
            cls, confidence = str(top_suspect["class"]), float(top_suspect["confidence"])
            evidence = f"suspect: {top_suspect['summary']}"
        else:
            evidence = verdict_headline(primary, analysis.suspects, analysis.too_little_data)
    else:
        evidence = f"no finding at 0.3 or more; {len(analysis.evaluated)} rules evaluated"
    return {
        "target": target,
        "verdict": primary,
        "class": cls,
        "confidence": round(float(confidence), 3),
        "evidence": evidence,
        "points": points,
        "analysis": analysis.to_dict(),
    }


def failed_row(target: str, points: int, error: str) -> dict[str, Any]:
    """The row of a target whose Timeline or rules failed: the error in the evidence column, never a silent gap."""
    return {"target": target, "verdict": NOT_ANALYSED, "class": "", "confidence": 0.0,
            "evidence": f"analysis failed: {error}", "points": points, "analysis": None}  # fmt: skip


def ranked(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Sick first (any incident class), then not analysed, inconclusive, too little data, healthy; by confidence, then
    name."""
    return sorted(rows, key=lambda r: (_RANK.get(str(r["verdict"]), 0), -float(r["confidence"]), str(r["target"])))


def fleet_document(rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any]) -> dict[str, Any]:
    """The ``--fleet --json`` document: what was asked (``meta``) and the ranked rows."""
    ordered = ranked(rows)
    counts: dict[str, int] = {}
    for row in ordered:
        counts[str(row["verdict"])] = counts.get(str(row["verdict"]), 0) + 1
    return {**meta, "counts": counts, "targets": ordered}


def render_fleet(rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any], console: Console | None = None) -> None:
    """The ranked table, and one line saying what was read."""
    console = console or Console()
    table = Table(title=f"Fleet {{{meta.get('selector', '')}}} by {meta.get('by', '')}", title_justify="left")
    for name, kw in (("target", {}), ("verdict", {}), ("class", {}), ("confidence", {"justify": "right"}),
                     ("evidence", {"overflow": "fold"})):  # fmt: skip
        table.add_column(name, **kw)  # type: ignore[arg-type]
    for row in ranked(rows):
        verdict = str(row["verdict"])
        style = _STYLE.get(verdict, "bold red")
        conf = f"{float(row['confidence']):.2f}" if row["class"] else ""
        cells = (str(row["target"]), verdict, str(row["class"]), conf, str(row["evidence"]))  # plain text, never markup
        table.add_row(*(Text(c, style=style if i == 1 else "") for i, c in enumerate(cells)))
    console.print(table)
    sick = sum(1 for r in rows if _RANK.get(str(r["verdict"]), 0) == 0)
    failed = sum(1 for r in rows if r["verdict"] == NOT_ANALYSED)
    not_analysed = f", {failed} not analysed" if failed else ""
    said = (f"{len(rows)} targets, {sick} sick{not_analysed}; {meta.get('queries')} queries, step {meta.get('step_s')} s, "
            f"from {meta.get('source')}")  # fmt: skip
    console.print(Text(said, style="dim"))
