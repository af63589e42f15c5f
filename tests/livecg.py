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
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from diag.demo.scenarios.cgroups import MAX_LIMIT_BYTES, ScenarioCgroups, own_v1_memory_cgroup, unavailable_reason
from diag.demo.scenarios.cgroups import MemoryGroup as LiveGroup

__all__ = ["LiveGroup", "holds_host", "host_exclusive", "memory_cgroup", "own_v1_memory_cgroup", "require_live", "skip_reason"]


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


# The folder every xdist worker of this run shares (tests/conftest.py sets it in a worker); None in a run without
# workers, where one process runs one test at a time and there is nobody to exclude.
host_lock_dir: Path | None = None
_held: list[int] = []  # the open lock files while held (a stack, so a nested host_exclusive is a no-op)


def holds_host() -> bool:
    """True inside a ``host_exclusive`` of this process (then another one is a no-op)."""
    return bool(_held)


@contextlib.contextmanager
def host_exclusive() -> Iterator[None]:
    """Have the host to ourselves: no test of the serial ``live`` group runs while this is held.

    Why: a live test judges this host -- its OOM kills, pressure, other cgroups' memory -- so a fault made
    beside it moves its verdict. ``make test`` runs the ``live`` group on one xdist worker, each of its tests
    inside this lock (tests/conftest.py); a test elsewhere that makes such a fault holds it for exactly as long
    as the fault can show (the dashboards' live stack: its load and its two OOM kills), and runs the rest of
    its time -- queries, waits -- beside the group. Host-wide it is the same order as running in the group.

    Fair, so neither side starves: a waiter first takes the *turnstile* and keeps it while it waits for the
    host, so the other side cannot take the host again between two of its tests before the waiter had its turn.
    Reentrant: inside a held ``host_exclusive`` (a live-group test using such a fixture), another is a no-op.
    """
    if host_lock_dir is None or _held:
        _held.append(-1)
        try:
            yield
        finally:
            _held.pop()
        return
    turnstile = os.open(host_lock_dir / "live-turnstile.lock", os.O_RDWR | os.O_CREAT, 0o600)
    host = os.open(host_lock_dir / "live-host.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(host, fcntl.LOCK_EX)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        _held.append(host)
        try:
            yield
        finally:
            _held.pop()
            fcntl.flock(host, fcntl.LOCK_UN)
    finally:
        os.close(host)
        os.close(turnstile)
