"""What the two llama.cpp incidents need from the collectors and the rules, without an engine: the OOM'd group's
unevictable memory from the kernel's report, locked pages per process, the KV arithmetic of ``config.unsafe`` and
the why of ``oom.host`` -- on record sequences in the kernel's and the agent's own shapes.

The kernel lines are a real memcg OOM of a llama.cpp server that mlock'd its weights (kernel 6.x, cgroup v1),
shortened to the lines that matter plus a few around them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from collectors.kmsg import parse_oom_events
from collectors.processes import parse_smaps_rollup
from collectors.records import CgroupSnapshot, OomEvent, ProcessSample, ServiceConfig, WatchScope
from diag.rules.config import kv_cache, unsafe_config
from diag.rules.engine import analyze
from diag.rules.oom import host_oom
from diag.timeline import timeline_from_records

MIB = 1 << 20
GROUP = "/process_api/x/llmdiag-engine-mlock-1"
KILL = (
    f"oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,oom_memcg={GROUP},"
    f"task_memcg={GROUP},task=python,pid=23755,uid=0"
)
KILLED = (
    "Memory cgroup out of memory: Killed process 23755 (python) total-vm:255752kB, anon-rss:45552kB, "
    "file-rss:71108kB, shmem-rss:0kB, UID:0 pgtables:372kB oom_score_adj:0"
)


def _kmsg(messages: list[str]) -> list[str]:
    return [f"6,{16900 + i},{54883755900 + i},-;{m}" for i, m in enumerate(messages)]


def _stats(group: str, unevictable: int) -> list[str]:
    return [
        f"Memory cgroup stats for {group}:", "cache 39657472", "rss 46759936", "mapped_file 39657472",
        f"unevictable {unevictable}", "hierarchical_memory_limit 86999040", f"total_unevictable {unevictable}",
    ]  # fmt: skip


# --------------------------------------------------------------------------- collectors


def test_the_kill_carries_its_groups_unevictable_memory_from_the_kernels_report() -> None:
    (ev,) = parse_oom_events(
        _kmsg(["memory: usage 84960kB, limit 84960kB, failcnt 4755", *_stats(GROUP, 39395328), KILL, KILLED])
    )
    assert ev.oom_memcg == GROUP and ev.pid == 23755 and ev.unevictable_bytes == 39395328
    assert ev.file_rss_bytes == 71108 * 1024


def test_another_groups_stats_or_none_leave_it_unknown() -> None:
    (ev,) = parse_oom_events(_kmsg([*_stats("/other", 5 * MIB), KILL, KILLED]))
    assert ev.unevictable_bytes is None
    (ev,) = parse_oom_events(_kmsg([KILL, KILLED]))
    assert ev.unevictable_bytes is None


def test_stats_printed_as_one_record_with_escaped_newlines() -> None:
    one = f"Memory cgroup stats for {GROUP}:\\x0aanon 1000\\x0afile 2000\\x0aunevictable 4096\\x0apgfault 7"
    (ev,) = parse_oom_events(_kmsg([one, KILL, KILLED]))
    assert ev.unevictable_bytes == 4096


def test_smaps_rollup_locked_pages() -> None:
    text = "00400000-7ffd r--p 00000000 00:00 0  [rollup]\nRss:  150720 kB\nPss:  100 kB\nLocked:  65536 kB\nSwap:  0 kB\n"
    assert parse_smaps_rollup(text)["Locked"] == 64 * MIB


# --------------------------------------------------------------------------- rules


def _engine_settings(**over: Any) -> dict[str, Any]:
    s = {"engine": "llama.cpp", "n_ctx": 32768, "n_layer": 4, "n_embd_k_gqa": 704, "n_embd_v_gqa": 704,
         "type_k": "f16", "type_v": "f16", "weights_bytes": 64 * MIB, "use_mlock": False}  # fmt: skip
    return {**s, **over}


def _records(settings: dict[str, Any], limit: int, pid: int = 23755) -> list[Any]:
    records: list[Any] = [
        WatchScope(ts=100.0, pids=[pid], cgroups=[GROUP], resolved_pids=[pid], resolved_cgroups=[GROUP]),
        ServiceConfig(ts=100.5, service="llama_cpp.server", pid=pid, settings=settings),
    ]
    for i in range(4):
        records.append(CgroupSnapshot(ts=100.0 + i, path=GROUP, version="v1", usage_bytes=50 * MIB, limit_bytes=limit))
    return records


def _timeline(settings: dict[str, Any], limit: int, oom: OomEvent | None = None, pid: int = 23755):  # type: ignore[no-untyped-def]
    records = [r.to_dict() for r in _records(settings, limit, pid)]
    if oom is not None:
        records.append(oom.to_dict())
    return timeline_from_records(records)


def test_kv_cache_arithmetic_f16_and_quantised_gqa() -> None:
    kv = kv_cache(_engine_settings())
    assert kv is not None and kv.bytes == 2 * 4 * 32768 * 704 * 2 and "2 x 4 layers x n_ctx 32768 x 704" in kv.formula
    q = kv_cache(_engine_settings(n_embd_k_gqa=256, n_embd_v_gqa=256, type_k="q8_0", type_v="f16", n_ctx=1000))
    assert q is not None and q.bytes == 4 * 1000 * (256 * 34 / 32 + 256 * 2) and "256 x 1.0625 B + 256 x 2 B" in q.formula
    assert kv_cache(_engine_settings(n_layer=None)) is None and kv_cache(_engine_settings(type_k="iq2_xs")) is None
    assert kv_cache(_engine_settings(n_ctx=0, context_length=4096)).n_ctx == 4096  # type: ignore[union-attr]


def test_a_kv_cache_over_the_weights_is_named_with_its_cost_and_over_the_limit_it_is_the_cause() -> None:
    oom = OomEvent(ts=102.0, constraint="CONSTRAINT_MEMCG", oom_memcg=GROUP, task_memcg=GROUP, task="python", pid=23755)
    tl = _timeline(_engine_settings(), limit=320 * MIB, oom=oom)
    f = unsafe_config(tl)
    assert f is not None and f.confidence == 0.7  # over the limit on its own, and the kill corroborates
    assert "n_ctx 32768: KV cache f16" in f.summary and "5.5 x the weights" in f.summary and "alone exceed" in f.summary
    a = analyze(tl)
    assert a.primary == "unsafe_config" and "host_oom" in a.contributing


def test_a_kv_cache_under_the_weights_is_no_risk_and_within_the_limit_no_cause() -> None:
    assert unsafe_config(_timeline(_engine_settings(n_ctx=2048), limit=320 * MIB)) is None
    risky = unsafe_config(_timeline(_engine_settings(), limit=1024 * MIB))  # dominates, but fits: a risk only
    assert risky is not None and risky.confidence < 0.5 and "n_ctx 32768" in risky.summary


def test_only_the_servers_in_the_limited_group_add_their_kv_cache_to_its_limit() -> None:
    """The agent reads the configuration of every llama.cpp server on the host. One in another group (another job's,
    seen in its own cgroup) or one never seen inside this group adds nothing to this group's arithmetic: three
    foreign 32k-context servers beside a small one must not make it "alone exceed" its limit."""
    small = _engine_settings(n_ctx=256)
    tl = _timeline(small, limit=83 * MIB)
    assert unsafe_config(tl) is None  # the one server fits
    foreign: list[dict[str, Any]] = []
    for i, pid in enumerate((31001, 31002)):
        foreign.append(ServiceConfig(ts=100.2, service="llama_cpp.server", pid=pid, settings=_engine_settings()).to_dict())
        foreign.append(ProcessSample(ts=101.0 + i, pid=pid, comm="python", memory_cgroup="/other-job").to_dict())
    unseen = ServiceConfig(ts=100.3, service="llama_cpp.server", pid=31003, settings=_engine_settings()).to_dict()
    records = [*(r.to_dict() for r in _records(small, 83 * MIB)), *foreign, unseen]
    assert unsafe_config(timeline_from_records(sorted(records, key=lambda r: r["ts"]))) is None
    # A second server seen inside the group does count: two 32k reservations do not fit.
    inside = [ServiceConfig(ts=100.2, service="llama_cpp.server", pid=31004, settings=_engine_settings()).to_dict(),
              ProcessSample(ts=101.0, pid=31004, comm="python", memory_cgroup=GROUP).to_dict()]  # fmt: skip
    both = timeline_from_records(sorted([*(r.to_dict() for r in _records(small, 83 * MIB)), *inside], key=lambda r: r["ts"]))
    f = unsafe_config(both)
    assert f is not None and "2 server(s)" in f.summary


def test_an_oom_kill_with_locked_memory_says_use_mlock_pinned_it() -> None:
    oom = OomEvent(ts=102.0, constraint="CONSTRAINT_MEMCG", oom_memcg=GROUP, task_memcg=GROUP, task="python", pid=23755,
                   anon_rss_bytes=45 * MIB, unevictable_bytes=38 * MIB)  # fmt: skip
    f = host_oom(_timeline(_engine_settings(n_ctx=256, use_mlock=True), limit=83 * MIB, oom=oom))
    assert f is not None and f.cls == "host_oom"
    evidence = {e.what: e.value for e in f.evidence}
    assert evidence[f"{GROUP} unevictable (mlock'd) memory at the kill (kernel OOM report)"] == 38 * MIB
    assert "use_mlock true" in evidence["victim's setting (its command line)"]
    assert "was unevictable -- the weights use_mlock pinned" in f.summary and "turn mlock off" in f.remediation[0]


def test_an_oom_kill_without_locked_memory_does_not_blame_mlock() -> None:
    oom = OomEvent(ts=102.0, constraint="CONSTRAINT_MEMCG", oom_memcg=GROUP, task_memcg=GROUP, task="python", pid=23755)
    f = host_oom(_timeline(_engine_settings(n_ctx=256), limit=83 * MIB, oom=oom))
    assert f is not None and "unevictable" not in f.summary and "mlock" not in " ".join(f.remediation)
    # A little locked memory (under a quarter of the limit) is evidence, not the headline.
    small = dataclasses.replace(oom, unevictable_bytes=4 * MIB)
    f = host_oom(_timeline(_engine_settings(n_ctx=256), limit=83 * MIB, oom=small))
    assert f is not None and "unevictable" not in f.summary
