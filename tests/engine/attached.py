"""One engine run with llm-diag attached, as the engine tests share it: the server in its own memory group, the
agent watching that group and the server, a load, and the Timeline the rules read.

Two attachments: ``outside`` (nothing in the server; the request rows are the load generator's) and ``wrapped``
(the server under ``diag wrap``; its own rows, written to the agent's recorder, are the request rows).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from collectors.records import RequestTiming, WatchScope
from diag.demo.engine.model import WrittenModel
from diag.demo.engine.server import EngineServer, EngineSettings
from diag.demo.scenarios.cgroups import ScenarioCgroups
from diag.demo.scenarios.recording import AgentThread, scenario_records
from diag.timeline import Timeline, timeline_from_records
from tests.procs import poll_until

MIB = 1 << 20
ATTACHMENTS = ("outside", "wrapped")


@dataclass
class EngineRun:
    rows: list[RequestTiming]  # what the load generator saw
    timeline: Timeline
    recorder: Path
    pid: int
    oom_kills: int


def run_attached(
    tmp_path: Path, model: WrittenModel, name: str, attachment: str, load: Callable[[str, int], list[RequestTiming]],
    *, kmsg: bool = False,
) -> EngineRun:  # fmt: skip
    """Start the engine in a 1 GiB group (wrapped or not), record it while ``load(url, pid)`` runs, and stop it."""
    wrapped = attachment == "wrapped"
    recorder = tmp_path / "agent.db"
    made = ScenarioCgroups(prefix="llmdiag-engine")
    try:
        group = made.create(name, 1024 * MIB)
        settings = EngineSettings(model=model.path, n_ctx=256, n_threads=1)
        with EngineServer(settings, tmp_path / "server.log", group=group, wrap_recorder=recorder if wrapped else None) as server:
            agent = AgentThread(recorder, cgroups=[group.path], pids=[server.pid], interval_s=1.0, kmsg=kmsg).start()
            try:
                t0 = time.time()
                rows = load(server.url, server.pid)
                seen = agent.samples
                assert poll_until(lambda: agent.samples >= seen + 2, 15.0)  # the agent's samples cover the last request
            finally:
                agent.stop()
            pid, kills = server.pid, group.oom_kills()
        records = [] if wrapped else [r.to_dict() for r in rows]  # wrapped: the server's own rows are in the recorder
        scope = WatchScope(ts=t0, pids=[pid], cgroups=[group.path], resolved_pids=[pid], resolved_cgroups=[group.path])
        timeline = timeline_from_records([*scenario_records(recorder, [group.path], [pid]), scope.to_dict(), *records])
    finally:
        made.close()
    assert not made.leftovers
    return EngineRun(rows, timeline, recorder, pid, kills)
