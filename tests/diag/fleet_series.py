"""A fleet's series from recorded scenario runs: each target one recording, relabelled and shifted, as OpenMetrics.

Why recordings: the fleet tests must show that the one-pass queries and the per-target split give each target
the verdict its own data supports, so every target's series are real -- a recorded run of ``diag demo
--scenario`` turned into what a Prometheus scraping that machine would hold, through the product's own
exporters (``diag.demo.scenarios.openmetrics``). A target is a machine: its agent on ``<name>:9464`` and its
backend on ``<name>:8000``, both with the fleet's label ``cluster``. Every run is shifted to end at the same
moment, as a fleet observed over one window. The documents are merged into one file (families grouped, one
``# EOF``) so promtool backfills the whole fleet in one run.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from diag.demo.scenarios.openmetrics import openmetrics
from diag.demo.scenarios.recording import read_jsonl_gz
from tests.paths import FIXTURES

CLUSTER = "fleet-a"
SELECTOR = f'cluster="{CLUSTER}"'


def recording(scenario: str) -> list[dict[str, Any]]:
    return read_jsonl_gz(FIXTURES / "scenarios" / f"{scenario}.jsonl.gz")


def target_document(name: str, records: Sequence[dict[str, Any]], end: float) -> str:
    """One target's OpenMetrics: ``records`` shifted to end at ``end``, labelled as machine ``name``."""
    shift = end - max(float(r["ts"]) for r in records)
    return openmetrics(records, agent_labels={"job": "llm-diag-host", "instance": f"{name}:9464", "cluster": CLUSTER},
                       backend_labels={"job": "llm", "instance": f"{name}:8000", "cluster": CLUSTER},
                       shift_s=shift)  # fmt: skip


def merge(documents: Iterable[str]) -> str:
    """Several OpenMetrics documents as one: each family's lines together under one ``# TYPE``, one ``# EOF``."""
    types: dict[str, str] = {}
    lines: dict[str, list[str]] = defaultdict(list)
    for doc in documents:
        family = ""
        for line in doc.splitlines():
            if line == "# EOF" or not line:
                continue
            if line.startswith("# TYPE "):
                _, _, family, kind = line.split(" ", 3)
                types.setdefault(family, kind)
                continue
            lines[family].append(line)
    out = []
    for family, rows in lines.items():
        out.append(f"# TYPE {family} {types[family]}")
        out.extend(rows)
    out.append("# EOF")
    return "\n".join(out) + "\n"


def write_fleet(plan: Sequence[tuple[str, str]], end: float, path: Path) -> Path:
    """``plan``: (target name, scenario) pairs; the fleet's series written to ``path`` for promtool."""
    cache: dict[str, list[dict[str, Any]]] = {}
    docs = []
    for name, scenario in plan:
        records = cache.setdefault(scenario, recording(scenario))
        docs.append(target_document(name, records, end))
    path.write_text(merge(docs))
    return path
