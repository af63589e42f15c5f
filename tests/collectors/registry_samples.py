"""Reading values back out of a prometheus_client registry, for the tracking tests.

Why a module: several tracking test files check exported counters the same way; they import this
instead of importing each other.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry


def sample_value(registry: CollectorRegistry, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of every sample called ``name`` whose labels include ``labels``."""
    total = 0.0
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                total += sample.value
    return total
