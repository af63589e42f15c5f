"""Duplicate model copies without open files: large, similar private memory in sibling processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diag.demo.scenarios.recording import read_jsonl_gz
from diag.rules.base import Finding
from diag.rules.engine import analyze
from diag.rules.private_copies import duplicate_private_copies
from diag.timeline import timeline_from_records

T0 = 1_700_000_000.0
MIB = 1 << 20
GROUP = "/svc"
SCENARIOS = Path(__file__).resolve().parents[1] / "fixtures" / "scenarios"
TRACKER_KINDS = {"request", "batch", "routing", "loader", "config", "torch_memory", "cuda_oom"}


def _proc(ts: float, pid: int, ppid: int, uss: int, rss: int, cmd: str = "python worker.py") -> dict[str, Any]:
    return {"kind": "process", "ts": ts, "pid": pid, "ppid": ppid, "comm": "python", "cmdline": cmd,
            "start_time_s": pid, "rss_bytes": rss, "uss_bytes": uss, "memory_cgroup": GROUP}  # fmt: skip


def _records(workers: list[tuple[int, int, int]], seconds: int = 40, *, sequential: bool = False) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"kind": "watch_scope", "ts": T0, "cgroups": [GROUP], "resolved_cgroups": [GROUP]}]
    for i in range(seconds):
        ts = T0 + i
        out.append({"kind": "cgroup", "ts": ts, "path": GROUP, "usage_bytes": 900 * MIB, "limit_bytes": 2048 * MIB})
        out.append(_proc(ts, 10, 1, 30 * MIB, 50 * MIB, "python server.py"))
        for n, (pid, uss, rss) in enumerate(workers):
            if sequential and not (n * seconds // len(workers) <= i < (n + 1) * seconds // len(workers)):
                continue
            out.append(_proc(ts, pid, 10, uss + (i % 3) * MIB, rss))
    return out


def test_three_workers_with_private_copies_are_found_with_pids_and_bytes() -> None:
    tl = timeline_from_records(_records([(21, 300 * MIB, 330 * MIB), (22, 290 * MIB, 320 * MIB), (23, 305 * MIB, 335 * MIB)]))
    f = duplicate_private_copies(tl)
    assert isinstance(f, Finding) and f.confidence >= 0.6
    text = f.summary + " ".join(e.what for e in f.evidence)
    assert all(str(pid) in text for pid in (21, 22, 23))
    assert any(e.unit == "bytes" and isinstance(e.value, int) and e.value >= 290 * MIB for e in f.evidence)
    assert analyze(tl).primary == "duplicate_model_processes"


def test_forked_workers_sharing_one_copy_are_not_duplicates() -> None:
    """Preloaded in the parent, then forked: big RSS, small USS."""
    tl = timeline_from_records(_records([(21, 12 * MIB, 330 * MIB), (22, 11 * MIB, 320 * MIB), (23, 12 * MIB, 335 * MIB)]))
    assert duplicate_private_copies(tl) is None
    assert analyze(tl).primary == "healthy"


def test_dissimilar_or_small_siblings_are_not_duplicates() -> None:
    assert (
        duplicate_private_copies(timeline_from_records(_records([(21, 300 * MIB, 330 * MIB), (22, 90 * MIB, 120 * MIB)]))) is None
    )
    assert duplicate_private_copies(timeline_from_records(_records([(21, 20 * MIB, 30 * MIB), (22, 21 * MIB, 30 * MIB)]))) is None


def test_workers_restarted_one_after_another_are_not_copies_at_once() -> None:
    workers = [(21, 300 * MIB, 330 * MIB), (22, 300 * MIB, 330 * MIB), (23, 300 * MIB, 330 * MIB)]
    assert duplicate_private_copies(timeline_from_records(_records(workers, sequential=True))) is None


def test_loader_records_corroborate() -> None:
    recs = _records([(21, 300 * MIB, 330 * MIB), (22, 295 * MIB, 320 * MIB)])
    recs += [{"kind": "loader", "ts": T0 + 1, "start": T0, "duration_s": 1.0, "bytes_read": 280 * MIB, "pid": p,
              "in_request_path": False} for p in (21, 22)]  # fmt: skip
    f = duplicate_private_copies(timeline_from_records(recs))
    assert isinstance(f, Finding) and f.confidence >= 0.7
    assert any("loader" in e.what for e in f.evidence)


def test_recorded_duplicates_without_tracker_or_model_files() -> None:
    """The recorded duplicate-models run as an uninstrumented service that closed its checkpoint leaves it."""
    recs = []
    for r in read_jsonl_gz(SCENARIOS / "duplicate-models.jsonl.gz"):
        if r["kind"] in TRACKER_KINDS:
            continue
        if r["kind"] == "process":
            r = {**r, "model_files": []}
        recs.append(r)
    a = analyze(timeline_from_records(recs))
    assert a.primary == "duplicate_model_processes", [(f.rule, f.confidence) for f in a.findings]
    assert any(f.rule == "private_copies.duplicate_models" for f in a.findings)
