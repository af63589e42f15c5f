"""/dev/kmsg OOM parsing: the exact kernel lines, pairing, lone lines, garbage; the watcher over a file."""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from collectors.kmsg import (
    KmsgOomWatcher,
    OomAssembler,
    parse_killed_process_line,
    parse_kmsg_chunk,
    parse_kmsg_record,
    parse_oom_events,
    parse_oom_kill_line,
)
from collectors.records import OomEvent, record_from_json

# Verbatim from a memcg OOM on a development host (a hog in a limited memory cgroup), ids shortened.
MEMCG_KILL = (
    "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
    "oom_memcg=/process_api/abc/lab_oom,task_memcg=/process_api/abc/lab_oom,task=python,pid=11092,uid=0"
)
MEMCG_KILLED = (
    "Memory cgroup out of memory: Killed process 11092 (python) total-vm:221188kB, anon-rss:204288kB, "
    "file-rss:6616kB, shmem-rss:0kB, UID:0 pgtables:468kB oom_score_adj:0"
)
# Host-wide OOM: "global_oom" replaces "oom_memcg=..." and the prefix is "Out of memory:".
GLOBAL_KILL = (
    "oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0-1,global_oom,"
    "task_memcg=/system.slice/llm.service,task=llama-server,pid=4242,uid=998"
)
GLOBAL_KILLED = (
    "Out of memory: Killed process 4242 (llama-server) total-vm:9876543kB, anon-rss:8000000kB, "
    "file-rss:1024kB, shmem-rss:4kB, UID:998 pgtables:20000kB oom_score_adj:0"
)
KIB = 1024


def rec(seq: int, usec: int, message: str, prio: int = 6) -> str:
    return f"{prio},{seq},{usec},-;{message}"


def test_parse_record_and_continuation() -> None:
    r = parse_kmsg_record("6,1234,5678901,-;message text; with semicolons")
    assert r is not None
    assert (r.priority, r.seq, r.usec, r.flags, r.message) == (6, 1234, 5678901, "-", "message text; with semicolons")
    caller = parse_kmsg_record("4,99,1,c,caller=T12;hello")  # newer kernels append header fields
    assert caller is not None and caller.message == "hello" and caller.flags == "c"
    assert parse_kmsg_record(" SUBSYSTEM=memory") is None
    assert parse_kmsg_record("not a record") is None
    assert parse_kmsg_record("6,x,1,-;bad seq") is None
    chunk = b"6,1,2,-;first\n SUBSYSTEM=x\n DEVICE=y\n6,2,3,-;second\n"
    assert [r.message for r in parse_kmsg_chunk(chunk)] == ["first", "second"]


def test_parse_memcg_summary_line() -> None:
    assert parse_oom_kill_line(MEMCG_KILL) == {
        "constraint": "CONSTRAINT_MEMCG",
        "oom_memcg": "/process_api/abc/lab_oom",
        "task_memcg": "/process_api/abc/lab_oom",
        "task": "python",
        "pid": 11092,
        "uid": 0,
    }


def test_parse_global_summary_line() -> None:
    assert parse_oom_kill_line(GLOBAL_KILL) == {
        "constraint": "CONSTRAINT_NONE",
        "oom_memcg": None,
        "task_memcg": "/system.slice/llm.service",
        "task": "llama-server",
        "pid": 4242,
        "uid": 998,
    }


def test_parse_killed_lines() -> None:
    memcg = parse_killed_process_line(MEMCG_KILLED)
    assert memcg == {
        "pid": 11092,
        "task": "python",
        "constraint": "CONSTRAINT_MEMCG",
        "total_vm_bytes": 221188 * KIB,
        "anon_rss_bytes": 204288 * KIB,
        "file_rss_bytes": 6616 * KIB,
        "shmem_rss_bytes": 0,
        "uid": 0,
    }
    glob = parse_killed_process_line(GLOBAL_KILLED)
    assert glob is not None and glob["constraint"] is None and glob["anon_rss_bytes"] == 8000000 * KIB
    odd = parse_killed_process_line("Out of memory: Killed process 7 (a) (b) c) total-vm:1kB, anon-rss:2kB, file-rss:3kB")
    assert odd is not None and odd["task"] == "a) (b) c" and odd["shmem_rss_bytes"] is None and odd["uid"] is None
    assert parse_killed_process_line("Memory cgroup out of memory: Kill process 5 (x) score 1000 or sacrifice child") is None
    assert parse_killed_process_line("oom_reaper: reaped process 11092 (python), now anon-rss:0kB") is None


def test_memcg_kill_becomes_one_event_with_wall_time() -> None:
    lines = [
        rec(1, 4_999_000, "python invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0"),
        " SUBSYSTEM=memory",
        rec(2, 5_000_000, MEMCG_KILL),
        rec(3, 5_000_100, MEMCG_KILLED, prio=3),
        rec(4, 5_000_200, "oom_reaper: reaped process 11092 (python), now anon-rss:0kB, file-rss:0kB, shmem-rss:0kB"),
    ]
    (event,) = parse_oom_events(lines, boot_time=1_700_000_000.0)
    assert event == OomEvent(
        ts=1_700_000_005.0,
        constraint="CONSTRAINT_MEMCG",
        oom_memcg="/process_api/abc/lab_oom",
        task_memcg="/process_api/abc/lab_oom",
        task="python",
        pid=11092,
        uid=0,
        total_vm_bytes=221188 * KIB,
        anon_rss_bytes=204288 * KIB,
        file_rss_bytes=6616 * KIB,
        shmem_rss_bytes=0,
    )
    assert record_from_json(event.to_json()) == event


