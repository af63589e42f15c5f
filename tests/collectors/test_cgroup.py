"""CgroupSampler on constructed v1, v2 and hybrid trees (tests/fixtures/cgroup/README.md says how they
were built) -> exact expected records; plus resolution, mount discovery and path-safety edge cases.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from collectors.cgroup import (
    CgroupSampler,
    clean_cgroup_path,
    discover_mounts,
    map_v1_stat,
    parse_proc_cgroup,
)
from collectors.records import CgroupSnapshot, Psi, PsiLine, record_from_json

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "cgroup"
V2, V1, HYBRID = FIXTURES / "v2", FIXTURES / "v1", FIXTURES / "hybrid"

MiB = 1 << 20


def sampler(tree: Path, **kwargs: object) -> CgroupSampler:
    return CgroupSampler(str(tree / "proc"), str(tree / "sys"), **kwargs)  # type: ignore[arg-type]


def only(snaps: list[CgroupSnapshot]) -> CgroupSnapshot:
    assert len(snaps) == 1, [s.path for s in snaps]
    return snaps[0]


def flat(text: str) -> dict[str, int]:
    """Independent oracle for well-formed ``key value`` text."""
    return {k: int(v) for k, v in (line.split() for line in text.splitlines() if line.strip())}


@pytest.fixture
def tree(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A writable copy of a fixture tree."""

    def copy(src: Path) -> Path:
        dst = tmp_path / src.name
        shutil.copytree(src, dst)
        return dst

    return copy


# --------------------------------------------------------------------------- v2


def test_v2_service_group_by_pids_is_one_exact_record() -> None:
    svc = V2 / "sys/fs/cgroup/system.slice/llm.service"
    snaps = sampler(V2, pids=[4242, 4243]).sample(now=42.0)  # two processes, one group
    events = {"low": 0, "high": 12, "max": 35, "oom": 1, "oom_kill": 1, "oom_group_kill": 0, "sock_throttled": 0}
    stat = flat((svc / "memory.stat").read_text())
    expected = CgroupSnapshot(
        ts=42.0,
        path="/system.slice/llm.service",
        version="v2",
        usage_bytes=7516192768,
        working_set_bytes=7516192768 - 5307346944,
        peak_bytes=8589934592,
        limit_bytes=10 << 30,
        high_bytes=9 << 30,
        low_bytes=0,
        min_bytes=0,
        swap_bytes=0,
        events=events,
        events_local=events,
        stat=stat,
        under_oom=None,
        pressure=Psi(some=PsiLine(1.0, 2.0, 3.0, 100000), full=PsiLine(0.5, 1.0, 1.5, 50000)),
        missing={},
    )
    assert only(snaps) == expected
    assert len(stat) == 40 and stat["inactive_file"] == 5307346944 and stat["pgmajfault"] == 6879


def test_v2_max_limits_are_none_and_old_kernel_files_are_missing() -> None:
    snap = only(sampler(V2, pids=[5151]).sample())
    assert snap.path == "/user.slice/tiny.scope" and snap.version == "v2"
    assert snap.limit_bytes is None and snap.high_bytes is None  # literal "max" = unlimited
    assert "limit_bytes" not in snap.missing and "high_bytes" not in snap.missing
    assert (snap.low_bytes, snap.min_bytes) == (0, 0)
    assert snap.usage_bytes == 4194304
    assert snap.working_set_bytes == 0  # usage below inactive_file: clamped, as cAdvisor does
    assert snap.events == {"low": 0, "high": 0, "max": 0, "oom": 0, "oom_kill": 0}  # no oom_group_kill before 5.17
    assert snap.peak_bytes is None and "No such file" in snap.missing["peak_bytes"]  # memory.peak is 5.19+
    assert snap.swap_bytes is None and "memory.swap.current" in snap.missing["swap_bytes"]
    assert set(snap.missing) == {"peak_bytes", "swap_bytes"}


