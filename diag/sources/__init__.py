"""Where records come from, each turned into the same Timeline the rules read.

    flight recorder (SQLite, one host) --- recorder.load_recorder ---\
    incident bundle (timeline/*.jsonl) --- bundle.load_bundle -------+--> diag.timeline.Timeline --> diag.rules.engine.analyze
    Prometheus (query_range, the fleet) -- prometheus.load_prometheus /
    a whole fleet in one pass ------------ fleet.load_fleet: one share per target, each assembled as above

Sources only read and reshape; they never judge.
"""

from typing import Any

from diag.sources.bundle import load_bundle
from diag.sources.recorder import load_recorder

__all__ = ["load_bundle", "load_prometheus", "load_recorder"]


def __getattr__(name: str) -> Any:
    """``load_prometheus`` on first use: its HTTP client costs every other command an import they do not need."""
    if name == "load_prometheus":
        from diag.sources.prometheus import load_prometheus

        return load_prometheus
    raise AttributeError(name)
