"""Real memory cgroups for live tests, made by the product's own cgroup manager.

Why no test-only twin: ``diag demo --scenario`` already creates limited v1 memory groups (plus a
cgroup2 twin for per-group PSI on hybrid hosts like CI here), joins processes before exec, kills
everything in them by PID and removes them (``diag/demo/scenarios/cgroups.py``). Live tests use the
same code, so the safety rules are written -- and tested -- once: every group is a child of *our
own* memory cgroup, always has a limit, and is removed on exit after every process in it has been
killed by PID, never by name. A test that cannot run here gets a skip with the exact reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from diag.demo.scenarios.cgroups import MAX_LIMIT_BYTES, ScenarioCgroups, own_v1_memory_cgroup, unavailable_reason
from diag.demo.scenarios.cgroups import MemoryGroup as LiveGroup

__all__ = ["LiveGroup", "memory_cgroup", "own_v1_memory_cgroup", "require_live", "skip_reason"]


def skip_reason() -> str | None:
    """Why live cgroup tests cannot run here, or None when they can."""
    return unavailable_reason()


# The test being set up or run (set by tests/conftest.py), so the live tier can check its mark.
current_test: Any = None


def require_live() -> None:
    """Skip with the reason where live tests cannot run; fail a test that needs them but is not marked live."""
    item = current_test
    if item is not None and item.get_closest_marker("live") is None:
        pytest.fail(f"{item.nodeid} needs root and real cgroups but is not marked @pytest.mark.live", pytrace=False)
    reason = skip_reason()
    if reason:
        pytest.skip(reason)


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int, name: str = "llmdiag-test") -> Iterator[LiveGroup]:
    """Create a limited child of our own memory cgroup (and its v2 twin), yield it, remove both.

    On exit every process in the group -- ours and any it started -- is killed by PID, then the
    directories are removed; a group that could not be removed fails the test rather than leaking.
    """
    require_live()
    if not 0 < limit_bytes <= MAX_LIMIT_BYTES:
        raise ValueError(f"live test groups need a limit between 1 byte and {MAX_LIMIT_BYTES >> 30} GiB")
    groups = ScenarioCgroups(prefix=name)
    try:
        yield groups.create("live", limit_bytes)
    finally:
        groups.close()
    assert not groups.leftovers, f"live test cgroups left behind: {groups.leftovers}"
