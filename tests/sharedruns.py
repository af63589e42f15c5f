"""Live runs that more than one test module checks, made once per session.

A ``diag demo --scenario`` run takes about a minute of real load on real cgroups. The scenario suite
(tests/scenarios) asserts each run's cleanup, signature and verdict; the triage suite feeds the leak
run's flight recorder to a receiver behind a real Alertmanager pair. Both can check the *same* runs,
so they are made once (the session fixture ``leak_scenario`` in tests/conftest.py, started lazily by
whichever test asks first) instead of twice.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# A scenario's verdict gets one second attempt: these runs share a 2-core host with whatever else runs
# there, and a neighbour's burst can legitimately change what a 45-60 s recording shows.
ATTEMPTS = int(os.environ.get("LLMDIAG_SCENARIO_ATTEMPTS", "2"))


@dataclass(frozen=True)
class ScenarioRun:
    """One real scenario run and what it left: the analysed result, its recorder and its records."""

    name: str
    attempt: int
    result: Any  # diag.demo.scenarios.runner.ScenarioResult
    recorder: Path  # the run's flight recorder (``keep_recorder``), as ``diag demo --keep-recorder`` keeps it
    export: Path  # its records as a replay fixture (``fixture``)
    started: float  # time.time() just before the run
    finished: float  # time.time() when the run (cleanup and analysis included) returned


def verdict_problems(name: str, result: Any) -> list[str]:
    """What is wrong with a run's signature or verdict ([] when it reproduced its incident)."""
    from diag.demo.scenarios.library import SCENARIOS

    problems = [f"the fault did not leave its signature: {p}" for p in result.signal_problems]
    if name == "healthy":
        strong = [f"{f.cls} {f.confidence:.2f}" for f in result.analysis.findings if f.confidence >= 0.5]
        if strong:
            problems.append(f"healthy run with strong findings: {strong}")
    if result.primary != SCENARIOS[name].expected:
        problems.append(f"primary {result.primary}, expected {SCENARIOS[name].expected}")
    return problems


@dataclass
class SharedScenario:
    """The attempts at one scenario, made on demand and kept, so every module that asks sees the same runs."""

    name: str
    weights_dir: Path
    folder: Path
    runs: list[ScenarioRun] = field(default_factory=list)

    def attempt(self, n: int) -> ScenarioRun:
        """Attempt ``n`` (1-based), run now if no module asked for it before."""
        from diag.demo.scenarios.runner import run_scenario

        while len(self.runs) < n:
            k = len(self.runs) + 1
            folder = self.folder / f"attempt-{k}"
            folder.mkdir(parents=True, exist_ok=True)
            recorder, export = folder / "recorder.db", folder / f"{self.name}.jsonl.gz"
            started, t0 = time.time(), time.monotonic()
            result = run_scenario(
                self.name, weights_dir=self.weights_dir, keep_recorder=recorder, fixture=export,
                progress=lambda m, t0=t0: print(f"[{time.monotonic() - t0:5.1f}] {m}"),
            )  # fmt: skip
            self.runs.append(ScenarioRun(self.name, k, result, recorder, export, started, time.time()))
        return self.runs[n - 1]

    def reproduced(self) -> ScenarioRun:
        """The first attempt that reproduced the incident (making more, up to ``ATTEMPTS``), else the last one."""
        for n in range(1, ATTEMPTS + 1):
            run = self.attempt(n)
            if not verdict_problems(self.name, run.result):
                break
        return run
