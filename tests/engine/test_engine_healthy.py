"""llama.cpp under steady load it can serve, on both attachments: no incident.

Why: every class the rules name on the engine is worth only as much as their silence when nothing is wrong. One
client at a time keeps the model busy (closed loop: the next request as the last ends) without a queue, in a group
with room for the model and its buffers; neither the client's rows nor the server's own (``diag wrap``) may read as
an incident.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from collectors.records import WatchScope
from diag.demo.engine.client import drive_until
from diag.demo.engine.model import WrittenModel
from diag.demo.engine.server import EngineServer, EngineSettings
from diag.demo.scenarios.cgroups import ScenarioCgroups
from diag.demo.scenarios.recording import AgentThread, scenario_records
from diag.rules.classes import HEALTHY
from diag.rules.engine import analyze
from diag.timeline import timeline_from_records
from tests.livecg import require_live
from tests.procs import poll_until

pytestmark = [pytest.mark.live, pytest.mark.process, pytest.mark.slow]
MIB = 1 << 20
LOAD_S, TOKENS = 32.0, 16  # the leak rule judges no less than 30 s of memory samples


@pytest.mark.parametrize("attachment", ["outside", "wrapped"])
def test_steady_load_the_engine_serves_is_no_incident(tmp_path: Path, engine_model: WrittenModel, attachment: str) -> None:
    require_live()
    wrapped = attachment == "wrapped"
    recorder = tmp_path / "agent.db"
    made = ScenarioCgroups(prefix="llmdiag-engine")
    try:
        group = made.create("healthy", 1024 * MIB)
        settings = EngineSettings(model=engine_model.path, n_ctx=256, n_threads=1)
        with EngineServer(settings, tmp_path / "server.log", group=group, wrap_recorder=recorder if wrapped else None) as server:
            agent = AgentThread(recorder, cgroups=[group.path], pids=[server.pid], interval_s=1.0, kmsg=True).start()
            try:
                t0 = time.time()
                rows = drive_until(server.url, LOAD_S, concurrency=1, max_tokens=TOKENS, pid=server.pid)
                seen = agent.samples
                assert poll_until(lambda: agent.samples >= seen + 2, 15.0)
            finally:
                agent.stop()
            pid = server.pid
            kills = group.oom_kills()
        records = [] if wrapped else [r.to_dict() for r in rows]
        scope = WatchScope(ts=t0, pids=[pid], cgroups=[group.path], resolved_pids=[pid], resolved_cgroups=[group.path])
        timeline = timeline_from_records([*scenario_records(recorder, [group.path], [pid]), scope.to_dict(), *records])
    finally:
        made.close()
    assert not made.leftovers
    assert kills == 0 and len(rows) >= 10 and all(r.outcome == "ok" for r in rows)
    analysis = analyze(timeline)
    print(
        attachment,
        analysis.primary,
        analysis.too_little_data,
        [(f.rule, round(f.confidence, 2), f.summary) for f in analysis.findings],
    )
    assert analysis.primary == HEALTHY, (analysis.to_dict()["findings"], analysis.too_little_data)
