"""A fleet's series from recorded scenario runs: each target one recording, relabelled and shifted, as OpenMetrics.

Why recordings: the fleet tests must show that the one-pass queries and the per-target split give each target
the verdict its own data supports, so every target's series are real -- a recorded run of ``diag demo
--scenario`` turned into what a Prometheus scraping that machine would hold, through the product's own
exporters (``diag.demo.scenarios.openmetrics``). A target is a machine: its agent on ``<name>:9464`` and its
backend on ``<name>:8000``, both with the fleet's label ``cluster`` and ``host=<name>`` (as the shipped
scrape config sets it). Every run is shifted to end at the same
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
# The fleet the Prometheus and VictoriaMetrics tests build: these machines carry a recorded incident of that class,
# the rest a healthy recording; THIN one too short to judge.
SICK = {"node03": "queue_backlog", "node07": "memory_leak", "node11": "host_oom", "node14": "queue_backlog",
        "node17": "memory_leak", "node20": "host_oom"}  # fmt: skip
SCENARIO = {"queue_backlog": "queue", "memory_leak": "leak", "host_oom": "host-oom"}  # class -> recorded scenario
THIN = "node21"
SINCE_S = 80.0  # the recordings are 50-66 s long, all ending at the fleet's end
SELECTOR = f'cluster="{CLUSTER}"'


def recording(scenario: str) -> list[dict[str, Any]]:
    return read_jsonl_gz(FIXTURES / "scenarios" / f"{scenario}.jsonl.gz")


PLACEHOLDER = "llmdiag-fleet-target"  # the target's name in a rendered document, replaced per target


def target_document(name: str, records: Sequence[dict[str, Any]], end: float) -> str:
    """One target's OpenMetrics: ``records`` shifted to end at ``end``, labelled as machine ``name``."""
    return scenario_document(records, end).replace(PLACEHOLDER, name)


def scenario_document(records: Sequence[dict[str, Any]], end: float) -> str:
    """A recording rendered once for every target that replays it (targets differ only in their labels)."""
    shift = end - max(float(r["ts"]) for r in records)
    labels = {"cluster": CLUSTER, "host": PLACEHOLDER}
    return openmetrics(records, agent_labels={"job": "llm-diag-host", "instance": f"{PLACEHOLDER}:9464", **labels},
                       backend_labels={"job": "llm", "instance": f"{PLACEHOLDER}:8000", **labels},
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


def write_fleet(plan: Sequence[tuple[str, Sequence[dict[str, Any]]]], end: float, path: Path) -> Path:
    """``plan``: (target name, its records) pairs; the fleet's series written to ``path`` for promtool."""
    rendered: dict[int, str] = {}
    docs = []
    for name, records in plan:
        doc = rendered.get(id(records))
        if doc is None:
            doc = rendered[id(records)] = scenario_document(records, end)
        docs.append(doc.replace(PLACEHOLDER, name))
    path.write_text(merge(docs))
    return path
