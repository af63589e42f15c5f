"""ProcessSampler: the procfs fixture, synthetic proc trees (selection, caching, garbage) and real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collectors.processes import (
    PF_KTHREAD,
    ProcessSampler,
    model_process_counts,
    parse_memory_cgroup,
    parse_stat,
    split_cmdline,
)
from collectors.records import record_from_json
from tests.collectors.proc_builders import make_proc
from tests.collectors.proc_builders import maps_line as _maps_line
from tests.collectors.proc_builders import rollup as _rollup
from tests.collectors.proc_builders import stat_line as _stat_line
from tests.paths import EXTERNAL

FIXTURE_PROC = EXTERNAL / "procfs" / "proc"
PAGE = os.sysconf("SC_PAGE_SIZE")
TCK = os.sysconf("SC_CLK_TCK")
KIB = 1024
OPTIONAL_FIELDS = (
    "ppid",
    "start_time_s",
    "rss_bytes",
    "pss_bytes",
    "uss_bytes",
    "swap_bytes",
    "major_faults",
    "minor_faults",
    "num_threads",
    "memory_cgroup",
)


# --------------------------------------------------------------------------- the upstream fixture


def test_procfs_fixture_parses_to_its_known_values() -> None:
    # Values read by hand from procfs/proc/26231/{stat,smaps_rollup,cmdline}:
    # stat "26231 (vim) R 5392 ... 32533 309516 26 82 ... 1 0 82375 56274944 1981 ..."
    samples = ProcessSampler(FIXTURE_PROC).sample(now=1234.5)
    assert len(samples) == 1
    (s,) = samples
    assert s.ts == 1234.5
    assert (s.pid, s.ppid, s.comm) == (26231, 5392, "vim")
    assert s.cmdline == "vim test.go +10 EOF"
    assert s.start_time_s == pytest.approx(82375 / TCK)
    assert s.rss_bytes == 1981 * PAGE  # stat field 24: the same counter as VmRSS
    assert s.pss_bytes == 29944 * KIB
    assert s.uss_bytes == (15548 + 14396) * KIB  # Private_Clean + Private_Dirty
    assert s.swap_bytes == 1940 * KIB  # smaps_rollup Swap (status VmSwap is only the fallback)
    assert (s.major_faults, s.minor_faults, s.num_threads) == (26, 32533, 1)
    # The fixture has no cgroup, maps or fd: reported as missing, not as zero.
    assert s.memory_cgroup is None
    assert "No such file" in s.missing["memory_cgroup"]
    assert s.model_files == []
    assert "model_files" in s.missing
    assert record_from_json(s.to_json()) == s  # the recorder's JSON round trip keeps every field


# --------------------------------------------------------------------------- pure parsers


def test_parse_stat_splits_after_the_last_paren() -> None:
    stat = parse_stat("42 (a) b (c)) S 7 42 42 0 -1 4194560 100 0 3 0 1 1 0 0 20 0 5 0 999 1000 77 18446744073709551615")
    assert stat is not None
    assert stat.comm == "a) b (c)"
    assert (stat.ppid, stat.minflt, stat.majflt, stat.threads, stat.start_ticks, stat.rss_pages) == (7, 100, 3, 5, 999, 77)
    assert stat.missing == {}


def test_parse_stat_truncated_and_garbled() -> None:
    assert parse_stat("42 no parens at all") is None
    stat = parse_stat("42 (x) S 7 1 1 0 -1 0 +5 0 ٣ 0")
    assert stat is not None
    assert stat.ppid == 7
    assert stat.minflt is None and "minor_faults" in stat.missing  # "+5" is not what the kernel prints
    assert stat.majflt is None and "major_faults" in stat.missing  # nor are non-ASCII digits
    assert stat.rss_pages is None and "rss_bytes" in stat.missing


def test_parse_memory_cgroup_prefers_the_v1_memory_line() -> None:
    hybrid = "12:cpu,cpuacct:/x\n4:memory:/process_api/abc\n0::/\n"
    assert parse_memory_cgroup(hybrid) == "/process_api/abc"
    assert parse_memory_cgroup("0::/system.slice/svc.service\n") == "/system.slice/svc.service"
    assert parse_memory_cgroup("3:blkio:/a\n") is None
    assert parse_memory_cgroup("garbage\n::\n") is None


def test_split_cmdline() -> None:
    assert split_cmdline(b"python\0-m\0x\0") == ["python", "-m", "x"]
    assert split_cmdline(b"python\0-m\0partial", truncated=True) == ["python", "-m"]
    assert split_cmdline(b"") == []


# --------------------------------------------------------------------------- synthetic proc trees


def test_top_n_plus_model_holders_plus_watched(tmp_path: Path) -> None:
    for pid in range(100, 115):
        make_proc(tmp_path, pid, rss_pages=pid * 10)
    make_proc(tmp_path, 50, rss_pages=1, maps=_maps_line("/models/llama.gguf") + _maps_line("/usr/lib/libc.so.6"))
    make_proc(tmp_path, 51, rss_pages=2, fd_targets=("/models/llama.gguf", "socket:[123]", "/tmp/x.txt"))
    make_proc(tmp_path, 52, rss_pages=3)
    make_proc(tmp_path, 2, comm="kthreadd", rss_pages=0, flags=PF_KTHREAD, cmdline=b"")
    (tmp_path / "self").mkdir()  # non-numeric entries are ignored

    samples = ProcessSampler(tmp_path, top_n=3, watch_pids=[52, 2, 99999]).sample(now=10.0)
    pids = [s.pid for s in samples]
    assert pids[:3] == [114, 113, 112]  # largest RSS first
    assert set(pids) == {114, 113, 112, 50, 51, 52, 2}
    by_pid = {s.pid: s for s in samples}
    assert by_pid[50].model_files == ["/models/llama.gguf"]
    assert by_pid[51].model_files == ["/models/llama.gguf"]
    assert by_pid[52].model_files == []
    assert by_pid[114].memory_cgroup == "/svc"
    assert by_pid[114].cmdline == "proc --port 8000"
    assert model_process_counts(samples) == {"/models/llama.gguf": 2}


def test_kernel_threads_are_skipped_unless_watched(tmp_path: Path) -> None:
    make_proc(tmp_path, 2, comm="kthreadd", rss_pages=10**6, flags=PF_KTHREAD, cmdline=b"")
    make_proc(tmp_path, 10, rss_pages=5)
    assert [s.pid for s in ProcessSampler(tmp_path).sample()] == [10]


def test_model_extensions_and_extra_paths(tmp_path: Path) -> None:
    maps = "".join(
        _maps_line(p)
        for p in (
            "/m/a.SafeTensors",  # extensions match case-insensitively
            "/m/b.pt (deleted)",  # still mapped after deletion: still resident
            "/m/c.ptx",  # not .pt
            "/usr/lib/x.bin.so",  # .bin in the middle is not a model
            "/registry/blob-123",  # only under an extra path
            "/registryx/blob",  # a sibling with the same prefix is not under it
            "[heap]",
        )
    )
    make_proc(tmp_path, 10, maps=maps)
    sampler = ProcessSampler(tmp_path, extra_model_paths=["/registry"])
    (s,) = sampler.sample()
    assert s.model_files == ["/m/a.SafeTensors", "/m/b.pt", "/registry/blob-123"]


def test_model_discovery_is_cached_and_rescanned(tmp_path: Path) -> None:
    d = make_proc(tmp_path, 10, rss_pages=100)
    sampler = ProcessSampler(tmp_path, model_rescan_s=5.0, rss_jump_bytes=1 << 20, rss_jump_ratio=0.5)
    assert sampler.sample(now=100.0)[0].model_files == []

    (d / "maps").write_text(_maps_line("/m/model.safetensors"))
    # Inside the rescan interval the cached answer stands ...
    assert sampler.sample(now=100.001)[0].model_files == []
    # ... and after at most model_rescan_s seconds the new mapping is reported.
    assert sampler.sample(now=105.0)[0].model_files == ["/m/model.safetensors"]

    # A large RSS jump triggers a rescan at once.
    (d / "maps").write_text("")
    assert sampler.sample(now=105.5)[0].model_files == ["/m/model.safetensors"]
    (d / "stat").write_text(_stat_line(10, rss_pages=100 + (64 << 20) // PAGE))
    assert sampler.sample(now=105.6)[0].model_files == []

    # A reused PID (different start time) is a new process: scanned at once.
    (d / "maps").write_text(_maps_line("/m/other.gguf"))
    (d / "stat").write_text(_stat_line(10, start=2000, rss_pages=100 + (64 << 20) // PAGE))
    assert sampler.sample(now=105.7)[0].model_files == ["/m/other.gguf"]


def test_smaps_rollup_is_reread_on_its_interval_or_an_rss_jump(tmp_path: Path) -> None:
    d = make_proc(tmp_path, 10, rss_pages=100)
    sampler = ProcessSampler(tmp_path, smaps_interval_s=5.0, rss_jump_bytes=1 << 20, rss_jump_ratio=0.5)
    assert sampler.sample(now=100.0)[0].pss_bytes == 50 * 1024
    (d / "smaps_rollup").write_text(_rollup(pss_kb=80))
    assert sampler.sample(now=101.0)[0].pss_bytes == 50 * 1024  # cached: the read is the costly part
    assert sampler.sample(now=105.0)[0].pss_bytes == 80 * 1024  # interval elapsed
    (d / "smaps_rollup").write_text(_rollup(pss_kb=90))
    (d / "stat").write_text(_stat_line(10, rss_pages=100 + (64 << 20) // PAGE))
    assert sampler.sample(now=105.1)[0].pss_bytes == 90 * 1024  # RSS jumped: re-read at once


def test_an_mmap_growing_the_address_space_triggers_a_rescan(tmp_path: Path) -> None:
    d = make_proc(tmp_path, 10)
    sampler = ProcessSampler(tmp_path, model_rescan_s=60.0)
    assert sampler.sample(now=0.0)[0].model_files == []
    (d / "maps").write_text(_maps_line("/m/big.gguf"))
    assert sampler.sample(now=0.001)[0].model_files == []  # nothing says anything changed yet
    (d / "stat").write_text(_stat_line(10, vsize=(1 << 30) + (4 << 30)))  # a 4 GiB file was mapped
    assert sampler.sample(now=0.002)[0].model_files == ["/m/big.gguf"]


def test_vanished_and_unreadable_processes(tmp_path: Path) -> None:
    make_proc(tmp_path, 10)
    d = make_proc(tmp_path, 11)
    (d / "stat").unlink()  # stat unreadable: the process is skipped (no identity, no RSS)
    e = make_proc(tmp_path, 12)
    (e / "smaps_rollup").unlink()
    (e / "status").write_text("Name:\tx\nVmRSS:\t  400 kB\nVmSwap:\t   12 kB\n")
    samples = {s.pid: s for s in ProcessSampler(tmp_path).sample()}
    assert set(samples) == {10, 12}
    s = samples[12]
    assert s.pss_bytes is None and "pss_bytes" in s.missing
    assert s.uss_bytes is None and "uss_bytes" in s.missing
    assert s.swap_bytes == 12 * KIB  # world-readable status stands in for the swap figure


def test_secret_in_cmdline_is_redacted(tmp_path: Path) -> None:
    make_proc(tmp_path, 10, cmdline=b"vllm\0serve\0--api-key\0CANARY-abc123\0--port\08000\0")
    (s,) = ProcessSampler(tmp_path).sample()
    assert s.cmdline == "vllm serve --api-key <redacted> --port 8000"


def test_missing_proc_root_gives_an_empty_sample(tmp_path: Path) -> None:
    sampler = ProcessSampler(tmp_path / "nope")
    assert sampler.sample() == []
    assert sampler.last_error is not None and "No such file" in sampler.last_error


# --------------------------------------------------------------------------- garbage never raises

_VALID = {
    "stat": _stat_line(10, "py thon (x)").encode(),
    "status": b"Name:\tx\nVmRSS:\t  400 kB\nVmSwap:\t   12 kB\n",
    "smaps_rollup": _rollup(pss_kb=77, swap_kb=5).encode(),
    "cgroup": b"4:memory:/svc/a\n0::/\n",
    "cmdline": b"python\0-m\0server\0",
    "maps": _maps_line("/m/w.safetensors").encode(),
}


def _variant(name: str) -> st.SearchStrategy[tuple[str, bytes]]:
    valid = _VALID[name]
    return st.one_of(
        st.just(("valid", valid)),
        st.binary(max_size=600).map(lambda b: ("random", b)),
        st.integers(0, len(valid)).map(lambda n: ("truncated", valid[:n])),
        st.just(("empty", b"")),
        st.sampled_from([b"\0" * 300_000, b"9" * 300_000, (b"Pss: 1 kB\n(" * 20_000)]).map(lambda b: ("huge", b)),
        st.just(("absent", b"")),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(files=st.fixed_dictionaries({name: _variant(name) for name in _VALID}))
def test_garbage_in_any_file_never_raises(files: dict[str, tuple[str, bytes]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "10"
        d.mkdir()
        for name, (kind, data) in files.items():
            if kind != "absent":
                (d / name).write_bytes(data)
        samples = ProcessSampler(tmp, watch_pids=[10]).sample(now=1.0)

    stat_kind = files["stat"][0]
    if stat_kind == "valid":
        assert len(samples) == 1
    if not samples:
        # Documented: a process is skipped only when its stat is unreadable or has no "(comm)" framing.
        assert stat_kind != "valid"
        return
    (s,) = samples
    record_from_json(s.to_json())  # always serialisable
    for name in OPTIONAL_FIELDS:
        assert (getattr(s, name) is None) == (name in s.missing), name
    if files["smaps_rollup"][0] == "valid":
        assert (s.pss_bytes, s.uss_bytes, s.swap_bytes) == (77 * KIB, 50 * KIB, 5 * KIB)
    if files["cgroup"][0] == "valid":
        assert s.memory_cgroup == "/svc/a"
    if files["cmdline"][0] == "valid":
        assert s.cmdline == "python -m server"
    if files["maps"][0] == "valid":
        assert s.model_files == ["/m/w.safetensors"]
    if stat_kind == "valid":
        assert (s.comm, s.major_faults, s.minor_faults, s.rss_bytes) == ("py thon (x)", 2, 11, 100 * PAGE)


# --------------------------------------------------------------------------- real processes


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "--api-key", "CANARY-live-987", "--port", "8000"]
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@pytest.mark.process
def test_real_watched_process(sleeper: subprocess.Popen[bytes]) -> None:
    sampler = ProcessSampler(top_n=0, watch_pids=[sleeper.pid, os.getpid()])
    deadline = time.monotonic() + 5
    while True:  # the child may not have exec'd python yet
        samples = {s.pid: s for s in sampler.sample()}
        child = samples.get(sleeper.pid)
        if child is not None and "--api-key" in child.cmdline:
            break
        assert time.monotonic() < deadline, samples
        time.sleep(0.05)
    assert "CANARY-live-987" not in child.cmdline
    assert child.cmdline.endswith("--api-key <redacted> --port 8000")
    assert child.ppid == os.getpid()
    me = samples[os.getpid()]
    assert me.rss_bytes and me.rss_bytes > 1 << 20
    expected_cgroup = parse_memory_cgroup(Path("/proc/self/cgroup").read_text())
    assert me.memory_cgroup == expected_cgroup
    if os.access("/proc/self/smaps_rollup", os.R_OK):
        assert me.pss_bytes and me.uss_bytes and me.uss_bytes <= me.pss_bytes <= me.rss_bytes * 2
    assert me.start_time_s is not None and me.start_time_s > 0


def test_real_sample_is_top_n_by_rss() -> None:
    samples = ProcessSampler(top_n=5).sample()
    rss = [s.rss_bytes or 0 for s in samples]
    assert rss == sorted(rss, reverse=True)
    # Everything beyond the top 5 is there because it holds a model file.
    assert 0 < len([s for s in samples if not s.model_files]) <= 5
