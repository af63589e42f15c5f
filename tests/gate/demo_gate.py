"""The reference backend as the gate tests run it: one paced slot, at a scheduler preference where root, in a memory
cgroup of its own where the host allows; and ``diag gate`` run against it as a command. Shared by the gate's test
modules (test modules never import each other)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from diag.demo.harness import DemoServer
from diag.demo.scenarios.cgroups import MemoryGroup, ScenarioCgroups, unavailable_reason
from tests.paths import REPO

# One slot, a backlog that waits (never 429), and each model step paced to at least 5 ms: the slot's service rate
# then has a ceiling no host exceeds, so the planned overload is one on an idle host as on a busy one. (Calibrating
# the rate from a few requests timed first failed when the host was busy during them and quiet during the peak.)
STEP_FLOOR_MS = 5
ONE_SLOT = ["--max-concurrency", "1", "--queue-size", "4096", "--queue-timeout", "120", "--min-step-ms", str(STEP_FLOOR_MS)]
Gated = tuple[subprocess.CompletedProcess[str], dict]  # the gate's process and its JSON
# Where we may (root), the server and the gate's load generator run at a scheduler preference over the rest of the
# suite: the example's peak is sized for the slot's speed, and on two cores shared with other tests' processes the
# slot's steps (the CPU's part above the floor) and the generator's schedule otherwise slip enough to fail its p99.
ROOT = os.geteuid() == 0
SERVER_NICE = -15 if ROOT else 0  # its one inference thread: nearly a core's worth whatever else runs
GATE_NICE = ["nice", "-n", "-10"] if ROOT else []
SERVICE_GROUP_LIMIT = 1 << 30  # far above the server's ~150 MiB: a boundary for its accounting, not a squeeze


@contextlib.contextmanager
def own_group() -> Iterator[MemoryGroup | None]:
    """A memory cgroup for the server alone where this host lets us make one, else None (the session's group)."""
    if unavailable_reason():
        yield None
        return
    groups = ScenarioCgroups(prefix="llmdiag-gate")
    try:
        yield groups.create("service", SERVICE_GROUP_LIMIT)
    finally:
        groups.close()
    assert not groups.leftovers, f"cgroups left behind: {groups.leftovers}"


def gate(spec: Path, srv: DemoServer, rec: Path, out: Path, group: MemoryGroup | None) -> Gated:
    argv = [*GATE_NICE, sys.executable, "-m", "diag.cli", "gate", "--spec", str(spec), "--target", srv.url]
    argv += ["--pid", str(srv.pid), "--recorder", str(rec), "--json", str(out)]
    argv += ["--cgroup", group.path] if group is not None else []  # its PSI and OOM kills, not the host's
    run = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    print(run.stdout, run.stderr)
    assert "Traceback" not in run.stderr
    return run, json.loads(out.read_text())
