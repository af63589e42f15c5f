"""Write (or check) the generated dashboards and the Grafana provisioning file.

The JSON is committed, so a reviewer sees every query change as a diff and Grafana can provision
straight from the repository; ``check`` regenerates in memory and reports each file that differs,
so a catalog change that would alter a panel fails CI until the JSON is regenerated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dashboards.build import render
from dashboards.definitions import all_dashboards
from dashboards.paths import GRAFANA_DASHBOARDS_DIR, PROVISIONING_FILE

DEFAULT_OUT = Path(__file__).resolve().parent / "generated"
FOLDER = "llm-diag"


def provisioning(path_in_grafana: str = GRAFANA_DASHBOARDS_DIR) -> str:
    """A Grafana file-provisioning provider (apiVersion 1) for the generated JSON."""
    return (
        "# Grafana dashboard provisioning for llm-diag: copy the *.json next to this file to the path below\n"
        "# (or change it), and put this file in Grafana's provisioning/dashboards/ directory.\n"
        "apiVersion: 1\n"
        "providers:\n"
        "  - name: llm-diag\n"
        f"    folder: {FOLDER}\n"
        f"    folderUid: {FOLDER}\n"
        "    type: file\n"
        "    disableDeletion: true\n"
        "    allowUiUpdates: false\n"
        "    updateIntervalSeconds: 60\n"
        "    options:\n"
        f"      path: {path_in_grafana}\n"
        "      foldersFromFilesStructure: false\n"
    )


def documents() -> dict[str, str]:
    """File name -> exact file text, for every generated file."""
    out: dict[str, str] = {}
    for d in all_dashboards():
        raw: dict[str, Any] = render(d)
        out[f"{d.uid}.json"] = json.dumps(raw, indent=2, sort_keys=True, allow_nan=False) + "\n"
    out[PROVISIONING_FILE] = provisioning()
    return out


def write(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in documents().items():
        path = out_dir / name
        path.write_text(text)
        written.append(path)
    return written


def stale(out_dir: Path) -> list[str]:
    """Names of files that are missing, differ, or should not be there (empty = up to date)."""
    docs = documents()
    problems = []
    for name, text in docs.items():
        path = out_dir / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif path.read_text() != text:
            problems.append(f"{name}: differs from what the generator produces")
    if out_dir.is_dir():
        for path in sorted(out_dir.iterdir()):
            if path.suffix in (".json", ".yaml") and path.name not in docs:
                problems.append(f"{path.name}: not produced by the generator")
    return problems
