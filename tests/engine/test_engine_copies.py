"""Three llama.cpp servers on one model: private copies (``use_mmap=false``) are duplicates, one shared mmap is not.

Why both: with ``use_mmap=false`` llama.cpp reads the whole GGUF into each process's own memory, so three servers
hold the weights three times -- the duplicate copies the rules must name, with each worker's PID. With the default
mmap the three map the same file, and its pages sit in the page cache once: counting that shared cache per process
would call a healthy deployment three copies. Nothing is instrumented; the agent watches the group and the servers.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

from collectors.records import WatchScope
from diag.demo.engine.model import WrittenModel
from diag.demo.engine.server import EngineServer, EngineSettings
from diag.demo.scenarios.cgroups import ScenarioCgroups
from diag.demo.scenarios.recording import AgentThread, scenario_records
from diag.rules.engine import analyze
from diag.timeline import timeline_from_records
from tests.livecg import require_live
from tests.procs import poll_until

pytestmark = [pytest.mark.live, pytest.mark.process, pytest.mark.slow]
MIB = 1 << 20
SERVERS = 3
SAMPLES = 8


def _three_servers(tmp_path: Path, model: WrittenModel, *, use_mmap: bool, name: str) -> tuple[object, list[int], str]:
    """Start three servers in one group, record them with the agent, and return the analysis, their PIDs and group."""
    require_live()
    recorder = tmp_path / f"{name}.db"
    made = ScenarioCgroups(prefix="llmdiag-engine")
    try:
        group = made.create(name, 1024 * MIB)
        settings = EngineSettings(model=model.path, n_ctx=256, n_threads=1, use_mmap=use_mmap)
        with contextlib.ExitStack() as stack:
            logs = [tmp_path / f"{name}-{i}.log" for i in range(SERVERS)]
            servers = [stack.enter_context(EngineServer(settings, log, group=group)) for log in logs]
            pids = [s.pid for s in servers]
            t0 = time.time()
            agent = AgentThread(recorder, cgroups=[group.path], pids=pids, interval_s=1.0, kmsg=False).start()
            try:
                assert poll_until(lambda: agent.samples >= SAMPLES, 60.0)
            finally:
                agent.stop()
        scope = WatchScope(ts=t0, pids=pids, cgroups=[group.path], resolved_pids=pids, resolved_cgroups=[group.path])
        timeline = timeline_from_records([*scenario_records(recorder, [group.path], pids), scope.to_dict()])
    finally:
        made.close()
    assert not made.leftovers
    analysis = analyze(timeline)
    print(name, analysis.primary, [(f.rule, round(f.confidence, 2), f.summary) for f in analysis.findings])
    return analysis, pids, group.path


def test_three_servers_with_private_copies_are_duplicates_named_by_pid(tmp_path: Path, engine_model: WrittenModel) -> None:
    analysis, pids, _ = _three_servers(tmp_path, engine_model, use_mmap=False, name="private")
    assert analysis.primary == "duplicate_model_processes", analysis.to_dict()["findings"]
    finding = next(f for f in analysis.findings if f.cls == "duplicate_model_processes")
    named = " ".join(f"{e.what} {e.value}" for e in finding.evidence)
    assert all(str(p) in named for p in pids), named


def test_three_servers_sharing_one_mmap_are_not_duplicates(tmp_path: Path, engine_model: WrittenModel) -> None:
    analysis, _, _ = _three_servers(tmp_path, engine_model, use_mmap=True, name="shared")
    assert "private_copies.duplicate_models" in analysis.evaluated  # judged on the same evidence, not skipped
    assert not any(f.cls == "duplicate_model_processes" and f.confidence >= 0.3 for f in analysis.findings), analysis.to_dict()[
        "findings"
    ]
