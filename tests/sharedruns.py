"""Live runs that more than one test module checks, made once per session.

A ``diag demo --scenario`` run takes about a minute of real load on real cgroups. The scenario suite
(tests/scenarios) asserts each run's cleanup, signature and verdict; the triage suite feeds the leak
run's flight recorder to a receiver behind a real Alertmanager pair. Both can check the *same* runs,
so they are made once (the session fixture ``leak_scenario`` in tests/conftest.py, started lazily by
whichever test asks first) instead of twice.

Likewise the scenarios an engine's /metrics can show: one run serves the tracker *and* the three engines'
dialects (``runner.run_scenario_in_dialects`` with ``llmdiag`` first), the scenario suite judges it as the
instrumented service and the dialect suite as each engine (``joint_runs``) -- one minute where there were two.
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


ENGINES = ("vllm", "tgi", "llamacpp")


@dataclass(frozen=True)
class ScenarioRun:
    """One real scenario run and what it left: the analysed result, its recorder and its records."""

    name: str
    attempt: int
    result: Any  # diag.demo.scenarios.runner.ScenarioResult (of the scenario's own view, for a joint run)
    recorder: Path | None  # the run's flight recorder (``keep_recorder``), as ``diag demo --keep-recorder`` keeps it
    export: Path  # its records as a replay fixture (``fixture``)
    started: float  # time.time() just before the run
    finished: float  # time.time() when the run (cleanup and analysis included) returned
    views: dict[str, Any] = field(default_factory=dict)  # a joint run's result per dialect (``SharedScenario.views``)


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
    # A joint run's dialects, the scenario's own first (its ``result``): ``llmdiag`` and the engines', or the engines'
    # alone for a scenario whose own is an engine's (kv-saturation's vLLM). () = a run of the scenario alone.
    views: tuple[str, ...] = ()

    def attempt(self, n: int) -> ScenarioRun:
        """Attempt ``n`` (1-based), run now if no module asked for it before."""
        from diag.demo.scenarios.runner import run_scenario, run_scenario_in_dialects

        while len(self.runs) < n:
            k = len(self.runs) + 1
            folder = self.folder / f"attempt-{k}"
            folder.mkdir(parents=True, exist_ok=True)
            recorder, export = folder / "recorder.db", folder / f"{self.name}.jsonl.gz"
            started, t0 = time.time(), time.monotonic()
            progress = lambda m, t0=t0: print(f"[{time.monotonic() - t0:5.1f}] {m}")  # noqa: E731
            if self.views:
                views = run_scenario_in_dialects(self.name, self.views, weights_dir=self.weights_dir, fixture=export,
                                                 progress=progress)  # fmt: skip
                run = ScenarioRun(self.name, k, views[self.views[0]], None, export, started, time.time(), views)
            else:
                result = run_scenario(self.name, weights_dir=self.weights_dir, keep_recorder=recorder, fixture=export,
                                      progress=progress)  # fmt: skip
                run = ScenarioRun(self.name, k, result, recorder, export, started, time.time())
            self.runs.append(run)
        return self.runs[n - 1]

    def reproduced(self) -> ScenarioRun:
        """The first attempt that reproduced the incident (making more, up to ``ATTEMPTS``), else the last one."""
        for n in range(1, ATTEMPTS + 1):
            run = self.attempt(n)
            if not verdict_problems(self.name, run.result):
                break
        return run


def joint_views(name: str) -> tuple[str, ...]:
    """The dialects scenario ``name`` is judged in from one joint run (its own first), or () when it runs alone.

    Joint: a scenario an engine's /metrics can show (it speaks the dialects, and its class is not read from the
    tracker's records only), one worker (an engine's /metrics is one process's state), and no other module needing
    its flight recorder whole (the leak run's recorder goes to the triage suite as a service's recorder). The leak
    run was tried joint (its instrumented view kept as the triage suite's recorder): in a whole-suite run under load
    its engines' views were judged healthy in 4 of 6 judgements over two attempts (the instrumented view found the
    leak both times), where its own runs had found it every time -- left on its own until that is understood.
    """
    from diag.demo.scenarios.library import SCENARIOS

    scenario = SCENARIOS[name]
    defaults = scenario.params(None)
    if name in TRACKER_ONLY or not scenario.speaks_dialects or int(defaults.get("workers", 1)) != 1 or name == "leak":
        return ()
    own = str(defaults.get("dialect", "llmdiag"))
    return (own, *(d for d in ("llmdiag", *ENGINES) if d != own and (d != "llmdiag" or own == "llmdiag")))


# The classes read from the tracker's records only: no engine's /metrics can show them (the dialect suite says why).
TRACKER_ONLY = {
    "loader-refresh": "loader events",
    "moe-skew": "MoE routing records",
    "request-count-batching": "batch records",
    "oversized-context": "per-request prompt sizes",
    "unsafe-config": "the configuration record",
    "duplicate-models": "several workers (an engine's dialect runs one)",
}
