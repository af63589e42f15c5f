"""Build a Timeline from where the records are: the flight recorder or a bundle directory.

(The Prometheus HTTP API loader lives in ``diag/prometheus_loader.py``: the fleet-scale path.)
Loaders only read and reshape; they never judge.
"""

from __future__ import annotations

import time
from pathlib import Path

from collectors.recorder import FlightRecorder
from diag.timeline import Timeline, TimelineBuilder


def load_recorder(path: str | Path, since_s: float | None = None, until: float | None = None) -> Timeline:
    """Records of the last ``since_s`` seconds (all when None) from a flight recorder file (opened read-only)."""
    since = None if since_s is None else (until or time.time()) - since_s
    builder = TimelineBuilder(source=f"recorder:{path}")
    with FlightRecorder(path, readonly=True) as recorder:
        for _ts, kind, body in recorder.rows(since=since, until=until):
            builder.add_json(body, kind)
    return builder.build()


def load_bundle(path: str | Path) -> Timeline:
    """Records from a bundle's ``timeline/*.jsonl`` (one JSON record per line; a bad line is counted, not fatal)."""
    root = Path(path)
    folder = root / "timeline"
    if not folder.is_dir():
        raise FileNotFoundError(f"{root} is not an llm-diag bundle (no timeline/ folder)")
    builder = TimelineBuilder(source=f"bundle:{root}")
    for file in sorted(folder.glob("*.jsonl")):
        with file.open(encoding="utf-8", errors="replace") as fh:
            for line in fh:
                line = line.strip()
                if line:
                    builder.add_json(line, file.stem)
    return builder.build()
