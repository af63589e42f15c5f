"""Property tests: no input -- truncated, garbled (random bytes, invalid UTF-8, NULs), empty or huge --
makes a parser or a sampler raise, and whatever could not be read is None/absent *and* listed in
``missing`` (never a silent zero, never a value without its reason).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collectors import procfs
from collectors.cgroup import CgroupSampler, clean_cgroup_path, map_v1_stat, parse_proc_cgroup
from collectors.host import HostSampler, parse_zoneinfo
from collectors.records import CgroupSnapshot, Psi
from tests.paths import EXTERNAL

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "cgroup"
NODE_PROC = EXTERNAL / "node_exporter" / "proc"

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Text that looks like kernel files, so mutations land near real parses rather than far from them.
KERNEL_LINES = [
    "some avg10=0.12 avg60=0.30 avg300=0.21 total=987654321",
    "full avg10=0.02 avg60=0.10 avg300=0.07 total=123456789",
    "MemTotal:       15666184 kB",
    "MemFree:          440324 kB",
    "HugePages_Total:       0",
    "pgmajfault 507162",
    "total_inactive_file 1032192",
    "max 35",
    "4:memory:/process_api/abc/svc",
    "0::/svc-twin",
    "Node 0, zone   Normal",
    "        low      4265",
    "        protection: (0, 0, 768, 768, 768)",
    "9223372036854771712",
    "max",
]


@st.composite
def garbled(draw: st.DrawFn) -> bytes:
    """Bytes a broken or hostile file might hold."""
    kind = draw(st.sampled_from(["random", "mutated", "truncated", "empty", "nul", "huge", "bad_utf8"]))
    base = "\n".join(draw(st.lists(st.sampled_from(KERNEL_LINES), min_size=1, max_size=8))).encode()
    if kind == "random":
        return draw(st.binary(max_size=512))
    if kind == "mutated":
        data = bytearray(base)
        for _ in range(draw(st.integers(1, 8))):
            pos = draw(st.integers(0, max(len(data) - 1, 0)))
            data[pos : pos + 1] = bytes([draw(st.integers(0, 255))])
        return bytes(data)
    if kind == "truncated":
        return base[: draw(st.integers(0, len(base)))]
    if kind == "empty":
        return b""
    if kind == "nul":
        return base.replace(b" ", b"\x00", draw(st.integers(1, 3)))
    if kind == "huge":  # several MiB of valid-looking lines: past the read cap
        line = draw(st.sampled_from(KERNEL_LINES)).encode() + b"\n"
        return line * ((3 << 20) // len(line) + 1)
    return base + b"\xff\xfe\xc3(\xa0\xa1\xe2\x28\xa1"


TEXT = st.one_of(st.text(max_size=300), garbled().map(lambda b: b.decode("utf-8", errors="replace")))


# --------------------------------------------------------------------------- pure parsers


@SETTINGS
@given(TEXT)
def test_procfs_parsers_never_raise_and_return_their_types(text: str) -> None:
    value = procfs.parse_int(text)
    assert value is None or isinstance(value, int)
    ok, limit = procfs.parse_limit(text)
    assert isinstance(ok, bool) and (limit is None or isinstance(limit, int))
    assert all(isinstance(k, str) and isinstance(v, int) for k, v in procfs.parse_flat_keyed(text).items())
    psi = procfs.parse_psi(text)
    if psi is not None:
        assert isinstance(psi, Psi) and (psi.some or psi.full)
        for line in (psi.some, psi.full):
            if line is not None:
                assert all(0.0 <= v <= 100.0 for v in (line.avg10, line.avg60, line.avg300)) and line.total_us >= 0
    assert all(v >= 0 for v in procfs.parse_meminfo(text).values())
    assert procfs.under("/root", text.replace("\x00", "")).is_absolute()


@SETTINGS
@given(TEXT)
def test_our_parsers_never_raise(text: str) -> None:
    marks = parse_zoneinfo(text)
    assert marks is None or (marks.low >= 0 and marks.totalreserve >= 0)
    member = parse_proc_cgroup(text)
    for path in (member.v1_memory, member.v2):
        assert path is None or path.startswith("/")
    cleaned = clean_cgroup_path(text)
    assert cleaned is None or (cleaned.startswith("/") and "/../" not in cleaned + "/")
    stat, swap = map_v1_stat(procfs.parse_flat_keyed(text))
    assert isinstance(stat, dict) and (swap is None or isinstance(swap, int))


@SETTINGS
@given(st.text(alphabet="0123456789_+-٣١ \t\n", max_size=12))
def test_parse_int_accepts_only_kernel_decimal(text: str) -> None:
    value = procfs.parse_int(text)
    token = text.strip()
    is_kernel_int = token.lstrip("-").isascii() and token.lstrip("-").isdigit() and token.count("-") <= int(token[:1] == "-")
    assert (value is not None) == is_kernel_int
    if value is not None:
        assert value == int(token)


@SETTINGS
@given(garbled())
def test_read_text_never_raises_and_flags_truncation(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "f"
        path.write_bytes(data)
        result = procfs.read_text(path)
        assert result.error is None and result.text is not None
        assert result.truncated == (len(data) > procfs.MAX_READ_BYTES)
        # what was read is the file's first MAX_READ_BYTES, undecodable bytes replaced, nothing else
        assert result.text == data[: procfs.MAX_READ_BYTES].decode("utf-8", errors="replace")


def test_read_text_on_odd_paths() -> None:
    assert procfs.read_text("/nonexistent/x").errno == 2
    assert procfs.read_text("/").error is not None  # a directory
    assert procfs.read_text("/tmp/a\x00b").error == "invalid path (embedded NUL byte)"
    zero = procfs.read_text("/dev/zero", max_bytes=4096)  # endless file: capped, flagged
    assert zero.truncated and zero.text is not None and len(zero.text) == 4096


# --------------------------------------------------------------------------- samplers on corrupted trees


@contextmanager
def copied(src: Path) -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        dst = Path(tmp) / "root"
        shutil.copytree(src, dst)
        yield dst


HOST_FILES = ["meminfo", "vmstat", "pressure/cpu", "pressure/memory", "pressure/io", "pressure/irq", "zoneinfo"]


def assert_host_consistent(snap) -> None:  # type: ignore[no-untyped-def]
    """Every required field is either present or missing with a reason -- never both, never neither."""
    for resource in ("cpu", "memory", "io"):
        assert (resource in snap.psi) != (f"psi.{resource}" in snap.missing), resource
    assert ("total" in snap.memory) != ("memory.total" in snap.missing)
    assert ("available" in snap.memory) != ("memory.available" in snap.missing)
    assert bool(snap.vmstat) != ("vmstat" in snap.missing)
    assert all(isinstance(v, str) and v for v in snap.missing.values())


@SETTINGS
@given(st.sampled_from(HOST_FILES), garbled())
def test_host_sampler_survives_any_corrupted_file(name: str, data: bytes) -> None:
    with copied(NODE_PROC) as root:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
        snap = HostSampler(str(root)).sample()
        assert_host_consistent(snap)
        huge = len(data) > procfs.MAX_READ_BYTES
        if name.startswith("pressure/") and (huge or not data):  # irq too: present-but-broken is reported
            assert f"psi.{name.removeprefix('pressure/')}" in snap.missing
        if name == "meminfo" and huge:
            assert "read cap" in snap.missing["memory"]
        if name == "vmstat" and huge:
            assert "read cap" in snap.missing["vmstat"]


def test_host_sampler_with_every_file_replaced_by_a_directory() -> None:
    with copied(NODE_PROC) as root:
        for name in HOST_FILES:
            path = root / name
            if path.exists():
                path.unlink()
            path.mkdir(parents=True)
        snap = HostSampler(str(root)).sample()
        assert_host_consistent(snap)
        assert snap.psi == {} and snap.memory == {} and snap.vmstat == {}
        assert "psi.irq" in snap.missing  # present but unreadable is not "absent"


V2_FILES = ["memory.current", "memory.peak", "memory.max", "memory.high", "memory.low", "memory.min",
            "memory.swap.current", "memory.events", "memory.events.local", "memory.stat", "memory.pressure"]  # fmt: skip
V1_FILES = ["memory.usage_in_bytes", "memory.max_usage_in_bytes", "memory.limit_in_bytes", "memory.failcnt",
            "memory.oom_control", "memory.stat"]  # fmt: skip


def assert_cgroup_consistent(snap: CgroupSnapshot) -> None:
    m = snap.missing
    assert all(isinstance(v, str) and v for v in m.values())
    # Plain measurements: None exactly when missing.
    for name in ("usage_bytes", "peak_bytes", "swap_bytes", "working_set_bytes"):
        assert (getattr(snap, name) is None) == (name in m), name
    assert (snap.pressure is None) == ("pressure" in m)
    # Limits: None is also "unlimited", so only one direction holds.
    for name in ("limit_bytes", "high_bytes", "low_bytes", "min_bytes"):
        assert name not in m or getattr(snap, name) is None, name
    for value in (snap.usage_bytes, snap.peak_bytes, snap.swap_bytes, snap.working_set_bytes, snap.limit_bytes):
        assert value is None or value >= 0
    assert all(v >= 0 for v in (*snap.events.values(), *snap.events_local.values(), *snap.stat.values()))
    if snap.version == "v2":
        assert bool(snap.events) != ("events" in m)
        assert bool(snap.events_local) != ("events_local" in m)
        assert bool(snap.stat) != ("stat" in m)
        assert snap.under_oom is None
    else:
        assert ("max" in snap.events) != ("events.max" in m)
        assert ("oom_kill" in snap.events) != ("events.oom_kill" in m)
        assert (snap.under_oom is None) == ("under_oom" in m)
        assert snap.events_local == {}


@SETTINGS
@given(st.sampled_from(V2_FILES), garbled())
def test_v2_sampler_survives_any_corrupted_file(name: str, data: bytes) -> None:
    with copied(FIXTURES / "v2") as root:
        (root / "sys/fs/cgroup/system.slice/llm.service" / name).write_bytes(data)
        snap = CgroupSampler(str(root / "proc"), str(root / "sys"), pids=[4242]).sample()[0]
        assert snap.version == "v2"
        assert_cgroup_consistent(snap)
        if len(data) > procfs.MAX_READ_BYTES or not data:
            key = {"memory.current": "usage_bytes", "memory.peak": "peak_bytes", "memory.swap.current": "swap_bytes",
                   "memory.max": "limit_bytes", "memory.high": "high_bytes", "memory.low": "low_bytes",
                   "memory.min": "min_bytes", "memory.events": "events", "memory.events.local": "events_local",
                   "memory.stat": "stat", "memory.pressure": "pressure"}[name]  # fmt: skip
            assert key in snap.missing


@SETTINGS
@given(st.sampled_from(V1_FILES), garbled(), st.sampled_from(["v1", "hybrid"]))
def test_v1_and_hybrid_sampler_survive_any_corrupted_file(name: str, data: bytes, layout: str) -> None:
    group = {"v1": "docker/0123abcd", "hybrid": "process_api/abc/svc"}[layout]
    pid = {"v1": 777, "hybrid": 4242}[layout]
    with copied(FIXTURES / layout) as root:
        (root / "sys/fs/cgroup/memory" / group / name).write_bytes(data)
        snap = CgroupSampler(str(root / "proc"), str(root / "sys"), pids=[pid]).sample()[0]
        assert snap.version == layout
        assert_cgroup_consistent(snap)


@SETTINGS
@given(garbled(), st.sampled_from(["v1", "v2", "hybrid"]))
def test_garbled_proc_pid_cgroup_never_raises(data: bytes, layout: str) -> None:
    with copied(FIXTURES / layout) as root:
        pid_dir = root / "proc" / "4242"
        pid_dir.mkdir(parents=True, exist_ok=True)
        (pid_dir / "cgroup").write_bytes(data)
        sampler = CgroupSampler(str(root / "proc"), str(root / "sys"), pids=[4242])
        snaps = sampler.sample()
        assert (len(snaps) == 1) != (4242 in sampler.unresolved)
        for snap in snaps:
            if snap.version == "none":
                assert "group" in snap.missing
            else:
                assert_cgroup_consistent(snap)
            # Whatever the file said, nothing outside the fixture tree was read as a group.
            assert ".." not in snap.path.split("/")


@SETTINGS
@given(garbled(), st.sampled_from(["v1", "hybrid"]))
def test_garbled_cgroup_procs_only_costs_the_twin(data: bytes, layout: str) -> None:
    group = {"v1": "docker/0123abcd", "hybrid": "process_api/abc/svc"}[layout]
    with copied(FIXTURES / layout) as root:
        (root / "sys/fs/cgroup/memory" / group / "cgroup.procs").write_bytes(data)
        snap = CgroupSampler(str(root / "proc"), str(root / "sys"), cgroups=["/" + group]).sample()[0]
        assert_cgroup_consistent(snap)
        assert snap.usage_bytes is not None  # memory itself is unaffected
