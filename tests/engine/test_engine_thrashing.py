"""llama.cpp's mmap'd weights in a memory cgroup too small for them: page-cache thrashing, diagnosed ``thrashing``.

Why: with ``use_mmap=true`` and ``use_mlock=false`` the engine computes from the mapped file, so each
token reads every weight page; when the group's limit leaves room for only part of the model, the
kernel reclaims the pages of one layer to fault in the next -- slow tokens, major faults, memory
stalls, and no OOM kill (file pages can always be dropped). Nothing in the server is instrumented: the
agent watches its group and process, and the request rows are the load generator's.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from collectors.records import WatchScope
from diag.demo.engine.client import completion, drive_until
from diag.demo.engine.model import WrittenModel
from diag.demo.engine.pagecache import anon_bytes, set_limit
from diag.demo.engine.server import EngineServer, EngineSettings
from diag.demo.scenarios.cgroups import ScenarioCgroups
from diag.demo.scenarios.context import evict_from_page_cache
from diag.demo.scenarios.recording import AgentThread, scenario_records
from diag.rules.engine import analyze
from diag.timeline import timeline_from_records
from tests.livecg import require_live
from tests.procs import poll_until

pytestmark = [pytest.mark.live, pytest.mark.process, pytest.mark.slow]
MIB = 1 << 20
LOAD_S, CONCURRENCY, TOKENS = 20.0, 2, 8


def test_mmapd_weights_in_a_group_smaller_than_the_model_thrash(tmp_path: Path, engine_model: WrittenModel) -> None:
    require_live()
    recorder = tmp_path / "agent.db"
    evict_from_page_cache(engine_model.path)  # its pages must be charged to the engine's group, not to their writer's
    made = ScenarioCgroups(prefix="llmdiag-engine")
    try:
        group = made.create("thrash", 1024 * MIB)
        settings = EngineSettings(model=engine_model.path, n_ctx=256, n_threads=1, use_mmap=True, use_mlock=False)
        with EngineServer(settings, tmp_path / "server.log", group=group) as server:
            with httpx.Client() as client:
                completion(client, server.url, "warm up", max_tokens=2)  # llama.cpp's buffers are all allocated now
            room = engine_model.file_bytes // 2
            set_limit(group, anon_bytes(group) + room)  # what the server holds besides the file, and half the model
            agent = AgentThread(recorder, cgroups=[group.path], pids=[server.pid], interval_s=1.0, kmsg=True).start()
            try:
                t0 = time.time()
                rows = drive_until(server.url, LOAD_S, concurrency=CONCURRENCY, max_tokens=TOKENS, pid=server.pid)
                seen = agent.samples
                assert poll_until(lambda: agent.samples >= seen + 2, 15.0)
            finally:
                agent.stop()
            pid = server.pid
            alive = server.proc is not None and server.proc.poll() is None
            faults, kills = group.stat(), group.oom_kills()
        records = [r.to_dict() for r in rows]
        scope = WatchScope(ts=t0, pids=[pid], cgroups=[group.path], resolved_pids=[pid], resolved_cgroups=[group.path])
        timeline = timeline_from_records([*scenario_records(recorder, [group.path], [pid]), scope.to_dict(), *records])
    finally:
        made.close()
    assert not made.leftovers
    assert alive and kills == 0, (faults, kills)  # thrashing, not an OOM kill
    assert rows and all(r.outcome == "ok" for r in rows)
    analysis = analyze(timeline)
    print(
        analysis.primary,
        len(rows),
        faults.get("pgmajfault"),
        [(f.rule, round(f.confidence, 2), f.summary) for f in analysis.findings],
    )
    assert analysis.primary == "thrashing", (analysis.to_dict()["findings"], {k: faults.get(k) for k in ("pgmajfault", "rss")})
