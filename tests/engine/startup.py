"""One llama.cpp server started in a limited memory group and recorded from its first moment, as the tests of
servers killed while they load share it: the agent, the Timeline, ``diag analyze`` and ``diag bundle`` on it.

Why from the first moment: a server OOM-killed while it loads lives about a second; an agent started once the
server is ready would never see it. The agent is started from ``EngineServer.start``'s spawn hook, watching the
group and the new PID, sampling every quarter second, reading the kernel's OOM lines -- and it has sampled before
the server's own code runs (the hook holds the process at a gate until it returns).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collectors.records import WatchScope
from diag.demo.engine.server import EngineServer, EngineSettings, EngineStartError
from diag.demo.scenarios.cgroups import MemoryGroup
from diag.demo.scenarios.recording import AgentThread, scenario_records
from diag.rules.engine import Analysis, analyze
from diag.timeline import Timeline, timeline_from_records
from tests.procs import poll_until

ROOT = Path(__file__).resolve().parents[2]
INTERVAL_S = 0.25
CLI_TIMEOUT_S = 120.0


@dataclass
class StartupRun:
    started: bool  # the server became ready (False: it died while loading; ``error`` says how)
    error: str
    pid: int
    oom_kills: int  # the group's own oom_kill tally
    timeline: Timeline
    recorder: Path
    analysis: Analysis
    cli: dict[str, Any] = field(default_factory=dict)  # ``diag analyze --recorder --json``
    bundle: dict[str, Any] = field(default_factory=dict)  # the bundle's findings.json


def _diag(*args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "diag.cli", *args], capture_output=True, text=True, cwd=str(ROOT),
                          timeout=CLI_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, f"diag {args[0]} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def start_and_record(tmp_path: Path, settings: EngineSettings, group: MemoryGroup, name: str) -> StartupRun:
    """Start the server in ``group`` with the agent watching it from its spawn, stop it, and diagnose the window
    three ways: the rules on the recorded Timeline, ``diag analyze`` on the recorder, ``diag bundle`` on the group."""
    recorder = tmp_path / f"{name}.db"
    agents: list[AgentThread] = []

    def watch(pid: int) -> None:
        """Runs while the server is held at its gate: the agent has sampled the PID before the server starts."""
        agent = AgentThread(recorder, cgroups=[group.path], pids=[pid], interval_s=INTERVAL_S, kmsg=True).start()
        agents.append(agent)
        assert poll_until(lambda: agent.samples >= 2, 15.0)

    t0 = time.time()
    server = EngineServer(settings, tmp_path / f"{name}.log", group=group)
    started, error = True, ""
    try:
        server.start(on_spawn=watch)
    except EngineStartError as exc:
        started, error = False, str(exc)
    try:
        assert agents, "the spawn hook did not run"
        agent = agents[0]
        seen = agent.samples
        assert poll_until(lambda: agent.samples >= seen + 4, 15.0)  # a second more: the kernel's lines are read
    finally:
        for agent in agents:
            agent.stop()
        pid = server.pid
        server.stop()
    kills = group.oom_kills()
    scope = WatchScope(ts=t0, pids=[pid], cgroups=[group.path], resolved_pids=[pid], resolved_cgroups=[group.path])
    timeline = timeline_from_records([*scenario_records(recorder, [group.path], [pid]), scope.to_dict()])
    run = StartupRun(started, error, pid, kills, timeline, recorder, analyze(timeline))
    run.cli = json.loads(_diag("analyze", "--recorder", str(recorder), "--since", "10m", "--json").stdout)
    out = tmp_path / f"{name}-bundle"
    _diag("bundle", "--recorder", str(recorder), "--cgroup", group.path, "--since", "10m", "--out", str(out), "--no-tar",
          "--deadline", "60s")  # fmt: skip
    (folder,) = [p for p in out.iterdir() if p.is_dir()]
    run.bundle = json.loads((folder / "findings.json").read_text())
    return run


def finding(run: StartupRun, rule: str) -> Any:
    """The rules' finding by rule id on the recorded Timeline, or None."""
    return next((f for f in run.analysis.findings if f.rule == rule), None)


def primaries(run: StartupRun) -> tuple[str, str, str]:
    """The verdict three ways: the Timeline's analysis, ``diag analyze`` and the bundle's ``findings.json``."""
    return run.analysis.primary, run.cli["verdict"]["primary"], run.bundle["verdict"]["primary"]
