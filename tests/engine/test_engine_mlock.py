"""llama.cpp with ``use_mlock=true`` in a memory cgroup smaller than its model: the kernel OOM-kills it while it
locks the weights, diagnosed ``host_oom`` with why -- the group's memory was unevictable, pinned by use_mlock.

What really happens here (measured, kernel 6.x, cgroup v1): the server maps the GGUF and calls mlock on the
mapping; mlock faults every page in and charges it to the group, locked pages cannot be reclaimed, and when the
group is full the charge inside mlock invokes the memcg OOM killer -- the server is killed before it ever serves
(no "failed to mlock" warning: mlock does not fail, the process dies in it). The kernel's OOM report prints the
group's stats with the kill, ``unevictable`` among them; that and the server's own ``--use_mlock true`` are the
why. With ``use_mlock=false`` the same group thrashes instead (``test_engine_thrashing.py``): mapped file pages
are reclaimable, so the kernel evicts and re-reads them rather than kill.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from diag.demo.engine.client import completion
from diag.demo.engine.model import WrittenModel
from diag.demo.engine.pagecache import anon_bytes
from diag.demo.engine.server import EngineServer, EngineSettings
from diag.demo.scenarios.cgroups import ScenarioCgroups
from diag.demo.scenarios.context import evict_from_page_cache
from tests.engine.startup import finding, primaries, start_and_record
from tests.livecg import require_live

pytestmark = [pytest.mark.live, pytest.mark.process, pytest.mark.slow]
MIB = 1 << 20


def test_mlocked_weights_in_a_group_smaller_than_the_model_are_oom_killed(tmp_path: Path, engine_model: WrittenModel) -> None:
    require_live()
    made = ScenarioCgroups(prefix="llmdiag-engine")
    try:
        # What the server holds besides the model, measured on an unlocked server after a warm-up request (the
        # thrashing test's way), so that the limit leaves room for exactly half of the model beside it.
        probe = made.create("mlock-probe", 1024 * MIB)
        with EngineServer(EngineSettings(model=engine_model.path, n_ctx=256), tmp_path / "probe.log", group=probe) as server:
            with httpx.Client() as client:
                completion(client, server.url, "warm up", max_tokens=2)
            room = anon_bytes(probe)
        evict_from_page_cache(engine_model.path)  # the locked pages must be charged to the locked server's group
        group = made.create("mlock", room + engine_model.file_bytes // 2)
        settings = EngineSettings(model=engine_model.path, n_ctx=256, use_mmap=True, use_mlock=True)
        run = start_and_record(tmp_path, settings, group, "mlock")
    finally:
        made.close()
    assert not made.leftovers
    print(primaries(run), run.oom_kills, [(f.rule, round(f.confidence, 2), f.summary) for f in run.analysis.findings])
    assert not run.started and "exited with -9" in run.error, run.error  # killed while it loaded, never served
    assert run.oom_kills >= 1
    assert primaries(run) == ("host_oom",) * 3, (run.cli["findings"], run.bundle["findings"])
    oom = finding(run, "oom.host")
    assert oom.confidence >= 0.8
    evidence = {e.what: e.value for e in oom.evidence}
    unevictable = next(v for k, v in evidence.items() if "unevictable (mlock'd) memory at the kill" in k)
    assert unevictable >= engine_model.file_bytes // 4, evidence  # a large share of the model was locked at the kill
    assert any("use_mlock true" in str(v) for v in evidence.values()), evidence
    assert "unevictable" in oom.summary and "use_mlock" in oom.summary, oom.summary
    assert "turn mlock off" in oom.remediation[0]
    bundled = next(f for f in run.bundle["findings"] if f["rule"] == "oom.host")
    assert "use_mlock" in bundled["summary"], bundled["summary"]
