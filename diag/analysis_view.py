"""Terminal rendering of an Analysis: the verdict in plain words first, then the evidence, then what
could not be evaluated and why. Thin: it prints what the rules concluded and derives nothing."""

from __future__ import annotations

import datetime as dt

from rich.console import Console
from rich.text import Text

from diag.rules.classes import PLAIN
from diag.rules.engine import Analysis
from diag.units import format_value

__all__ = ["PLAIN", "render_analysis"]


def _when(ts: float | None) -> str:
    if ts is None:
        return "?"
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).strftime("%H:%M:%S")


def render_analysis(analysis: Analysis, console: Console | None = None) -> None:
    console = console or Console()
    start, end = analysis.window
    head = Text("Verdict: ", style="bold")
    style = {"healthy": "bold green", "inconclusive": "bold yellow"}.get(analysis.primary, "bold red")
    head.append(analysis.primary, style=style)
    console.print(head)
    console.print(PLAIN.get(analysis.primary, analysis.primary))
    if analysis.contributing:
        console.print("Contributing: " + ", ".join(analysis.contributing))
    inconclusive = analysis.primary == "inconclusive"
    for sus in analysis.suspects if inconclusive else []:  # otherwise they are listed among the findings below
        console.print(Text(f"Suspect: {sus['class']} (confidence {sus['confidence']:.2f}) -- {sus['summary']}", style="yellow"))
    for short in analysis.too_little_data:
        note = f"Too little data for {short['rule']}: have {short['have']}, needs {short['needed']}"
        console.print(Text(note, style="yellow" if inconclusive else "dim"))
    console.print(Text(f"Window {_when(start)}–{_when(end)} UTC ({end - start:.0f} s) from {analysis.source}", style="dim"))
    for f in analysis.findings:
        console.print()
        console.print(Text(f"[{f.cls}] {f.summary}", style="bold"))
        console.print(Text(f"  confidence {f.confidence:.2f} · rule {f.rule}", style="dim"))
        for e in f.evidence:
            span = f" ({_when(e.start)}–{_when(e.end)})" if e.start is not None else ""
            console.print(Text(f"  • {e.what}: {format_value(e.value, e.unit)}{span}"))
        for r in f.rules_out:
            console.print(Text(f"  rules out: {r}", style="cyan"))
        for r in f.remediation:
            console.print(Text(f"  do: {r}", style="green"))
    if analysis.not_evaluated:
        console.print()
        console.print(Text("Not evaluated (missing signals — not the same as healthy):", style="yellow"))
        for item in analysis.not_evaluated:
            console.print(Text(f"  {item['rule']}: missing {'; '.join(item.get('why') or item['missing'])}", style="yellow"))
