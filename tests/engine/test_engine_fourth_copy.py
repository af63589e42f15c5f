"""A fourth private copy of a llama.cpp model runs a group sized for three into a memcg OOM: ``host_oom``, with the
copies named (their PIDs and private bytes) and the victim one of them.

Why: with ``use_mmap=false`` every server reads the whole GGUF into its own memory, so each new replica in the
group costs a full copy; the group's limit (measured from the three running copies, see
``diag/demo/engine/copies.py``) leaves the fourth server room for its interpreter and half its weights. The
kernel then kills the largest process in the group -- one of the copies -- and the rules must say both what
happened (the OOM kill) and why (the copies), on the recorded Timeline, through ``diag analyze`` and in the
bundle. Runs the ``engine-fourth-copy`` scenario (``diag demo --scenario``), the same code the accuracy bench
runs; nothing in the servers is instrumented.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diag.demo.engine.model import WrittenModel
from diag.demo.scenarios.runner import run_scenario
from tests.engine.startup import _diag
from tests.livecg import require_live

pytestmark = [pytest.mark.live, pytest.mark.process, pytest.mark.slow]


def _dupes(findings: list[dict]) -> dict:
    return next(f for f in findings if f["class"] == "duplicate_model_processes")


def test_a_fourth_private_copy_is_oom_killed_and_the_copies_named(tmp_path: Path, engine_model: WrittenModel) -> None:
    require_live()
    recorder = tmp_path / "fourth.db"
    result = run_scenario("engine-fourth-copy", weights_dir=engine_model.path.parent, keep_recorder=recorder,
                          progress=lambda m: None)  # fmt: skip
    notes, analysis = result.notes, result.analysis
    assert not result.cleanup["leftover_groups"] and not result.cleanup["server_pids_alive"], result.cleanup
    assert notes["oom_kills"] >= 1, notes  # the kernel's own tally: a memcg OOM kill, not a crash
    copies = notes["copies"]
    (group,) = result.cleanup["groups"]
    cli = json.loads(_diag("analyze", "--recorder", str(recorder), "--since", "10m", "--json").stdout)
    out = tmp_path / "bundle"
    _diag("bundle", "--recorder", str(recorder), "--cgroup", group, "--since", "10m", "--out", str(out), "--no-tar",
          "--deadline", "60s")  # fmt: skip
    (folder,) = [p for p in out.iterdir() if p.is_dir()]
    bundle = json.loads((folder / "findings.json").read_text())
    print(notes, [(f.rule, round(f.confidence, 2), f.summary) for f in analysis.findings])
    for verdict in (analysis.to_dict()["verdict"], cli["verdict"], bundle["verdict"]):
        assert verdict["primary"] == "host_oom", verdict
        assert "duplicate_model_processes" in verdict["contributing"], verdict  # the why, named beside the kill
    oom = next(f for f in analysis.findings if f.rule == "oom.host")
    victim = next(e.value for e in oom.evidence if e.what == "victim")
    assert any(f"(pid {pid})" in victim for pid in [*copies, notes["fourth"]]), (victim, copies)
    assert group in oom.summary  # the group that hit its own limit, not the host
    for findings in (analysis.to_dict()["findings"], cli["findings"], bundle["findings"]):
        dupes = _dupes(findings)
        private = {e["what"]: e["value"] for e in dupes["evidence"] if "private memory" in e["what"]}
        assert len(private) >= 3, dupes["evidence"]
        assert sum(any(str(pid) in what for pid in copies) for what in private) >= 2, (private, copies)
        assert all(v >= engine_model.file_bytes * 0.9 for v in private.values()), private  # a whole model each