def test_global_kill_and_interleaved_kills_pair_by_pid() -> None:
    lines = [
        rec(1, 1_000_000, GLOBAL_KILL),
        rec(2, 1_000_001, MEMCG_KILL),
        rec(3, 1_000_002, MEMCG_KILLED),
        rec(4, 1_000_003, GLOBAL_KILLED),
    ]
    events = {e.pid: e for e in parse_oom_events(lines)}
    assert set(events) == {4242, 11092}
    g = events[4242]
    assert (g.constraint, g.oom_memcg, g.task_memcg, g.uid) == ("CONSTRAINT_NONE", None, "/system.slice/llm.service", 998)
    assert g.anon_rss_bytes == 8000000 * KIB
    assert events[11092].constraint == "CONSTRAINT_MEMCG" and events[11092].total_vm_bytes == 221188 * KIB


def test_summary_without_its_killed_line_is_not_lost() -> None:
    assembler = OomAssembler(lambda: 0.0, window_records=200)
    assert assembler.feed(parse_kmsg_record(rec(1, 10, MEMCG_KILL))) == []
    out: list[OomEvent] = []
    for seq in range(2, 202):
        out += assembler.feed(parse_kmsg_record(rec(seq, 10 + seq, f"unrelated message {seq}")))
    assert out == []  # still waiting within the window
    out += assembler.feed(parse_kmsg_record(rec(202, 300, "one more")))
    (event,) = out
    assert (event.pid, event.constraint, event.task_memcg) == (11092, "CONSTRAINT_MEMCG", "/process_api/abc/lab_oom")
    assert event.anon_rss_bytes is None
    # Its late partner does not count the same kill twice.
    assert assembler.feed(parse_kmsg_record(rec(203, 400, MEMCG_KILLED))) == []


def test_summary_expires_by_time_when_nothing_else_arrives() -> None:
    now = [100.0]
    assembler = OomAssembler(lambda: 0.0, window_s=2.0, monotonic=lambda: now[0])
    assembler.feed(parse_kmsg_record(rec(1, 10, MEMCG_KILL)))
    assert assembler.expire() == []
    now[0] += 2.5
    (event,) = assembler.expire()
    assert event.pid == 11092


def test_killed_line_alone_still_yields_an_event() -> None:
    # Rate-limited OOM storms print only "Killed process" (the header with the summary is ratelimited).
    (event,) = parse_oom_events([rec(9, 2_000_000, MEMCG_KILLED)], boot_time=10.0)
    assert (event.pid, event.task, event.constraint, event.task_memcg) == (11092, "python", "CONSTRAINT_MEMCG", None)
    assert event.ts == 12.0
    (glob,) = parse_oom_events([rec(9, 1, GLOBAL_KILLED)])
    assert glob.constraint is None and glob.pid == 4242


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=300), st.sampled_from([MEMCG_KILL, MEMCG_KILLED, GLOBAL_KILL])), max_size=30))
def test_garbage_never_raises(messages: list[str]) -> None:
    lines = [rec(i, i * 7, m) if i % 2 else m for i, m in enumerate(messages)]
    for event in parse_oom_events(lines):
        record_from_json(event.to_json())
    for m in messages:
        parse_oom_kill_line(m)
        parse_killed_process_line(m)
        parse_kmsg_chunk(m.encode("utf-8", "surrogatepass"))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2000))
def test_binary_garbage_never_raises(data: bytes) -> None:
    for record in parse_kmsg_chunk(data):
        assert record.seq >= 0


# --------------------------------------------------------------------------- watcher (a file standing in)


def test_watcher_starts_at_the_end_and_reads_new_records(tmp_path: Path) -> None:
    fake = tmp_path / "kmsg"
    fake.write_text(rec(1, 1, MEMCG_KILL) + "\n" + rec(2, 2, MEMCG_KILLED) + "\n")  # history: not reported
    watcher = KmsgOomWatcher(str(fake))
    try:
        assert watcher.error is None
        assert watcher.poll() == []
        with fake.open("a") as f:
            f.write(rec(3, 3_000_000, GLOBAL_KILL) + "\n" + " SUBSYSTEM=x\n" + rec(4, 3_000_001, GLOBAL_KILLED) + "\n")
        (event,) = watcher.poll()
        assert event.pid == 4242 and event.constraint == "CONSTRAINT_NONE" and event.anon_rss_bytes == 8000000 * KIB
        assert watcher.poll() == []
        assert watcher.records_read == 2
    finally:
        watcher.close()
    assert watcher.poll() == []  # closed: nothing, no exception


def test_watcher_reports_why_it_cannot_open(tmp_path: Path) -> None:
    watcher = KmsgOomWatcher(str(tmp_path / "no-such-kmsg"))
    assert watcher.error is not None and "No such file" in watcher.error
    assert watcher.poll() == []
    watcher.close()


def test_watcher_on_the_real_device_never_raises() -> None:
    watcher = KmsgOomWatcher()
    try:
        if os.geteuid() != 0:
            # dmesg_restrict=1 hosts refuse non-root; either way the watcher says why instead of raising.
            assert watcher.error is None or "kmsg" in watcher.error
        # Whatever this host's ring holds: every OOM kill it reports is a complete one, never a half-parsed line.
        for event in watcher.poll():
            assert event.ts > 0 and event.source == "kmsg" and (event.pid or event.task or event.constraint), event
    finally:
        watcher.close()
