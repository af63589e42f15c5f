"""The gate's result in the terminal: one table of steps x criteria (PASS/FAIL and the measured value), then
for each failed step the criteria that broke and the diagnosis of why.

Plain text, not a rich table: the table is read in CI logs and pasted into change tickets, where a fixed
layout that does not depend on a terminal's width survives; the JSON (``GateReport.to_dict``) is for machines.
"""

from __future__ import annotations

from diag.gate.gates import GateResult
from diag.gate.runner import GateReport


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def render_gate(gate: GateResult) -> list[str]:
    """One gate: its verdict, a table of check / state / value, and why for each check that did not PASS."""
    lines = [f"{gate.name} gate: {'PASS' if gate.passed else 'FAIL'}"]
    lines += _table([["check", "state", "value"], *([c.name, c.state, c.value] for c in gate.checks)])
    lines += [f"{c.name}: {c.state} -- {c.detail}" for c in gate.checks if c.state != "PASS" and c.detail]
    if gate.stopped:
        lines.append(f"{gate.name}: stopped here -- {gate.stopped}")
    return lines


def failed_gates(report: GateReport) -> list[str]:
    """``name (check, check)`` for every gate with a FAILed check."""
    return [
        f"{g.name} ({', '.join(c.name for c in g.checks if c.state == 'FAIL')})" for g in report.gates.values() if not g.passed
    ]


def _cell(report: GateReport, step_index: int, criterion: str) -> str:
    for v in report.steps[step_index].verdicts:
        if v.criterion == criterion:
            return f"{'PASS' if v.passed else 'FAIL'} {v.measured}"
    return "-"


def render(report: GateReport) -> str:
    """The gates, the table, the failures explained, and the overall verdict, as lines of text."""
    gate_lines: list[str] = []
    for gate in report.gates.values():
        gate_lines += [*render_gate(gate), ""]
    criteria: list[str] = []
    for s in report.steps:
        for v in s.verdicts:
            if v.criterion not in criteria:
                criteria.append(v.criterion)
    header = ["step", "result", *criteria]
    rows = []
    for i, s in enumerate(report.steps):
        result = "INTERRUPTED" if s.load.interrupted else ("PASS" if s.passed else "FAIL")
        rows.append([s.step.name, result, *(_cell(report, i, c) for c in criteria)])
    for s in report.spec.steps[len(report.steps) :]:
        rows.append([s.name, "NOT RUN", *("-" for _ in criteria)])
    lines = gate_lines + _table([header, *rows])
    for s in report.steps:
        failed = [v for v in s.verdicts if not v.passed]
        if not failed and not s.load.interrupted:
            continue
        lines.append("")
        for v in failed:
            note = f" ({v.note})" if v.note else ""
            lines.append(f"{s.step.name}: {v.criterion} {v.measured}, limit {v.limit}{note}")
        if s.load.interrupted:
            lines.append(f"{s.step.name}: interrupted before its end")
        lines.append(f"{s.step.name}: diagnosis -- {s.diagnosis()}")
    lines += _neighbour(report)
    if report.bundle is not None and report.bundle.path is not None:
        archive = f" (archive {report.bundle.archive})" if report.bundle.archive else ""
        lines.append(f"bundle: {report.bundle.path}{archive}")
    for note in report.notes:
        lines.append(f"note: {note}")
    lines.append("")
    if report.passed:
        gates = f"; {' and '.join(report.gates)} gate{'s' if len(report.gates) > 1 else ''} passed" if report.gates else ""
        held = ", the neighbour held" if report.neighbour is not None else ""
        lines.append(f"GATE PASSED: {len(report.steps)} steps, every criterion met{gates}{held}")
    elif report.interrupted:
        lines.append(f"GATE NOT PASSED: interrupted after {len(report.steps)} of {len(report.spec.steps)} steps")
    else:
        bad = failed_gates(report) + [s.step.name for s in report.steps if not s.passed]
        if len(report.steps) < len(report.spec.steps):
            bad.append(f"{len(report.spec.steps) - len(report.steps)} steps not run")
        if report.neighbour is not None and report.neighbour.state == "FAIL":
            bad.append(f"neighbour (during {report.neighbour.during})")
        if bad:
            lines.append(f"GATE FAILED: {', '.join(bad)}")
        else:  # every step and gate passed; the negative check was asked for and not made
            lines.append(
                f"GATE NOT PASSED: the neighbour check was NOT RUN ({report.neighbour.reason if report.neighbour else '?'})"
            )
    return "\n".join(lines)


def _neighbour(report: GateReport) -> list[str]:
    """The negative check: its state, each criterion, the evidence, the diagnosis of the hold's window."""
    nb = report.neighbour
    if nb is None:
        return []
    lines = ["", f"neighbour (during {nb.during}): {nb.state}" + (f" -- {nb.reason}" if nb.reason else "")]
    for v in nb.verdicts:
        note = f" ({v.note})" if v.note else ""
        lines.append(f"  {'PASS' if v.passed else 'FAIL'} {v.criterion} {v.measured}, limit {v.limit}{note}")
    lines += [f"  {e}" for e in nb.evidence]
    if nb.diagnosis:
        lines.append(f"neighbour: diagnosis -- {nb.diagnosis}")
    return lines