def test_v2_root_reports_what_is_there_and_lists_the_rest() -> None:
    snap = only(sampler(V2, cgroups=["/"]).sample())
    assert snap.version == "v2" and snap.path == "/"
    assert snap.stat["anon"] == 790425600
    assert snap.pressure is not None and snap.pressure.some is not None and snap.pressure.some.total_us == 987654321
    assert snap.usage_bytes is None and snap.limit_bytes is None and snap.events == {}
    assert snap.missing["usage_bytes"] == "the root cgroup has no memory.current"
    assert set(snap.missing) == {
        "usage_bytes", "peak_bytes", "swap_bytes", "limit_bytes", "high_bytes", "low_bytes", "min_bytes",
        "events", "events_local", "working_set_bytes",
    }  # fmt: skip


def test_v2_event_keys_are_read_by_key_and_unknown_ones_survive(tree) -> None:  # type: ignore[no-untyped-def]
    root = tree(V2)
    events = root / "sys/fs/cgroup/system.slice/llm.service/memory.events"
    # A future kernel adds a key in the middle and reorders: nothing is positional.
    events.write_text("oom_kill 4\nlow 1\nfuture_event 7\nhigh 2\nmax 3\noom 5\noom_group_kill 6\nsock_throttled 8\n")
    snap = only(sampler(root, pids=[4242]).sample())
    assert snap.events == {
        "oom_kill": 4, "low": 1, "future_event": 7, "high": 2, "max": 3, "oom": 5, "oom_group_kill": 6, "sock_throttled": 8,
    }  # fmt: skip
    assert snap.events_local["max"] == 35  # the local file is read separately


# --------------------------------------------------------------------------- v1


V1_BOX_STAT = {
    "file": 41943040 + 4096,  # total_cache, not the local cache: hierarchical keys win
    "anon": 104857600,
    "anon_thp": 0,
    "shmem": 1048576,
    "file_mapped": 8388608,
    "file_dirty": 45056,
    "file_writeback": 4096,
    "workingset_refault_anon": 12,
    "workingset_refault_file": 3456,
    "swapcached": 8192,
    "pgpgin": 61000,
    "pgpgout": 22000,
    "pgfault": 250000,
    "pgmajfault": 321,
    "inactive_anon": 100663296,
    "active_anon": 4194304,
    "inactive_file": 33554432,
    "active_file": 8388608,
    "unevictable": 0,
}


def test_v1_group_maps_onto_v2_names_exactly() -> None:
    snaps = sampler(V1, pids=[777, 778]).sample(now=7.0)
    expected = CgroupSnapshot(
        ts=7.0,
        path="/docker/0123abcd",
        version="v1",
        usage_bytes=150 * MiB,
        working_set_bytes=150 * MiB - 33554432,
        peak_bytes=256 * MiB,
        limit_bytes=256 * MiB,
        swap_bytes=2 * MiB,  # total_swap
        events={"max": 17, "oom_kill": 2},  # failcnt, oom_control oom_kill
        stat=V1_BOX_STAT,
        under_oom=True,
        pressure=None,
        missing={"pressure": "no cgroup2 hierarchy mounted (v1 has no per-group PSI)"},
    )
    assert only(snaps) == expected


def test_v1_unlimited_and_pre_4_13_group() -> None:
    snap = only(sampler(V1, cgroups=["/docker/unlimited/"]).sample())  # trailing slash normalised
    assert snap.path == "/docker/unlimited"
    assert snap.limit_bytes is None and "limit_bytes" not in snap.missing  # page-counter max = unlimited
    assert snap.events == {"max": 0}
    assert snap.missing["events.oom_kill"] == "memory.oom_control has no oom_kill (kernel < 4.13)"
    assert snap.under_oom is False
    assert snap.swap_bytes is None and snap.missing["swap_bytes"] == "memory.stat has no swap (swap accounting off)"
    assert "swap" not in snap.stat and "hierarchical_memory_limit" not in snap.stat
    assert snap.working_set_bytes == 0


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        ("9223372036854771712", None),  # PAGE_COUNTER_MAX * 4 KiB
        ("9223372036854710272", None),  # the same with 64 KiB pages
        (str(1 << 60), None),
        (str((1 << 60) - 4096), (1 << 60) - 4096),
        ("157286400", 157286400),
    ],
)
def test_v1_limit_threshold(tree, written: str, expected: int | None) -> None:  # type: ignore[no-untyped-def]
    root = tree(V1)
    (root / "sys/fs/cgroup/memory/docker/0123abcd/memory.limit_in_bytes").write_text(written + "\n")
    snap = only(sampler(root, pids=[777]).sample())
    assert snap.limit_bytes == expected
    assert "limit_bytes" not in snap.missing


