"""Every panel, annotation and variable expression, with Grafana's variables substituted, passes
``promtool check rules`` (each wrapped as a recording rule): real PromQL parsing by Prometheus' own parser."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from dashboards import definitions
from dashboards.build import render

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian package 'prometheus')")


def substitute(expr: str) -> str:
    """What Grafana sends: intervals become durations, multi-value variables a regex."""
    out = expr.replace("$__rate_interval", "1m").replace("$__interval", "1m").replace("$__range", "1h")
    return re.sub(r"\$\{?(job|instance|model|slo)\}?", ".+", out)


def expressions() -> list[tuple[str, str]]:
    out = []
    for d in definitions.all_dashboards():
        board: dict[str, Any] = render(d)
        for p in board["panels"]:
            out += [(f"{d.uid} / {p['title']} / {t['refId']}", t["expr"]) for t in p.get("targets", [])]
        out += [(f"{d.uid} / annotation {a['name']}", a["expr"]) for a in board["annotations"]["list"]]
        for v in board["templating"]["list"]:
            m = re.fullmatch(r"label_values\((.+),\s*\w+\)|query_result\((.+)\)", v.get("query", ""))
            if m:
                out.append((f"{d.uid} / variable {v['name']}", m.group(1) or m.group(2)))
    return out


def rules_file(items: list[tuple[str, str]], folder: Path) -> Path:
    lines = ["groups:", "  - name: dashboards", "    rules:"]
    for i, (where, expr) in enumerate(items):
        lines += [f"      # {where}", f"      - record: llmdiag_dashboard_check:{i}"]
        lines.append(f"        expr: {_yaml_str(substitute(expr))}")
    path = folder / "dashboards.rules.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _yaml_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def promtool(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(PROMTOOL), "check", "rules", str(path)], capture_output=True, text=True, timeout=120)


@pytest.mark.process
def test_every_expression_parses_with_promtool(tmp_path: Path) -> None:
    items = expressions()
    assert len(items) > 60
    proc = promtool(rules_file(items, tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(items)} rules found" in proc.stdout


@pytest.mark.process
def test_promtool_rejects_a_broken_expression(tmp_path: Path) -> None:
    where, expr = expressions()[0]
    proc = promtool(rules_file([(where, expr + "]]")], tmp_path))
    assert proc.returncode != 0 and "parse error" in (proc.stdout + proc.stderr)
