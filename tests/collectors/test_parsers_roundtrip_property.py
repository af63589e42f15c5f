"""Round trips: a generated well-formed kernel file parses back to exactly the values it was generated from, and a
line broken in a known way gives nothing (or missing-with-reason) rather than a wrong value; adversarial lines
(repeated separators, huge numbers, NULs) cost time linear in their length."""

from __future__ import annotations

import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectors import procfs
from collectors.cgroup import parse_proc_cgroup
from collectors.kmsg import parse_kmsg_chunk, parse_kmsg_record, parse_oom_kill_line
from collectors.processes import parse_memory_cgroup, parse_smaps_rollup, parse_stat, split_cmdline

SETTINGS = settings(max_examples=80, deadline=None)

keys = st.from_regex(r"[A-Za-z][A-Za-z0-9_()]{0,24}", fullmatch=True)
u64 = st.integers(0, 2**64 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
avg = st.integers(0, 10000).map(lambda n: n / 100)


@SETTINGS
@given(st.dictionaries(keys, st.tuples(st.integers(0, 2**44), st.booleans()), min_size=1, max_size=30))
def test_meminfo_round_trip(fields: dict[str, tuple[int, bool]]) -> None:
    text = "".join(f"{k}:{' ' * 8}{v}{' kB' if kb else ''}\n" for k, (v, kb) in fields.items())
    assert procfs.parse_meminfo(text) == {k: v * 1024 if kb else v for k, (v, kb) in fields.items()}


@SETTINGS
@given(st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,30}", fullmatch=True), i64, max_size=40))
def test_flat_keyed_round_trip(fields: dict[str, int]) -> None:
    assert procfs.parse_flat_keyed("".join(f"{k} {v}\n" for k, v in fields.items())) == fields


@SETTINGS
@given(i64, st.sampled_from(["", "\n", " \n", "\t"]))
def test_single_int_and_limit_round_trip(value: int, tail: str) -> None:
    assert procfs.parse_int(f"{value}{tail}") == value
    assert procfs.parse_limit(f"{value}{tail}") == (value >= 0, value)
    assert procfs.parse_limit(f"max{tail}") == (True, None)


@SETTINGS
@given(st.lists(st.tuples(avg, avg, avg, u64), min_size=1, max_size=2), st.booleans())
def test_psi_round_trip(lines: list[tuple[float, float, float, int]], irq_style: bool) -> None:
    names = ["some", "full"][: len(lines)]
    if irq_style:  # /proc/pressure/irq has only "full"
        names = ["full"]
        lines = lines[:1]
    text = "".join(
        f"{n} avg10={a:.2f} avg60={b:.2f} avg300={c:.2f} total={t}\n" for n, (a, b, c, t) in zip(names, lines, strict=True)
    )
    psi = procfs.parse_psi(text)
    assert psi is not None
    for name, (a, b, c, t) in zip(names, lines, strict=True):
        line = getattr(psi, name)
        assert (line.avg10, line.avg60, line.avg300, line.total_us) == (a, b, c, t)
    if "some" not in names:
        assert psi.some is None


@SETTINGS
@given(avg, st.sampled_from(["avg10=abc", "avg10=-1.00", "avg10=100.01", "total=-5", "total=1e3", "avg60=1,5"]))
def test_psi_with_a_broken_field_drops_that_line(a: float, broken: str) -> None:
    good = f"avg10={a:.2f} avg60=0.00 avg300=0.00 total=1"
    key = broken.split("=")[0]
    bad = re.sub(rf"{key}=\S+", broken, good)
    psi = procfs.parse_psi(f"some {bad}\nfull {good}\n")
    assert psi is not None and psi.some is None and psi.full is not None


@SETTINGS
@given(
    prio=st.integers(0, 191), seq=st.integers(0, 2**63), usec=st.integers(0, 2**63),
    flags=st.sampled_from(["-", "c", "+"]), message=st.text(st.characters(blacklist_characters="\n\x00"), max_size=200),
)  # fmt: skip
def test_kmsg_record_round_trip(prio: int, seq: int, usec: int, flags: str, message: str) -> None:
    rec = parse_kmsg_record(f"{prio},{seq},{usec},{flags};{message}")
    assert rec is not None
    assert (rec.priority, rec.seq, rec.usec, rec.flags, rec.message) == (prio, seq, usec, flags, message)
    # continuation lines (" KEY=value") and a header with a non-number are not records
    assert parse_kmsg_record(f" SUBSYSTEM=memory;{message}") is None
    assert parse_kmsg_record(f"{prio},x{seq},{usec},{flags};{message}") is None


@SETTINGS
@given(st.binary(max_size=2000))
def test_kmsg_chunk_of_any_bytes_gives_only_well_formed_records(data: bytes) -> None:
    for rec in parse_kmsg_chunk(data):
        assert min(rec.priority, rec.seq, rec.usec) >= 0
        assert "\n" not in rec.message


_field = st.text(st.characters(whitelist_categories=("L", "N"), whitelist_characters="/-_.()"), max_size=30)


@SETTINGS
@given(
    constraint=st.sampled_from(["CONSTRAINT_MEMCG", "CONSTRAINT_NONE", "CONSTRAINT_CPUSET", ""]), cpuset=_field,
    mems=st.sampled_from(["0", "0-1", "0,2"]), memcg=st.one_of(st.none(), _field), task_memcg=_field,
    task=st.text(st.characters(blacklist_characters="\n"), min_size=1, max_size=16), pid=st.integers(1, 2**31),
    uid=st.integers(0, 2**31),
)  # fmt: skip
def test_oom_kill_line_round_trip(constraint: str, cpuset: str, mems: str, memcg: str | None, task_memcg: str,
                                  task: str, pid: int, uid: int) -> None:  # fmt: skip
    where = "global_oom" if memcg is None else f"oom_memcg={memcg}"
    line = (f"oom-kill:constraint={constraint},nodemask=(null),cpuset={cpuset},mems_allowed={mems},{where},"
            f"task_memcg={task_memcg},task={task},pid={pid},uid={uid}")  # fmt: skip
    got = parse_oom_kill_line(line)
    assert got == {"constraint": constraint or None, "oom_memcg": memcg, "task_memcg": task_memcg, "task": task,
                   "pid": pid, "uid": uid}  # fmt: skip


@pytest.mark.parametrize(
    "unit",
    [",cpuset=,mems_allowed=,oom_memcg=,task_memcg=,task=,pid=1", ",task=", ",pid=1,uid=", "oom-kill:", ",global_oom"],
)
def test_oom_kill_line_parsing_is_linear(unit: str) -> None:
    """Repeated separators once made the line's regex backtrack polynomially (2 KB: 40 s). Work bound, not time:
    growing the line 8-fold may cost at most ~8-fold (bound 20 for noise)."""

    def cost(n: int) -> float:
        line = "oom-kill:constraint=x,nodemask=" + unit * n
        best = float("inf")
        for _ in range(5):
            t0 = time.process_time()
            parse_oom_kill_line(line)
            best = min(best, time.process_time() - t0)
        return best

    small, large = cost(500), cost(4000)
    assert large <= 20 * max(small, 2e-5), (small, large)


@SETTINGS
@given(
    pid=st.integers(1, 2**22), comm=st.text(st.characters(blacklist_characters="\x00\n"), max_size=16),
    nums=st.lists(st.integers(0, 2**64 - 1), min_size=49, max_size=49),
)  # fmt: skip
def test_proc_stat_round_trip(pid: int, comm: str, nums: list[int]) -> None:
    fields = ["S", *map(str, nums)]  # field 3 (state) then fields 4..52
    stat = parse_stat(f"{pid} ({comm}) {' '.join(fields)}\n")
    assert stat is not None and stat.comm == comm and stat.missing == {}
    # field N is fields[N - 3]
    assert stat.rss_pages == nums[24 - 4] and stat.start_ticks == nums[22 - 4]


@SETTINGS
@given(pid=st.integers(1, 2**22), kept=st.integers(0, 49))
def test_proc_stat_cut_between_fields_names_what_is_missing(pid: int, kept: int) -> None:
    fields = ["S", *(str(n) for n in range(4, 53))][:kept]  # field N holds N
    stat = parse_stat(f"{pid} (python3) {' '.join(fields)}")
    assert stat is not None
    assert (stat.rss_pages is None) == ("rss_bytes" in stat.missing) == (kept < 24 - 2)
    assert stat.rss_pages is None or stat.rss_pages == 24
    assert all(isinstance(v, str) and v for v in stat.missing.values())


@SETTINGS
@given(st.lists(st.binary(min_size=1, max_size=40).map(lambda b: b.replace(b"\0", b"")).filter(bool), max_size=12))
def test_cmdline_round_trip(args: list[bytes]) -> None:
    raw = b"".join(a + b"\0" for a in args)
    assert split_cmdline(raw) == [a.decode("utf-8", errors="replace") for a in args]
    if args:  # a read cut in the middle of the last argument drops it, never shows half of it
        assert split_cmdline(raw[:-2], truncated=True) == [a.decode("utf-8", errors="replace") for a in args[:-1]]


@SETTINGS
@given(st.dictionaries(st.sampled_from(["Rss", "Pss", "Private_Clean", "Private_Dirty", "Swap", "Shared_Clean"]),
                       st.integers(0, 2**40), min_size=1))  # fmt: skip
def test_smaps_rollup_round_trip(fields: dict[str, int]) -> None:
    text = "55a0c0000000-7ffd00000000 ---p 00000000 00:00 0    [rollup]\n"
    text += "".join(f"{k}:{' ' * 10}{v} kB\n" for k, v in fields.items())
    assert parse_smaps_rollup(text) == {k: v * 1024 for k, v in fields.items() if k != "Shared_Clean"}


_cg_path = st.lists(st.from_regex(r"[a-z0-9_.@-]{1,12}", fullmatch=True), max_size=4).map(lambda p: "/" + "/".join(p))


@SETTINGS
@given(v1=st.one_of(st.none(), _cg_path), v2=st.one_of(st.none(), _cg_path), other=_cg_path)
def test_proc_pid_cgroup_round_trip(v1: str | None, v2: str | None, other: str) -> None:
    lines = [f"12:cpu,cpuacct:{other}"]
    if v1 is not None:
        lines.append(f"4:memory:{v1}")
    if v2 is not None:
        lines.append(f"0::{v2}")
    text = "\n".join(lines) + "\n"
    member = parse_proc_cgroup(text)
    assert member.v1_memory == v1 and member.v2 == v2
    assert parse_memory_cgroup(text) == (v1 if v1 is not None else v2)