def test_map_v1_stat_falls_back_to_local_keys() -> None:
    stat, swap = map_v1_stat({"rss": 10, "cache": 20, "mapped_file": 5, "swap": 3, "inactive_file": 7, "pgpgin": 1})
    assert stat == {"anon": 10, "file": 20, "file_mapped": 5, "inactive_file": 7, "pgpgin": 1}
    assert swap == 3
    stat, swap = map_v1_stat({"rss": 10, "total_rss": 11, "total_shmem": 2})
    assert stat == {"anon": 11, "shmem": 2} and swap is None


# --------------------------------------------------------------------------- hybrid


def test_hybrid_by_pid_reads_v1_memory_and_the_v2_twins_pressure() -> None:
    snap = only(sampler(HYBRID, pids=[4242]).sample(now=3.0))
    assert snap == CgroupSnapshot(
        ts=3.0,
        path="/process_api/abc/svc",
        version="hybrid",
        usage_bytes=144 * MiB,
        working_set_bytes=144 * MiB - 33554432,
        peak_bytes=150 * MiB,
        limit_bytes=150 * MiB,
        swap_bytes=2 * MiB,
        events={"max": 5821, "oom_kill": 1},
        stat=V1_BOX_STAT,
        under_oom=False,
        pressure=Psi(some=PsiLine(4.52, 1.20, 0.31, 2210543), full=PsiLine(4.10, 1.05, 0.27, 1987321)),
        missing={},
    )


def test_hybrid_by_path_finds_the_twin_through_the_groups_processes() -> None:
    by_path = only(sampler(HYBRID, cgroups=["/process_api/abc/svc"]).sample(now=3.0))
    by_pid = only(sampler(HYBRID, pids=[4242]).sample(now=3.0))
    assert by_path == by_pid  # the twin (/svc-twin) is not at the same path; cgroup.procs leads to it
    both = sampler(HYBRID, pids=[4242], cgroups=["/process_api/abc/svc"]).sample(now=3.0)
    assert len(both) == 1  # a named group and a pid inside it are one group


def test_hybrid_group_without_process_or_twin_lists_pressure_missing() -> None:
    snap = only(sampler(HYBRID, cgroups=["/process_api/abc/empty"]).sample())
    assert snap.version == "hybrid" and snap.limit_bytes == 100 * MiB
    assert snap.pressure is None
    assert "twin" in snap.missing["pressure"]
    assert set(snap.missing) == {"pressure"}


def test_hybrid_root_group() -> None:
    snap = only(sampler(HYBRID, pids=[1]).sample())
    assert snap.path == "/" and snap.version == "hybrid"
    assert snap.usage_bytes == 2 << 30 and snap.limit_bytes is None
    assert snap.pressure is not None and snap.pressure.full is not None and snap.pressure.full.total_us == 460
    assert snap.missing == {}


# --------------------------------------------------------------------------- resolution


def test_pids_are_resolved_again_on_every_sample(tree) -> None:  # type: ignore[no-untyped-def]
    root = tree(V2)
    s = sampler(root, pids=[4242])
    assert only(s.sample()).path == "/system.slice/llm.service"
    # The service restarted into another group.
    (root / "proc/4242/cgroup").write_text("0::/user.slice/tiny.scope\n")
    assert only(s.sample()).path == "/user.slice/tiny.scope"
    shutil.rmtree(root / "proc/4242")  # ... and then exited
    assert s.sample() == []
    assert "No such file" in s.unresolved[4242]


def test_unresolvable_pids_give_no_record_and_a_reason(tree) -> None:  # type: ignore[no-untyped-def]
    root = tree(V1)
    (root / "proc/900").mkdir()
    (root / "proc/900/cgroup").write_text("11:cpu,cpuacct:/x\n1:name=systemd:/x\n")  # no memory controller
    s = sampler(root, pids=[900, 31337])
    assert s.sample() == []
    assert s.unresolved[900] == "no memory cgroup in /proc/900/cgroup"
    assert "No such file" in s.unresolved[31337]


