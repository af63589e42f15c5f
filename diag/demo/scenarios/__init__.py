"""``diag demo --scenario NAME``: every incident class reproduced for real on the reference backend.

Each scenario starts ``diag demo serve`` inside a real, limited memory cgroup, records it with the
host agent, injects its fault for real (a leak that leaks, page-cache thrash under a limit, four
private model copies, a neighbour thrashing its own group, an OOM kill ...), drives bounded HTTP load
on 127.0.0.1, cleans everything up by PID, and analyses the recorded window with the rules engine.

Modules: ``cgroups`` (the groups and their cleanup), ``load`` (the load driver), ``recording``
(the agent thread, scoping and fixture export), ``hog`` (the neighbour process), ``context`` (what a
scenario function gets), ``registry`` (what a scenario is), ``library``, ``config_scenarios`` and ``engine_scenarios``
(one function per scenario), ``replays`` (the recorded-only cases), ``runner`` (``run_scenario``).
"""

from __future__ import annotations

SCENARIO_NAMES: tuple[str, ...] = (
    "healthy",
    "leak",
    "pressure",
    "queue",
    "thrash",
    "duplicate-models",
    "loader-refresh",
    "moe-skew",
    "request-count-batching",
    "oversized-context",
    "noisy-neighbour",
    "host-oom",
    "unsafe-config",
    "kv-saturation",
)
# The same incidents on llama.cpp (``engine_scenarios``): the ``engines`` extra, run by ``bench/accuracy.py --engine``
# and the live tests in tests/engine/, apart from the reference backend's (their fixtures and suite).
ENGINE_SCENARIO_NAMES: tuple[str, ...] = (
    "engine-healthy",
    "engine-queue",
    "engine-thrash",
    "engine-mlock",
    "engine-copies",
    "engine-fourth-copy",
    "engine-n-ctx",
)

EXIT_NO_CGROUPS = 3  # the scenario needs memory cgroups this host cannot give


def run_scenario(*args, **kwargs):  # type: ignore[no-untyped-def]
    """See ``diag.demo.scenarios.runner.run_scenario`` (imported lazily: numpy and the rules are heavy)."""
    from diag.demo.scenarios.runner import run_scenario as run

    return run(*args, **kwargs)
