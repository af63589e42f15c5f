"""The recorded-only incident classes (no GPU here): their replay fixtures, replayed through the rules.

``gpu-oom`` and ``allocator-fragmentation`` are built by ``diag.demo.scenarios.replays`` from a real
recording of the reference backend plus NVML samples, torch allocator summaries and CUDA OOM messages
in their real shapes (the OOM text goes through the product's own parser). The tests check that the
committed fixtures are exactly what the builder makes, and that each replays to its own class --
and not to the other one, since telling "full" from "fragmented" is the point.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diag.demo.scenarios.replays import GPU_KINDS, REPLAYS, read_fixture, rebuild
from diag.rules.engine import analyze
from diag.timeline import timeline_from_records
from tests.paths import FIXTURES

SCENARIO_FIXTURES = FIXTURES / "scenarios"


def _fixture(name: str) -> Path:
    path = SCENARIO_FIXTURES / f"{name}.jsonl.gz"
    assert path.exists(), f"missing {path}: python -m diag.demo.scenarios.replays {SCENARIO_FIXTURES}"
    return path


@pytest.mark.parametrize("name", sorted(REPLAYS))
def test_the_committed_replay_is_what_the_builder_makes(name: str) -> None:
    path = _fixture(name)
    assert rebuild(path) == path.read_bytes(), f"{path.name} differs from its builder: regenerate it"


@pytest.mark.parametrize("name", sorted(REPLAYS))
def test_replay_carries_real_host_records_and_every_gpu_record_kind(name: str) -> None:
    records = read_fixture(_fixture(name))
    kinds = {r["kind"] for r in records}
    assert {"host", "cgroup", "process", "request", "config"} <= kinds  # the real base recording
    assert kinds >= GPU_KINDS
    gpu = [r for r in records if r["kind"] == "gpu"]
    assert all(g["available"] and g["devices"][0]["used_bytes"] + g["devices"][0]["free_bytes"] == g["devices"][0]["total_bytes"]
               for g in gpu)  # fmt: skip
    ooms = [r for r in records if r["kind"] == "cuda_oom"]
    assert ooms and all(o["tried_to_allocate_bytes"] and o["reserved_unallocated_bytes"] is not None for o in ooms)


@pytest.mark.parametrize("name", sorted(REPLAYS))
def test_replay_gets_its_class_and_not_the_other(name: str) -> None:
    replay = REPLAYS[name]
    analysis = analyze(timeline_from_records(read_fixture(_fixture(name)), source=f"replay:{name}"))
    verdict = "\n".join(f"{f.cls} {f.confidence:.2f} [{f.rule}] {f.summary}" for f in analysis.findings)
    assert analysis.primary == replay.expected, verdict
    others = {r.expected for r in REPLAYS.values()} - {replay.expected}
    assert not others & set(analysis.contributing), verdict


def test_fragmentation_is_told_from_a_full_card_by_the_slack_alone() -> None:
    """Same base, same request sizes' order of magnitude: the slack vs request arithmetic decides."""
    frag = [r for r in read_fixture(_fixture("allocator-fragmentation")) if r["kind"] == "cuda_oom"]
    full = [r for r in read_fixture(_fixture("gpu-oom")) if r["kind"] == "cuda_oom"]
    assert all(o["reserved_unallocated_bytes"] >= o["tried_to_allocate_bytes"] for o in frag)
    assert all(o["reserved_unallocated_bytes"] < o["tried_to_allocate_bytes"] for o in full)