def test_pid_in_a_removed_group_is_reported_not_found() -> None:
    snap = only(sampler(V2, pids=[1]).sample())  # 0::/init.scope, which the tree does not have
    assert snap.path == "/init.scope" and snap.version == "none"
    assert "does not exist" in snap.missing["group"]
    assert set(snap.missing) == {"group"}


@pytest.mark.parametrize("path", ["../../etc", "/a/../../../etc", "relative/path", "", "/x\x00y"])
def test_paths_that_could_escape_the_hierarchy_are_refused(path: str) -> None:
    snap = only(sampler(V1, cgroups=[path]).sample())
    assert snap.version == "none"
    assert snap.missing == {"group": "not an absolute cgroup path"}


def test_unknown_explicit_group() -> None:
    snap = only(sampler(V1, cgroups=["/docker/nope"]).sample())
    assert snap.version == "none" and snap.missing["group"].startswith("not found under ")


def test_no_hierarchies_at_all(tmp_path: Path) -> None:
    s = CgroupSampler(str(tmp_path), str(tmp_path), pids=[1], cgroups=["/x"])
    snap = only(s.sample())
    assert snap.missing["group"].startswith("no cgroup hierarchy under")
    assert 1 in s.unresolved


def test_mount_discovery(tmp_path: Path) -> None:
    assert discover_mounts(str(V2 / "sys")) == discover_mounts(str(V2 / "sys"))
    m = discover_mounts(str(V2 / "sys"))
    assert m.v2 == V2 / "sys/fs/cgroup" and m.v1_memory is None
    m = discover_mounts(str(V1 / "sys"))
    assert m.v1_memory == V1 / "sys/fs/cgroup/memory" and m.v2 is None
    m = discover_mounts(str(HYBRID / "sys"))
    assert m.v1_memory == HYBRID / "sys/fs/cgroup/memory" and m.v2 == HYBRID / "sys/fs/cgroup/unified"
    # On a unified host a child cgroup named "memory" is a v2 group, not a v1 mount.
    unified = tmp_path / "fs/cgroup"
    (unified / "memory").mkdir(parents=True)
    (unified / "cgroup.controllers").write_text("memory\n")
    (unified / "memory" / "memory.current").write_text("1\n")
    m = discover_mounts(str(tmp_path))
    assert m.v1_memory is None and m.v2 == unified


def test_parse_proc_cgroup() -> None:
    text = (HYBRID / "proc/4242/cgroup").read_text()
    m = parse_proc_cgroup(text)
    assert (m.v1_memory, m.v2) == ("/process_api/abc/svc", "/svc-twin")
    m = parse_proc_cgroup("5:cpu,memory:/co/mounted\n0::/gone (deleted)\n")
    assert (m.v1_memory, m.v2) == ("/co/mounted", "/gone")
    assert parse_proc_cgroup("").v1_memory is None
    assert parse_proc_cgroup("0::relative\n").v2 is None
    m = parse_proc_cgroup("4:memory:/with:colon\n")
    assert m.v1_memory == "/with:colon"


def test_clean_cgroup_path() -> None:
    assert clean_cgroup_path("/a//b/") == "/a/b"
    assert clean_cgroup_path("/") == "/"
    assert clean_cgroup_path("/a/./b") is None
    assert clean_cgroup_path("a") is None


def test_records_serialise() -> None:
    for tree_root, kwargs in ((V1, {"pids": [777]}), (V2, {"pids": [4242, 5151]}), (HYBRID, {"pids": [4242, 1]})):
        for snap in sampler(tree_root, **kwargs).sample():
            assert record_from_json(snap.to_json()) == snap


def test_procs_in_reads_every_pid_of_a_group_and_nothing_of_a_group_gone(tmp_path):
    from collectors.cgroup import procs_in

    group = tmp_path / "llmdiag-x"
    group.mkdir()
    pids = list(range(100_000, 100_000 + 3000))  # more than any small read cap would hold
    (group / "cgroup.procs").write_text("".join(f"{pid}\n" for pid in pids))
    assert procs_in(group) == pids
    (group / "cgroup.procs").write_text("")
    assert procs_in(group) == []
    assert procs_in(tmp_path / "removed") == []  # a group removed meanwhile: nothing left to act on
