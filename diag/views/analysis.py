"""Terminal rendering of an Analysis: the verdict in plain words first, then the evidence, then what
could not be evaluated and why. Thin: it prints what the rules concluded and derives nothing."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.text import Text

from diag.rules.classes import INCONCLUSIVE, PLAIN
from diag.rules.engine import PRIMARY_CONFIDENCE, SUSPECT_CONFIDENCE, Analysis
from diag.units import format_value

__all__ = ["PLAIN", "render_analysis", "verdict_headline"]


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _rule_names(entries: Sequence[Mapping[str, Any]], most: int = 3) -> str:
    names = [str(e.get("rule", "?")) for e in entries]
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def verdict_headline(
    primary: str, suspects: Sequence[Mapping[str, Any]] = (), too_little_data: Sequence[Mapping[str, Any]] = ()
) -> str:
    """The verdict in plain words, saying why when it is ``inconclusive``.

    Why not one fixed sentence: "inconclusive" has two causes -- findings that reached only the suspect level,
    and rules that could not judge because the window was too short -- and a headline pointing at suspects
    when there are none (two samples in a fresh recorder) sends the reader looking for something that is not
    there. The words follow what the analysis reported, in each combination."""
    if primary != INCONCLUSIVE:
        return PLAIN.get(primary, primary)
    found = (
        f"{_count(len(suspects), 'suspect', 'suspects')} reached confidence {SUSPECT_CONFIDENCE} but none "
        f"{PRIMARY_CONFIDENCE}, not firmly enough to name the cause"
    )
    short = (
        f"{_count(len(too_little_data), 'rule', 'rules')} had too little data to judge ({_rule_names(too_little_data)}); "
        "record for longer and analyse again"
    )
    if suspects and too_little_data:
        return f"Inconclusive: {found}; and {short}."
    if suspects:
        return f"Inconclusive: {found}."
    if too_little_data:
        return f"Inconclusive: nothing was found, but {short}."
    return (
        f"Inconclusive: no cause could be named, and this analysis gives no reason (no finding at {SUSPECT_CONFIDENCE} "
        "or more, no rule short of data)."
    )


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
    console.print(verdict_headline(analysis.primary, analysis.suspects, analysis.too_little_data))
    if analysis.contributing:
        console.print("Contributing: " + ", ".join(analysis.contributing))
    inconclusive = analysis.primary == "inconclusive"
    for sus in analysis.suspects if inconclusive else []:  # otherwise they are listed among the findings below
        console.print(Text(f"Suspect: {sus['class']} (confidence {sus['confidence']:.2f}) -- {sus['summary']}", style="yellow"))
    for short in analysis.too_little_data:
        note = f"Too little data for {short['rule']}: has {short['have']}, needs {short['needed']}"
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
