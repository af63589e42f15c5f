"""Rows of every kind for the loaders' tests, odd ones included, and the check that two Timelines are the same.

Shared by the tests of the fast loading path (``test_bulk_loading.py``) and of the stored hours
(``test_recorder_blocks.py``): both hold a way of reading a recorder to the Timeline another way gives.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from collectors.records import (
    CgroupSnapshot,
    HostSnapshot,
    LoaderEvent,
    OomEvent,
    ProcessSample,
    Psi,
    PsiLine,
    RequestTiming,
    ServiceConfig,
)
from diag.timeline import Timeline

T0 = 1_790_000_000.0


def records(rng: np.random.Generator, n: int, odd_rows: bool) -> list[tuple[float, str, int, str]]:
    rows = []
    for i in range(n):
        ts = T0 + i
        memory = {"total": 24 << 30, "available": int(rng.integers(8 << 30, 9 << 30))}
        if i % 7 == 3:
            memory["dirty"] = int(rng.integers(0, 1 << 20))  # a key that comes and goes
        full = None if i % 5 == 0 else PsiLine(0.1, 0, 0, 10 * i)
        psi = {"memory": Psi(some=PsiLine(float(rng.random()), 0.5, 0.1, 1000 * i), full=full)}
        recs: list[Any] = [
            HostSnapshot(ts=ts, psi=psi, memory=memory, vmstat={"pgmajfault": 3 * i}),
            CgroupSnapshot(ts=ts, path="/a" if i % 2 else "/b", version="v1", usage_bytes=100 + i, limit_bytes=None,
                           events={"max": i // 3}, under_oom=bool(i % 11 == 0) if i % 4 else None,
                           pressure=Psi(some=PsiLine(0.1, 0, 0, i)) if i % 3 else None),
            ProcessSample(ts=ts, pid=42, comm="python" if i % 9 and i != n - 1 else "", start_time_s=5.0,
                          rss_bytes=int(rng.integers(1, 1 << 30)), model_files=["/m.gguf"] if i % 10 == 0 else [],
                          memory_cgroup="/a"),
            ProcessSample(ts=ts + 0.5, pid=43, comm="worker", start_time_s=None, rss_bytes=None, major_faults=i),
            RequestTiming(ts=ts, arrival=ts - 1, start=None if i % 13 == 0 else ts - 0.5, finish=ts,
                          outcome="rejected" if i % 13 == 0 else "ok", route="/v1/x" if i % 2 else "", model="m",
                          prompt_tokens=int(rng.integers(1, 500))),
        ]  # fmt: skip
        rows += [(r.ts, r.KIND, r.SCHEMA, r.to_json()) for r in recs]
    odd = [
        ("request", "{not json"),
        ("request", json.dumps({"kind": "request", "ts": "abc", "arrival": 1})),  # ts not a number
        ("request", json.dumps({"kind": "request", "arrival": 1})),  # no ts
        ("request", json.dumps({"kind": "request", "ts": T0 + 3.5, "arrival": [1, 2], "route": 7, "model": None})),
        ("request", json.dumps({"kind": "request", "ts": T0 + 4.5, "arrival": "12.5", "prompt_tokens": True})),
        ("request", json.dumps({"kind": "request", "ts": T0 + 5.5, "route": 7, "model": 0, "outcome": None})),
        ("request", json.dumps({"kind": "loader", "ts": T0 + 2, "name": "x", "duration_s": 0.5})),  # stored under another kind
        ("request", json.dumps([1, 2, 3])),
        ("host", json.dumps({"kind": "host", "ts": T0 + 1.5, "memory": [1, 2]})),  # memory not an object
        ("host", json.dumps({"kind": "host", "ts": T0 + 2.5, "memory": {"total": {"x": 1}}})),
        ("process", json.dumps({"kind": "process", "ts": T0 + 6, "comm": "nopid"})),  # no pid
        ("process", json.dumps({"kind": "process", "ts": T0 + 7, "pid": "42", "start_time_s": 5.0, "rss_bytes": "9"})),
        ("cgroup", json.dumps({"kind": "cgroup", "ts": T0 + 8, "path": "/a", "pressure": {"some": "x"}})),
    ]
    if odd_rows:
        rows += [(T0 + 0.25 * k, kind, 1, body) for k, (kind, body) in enumerate(odd)]
    extra: list[Any] = [
        LoaderEvent(ts=T0 + 3, name="ckpt", start=T0 + 2.5, duration_s=0.5, in_request_path=True),
        OomEvent(ts=T0 + 9, constraint="CONSTRAINT_MEMCG", pid=7),
        ServiceConfig(ts=T0, service="demo", settings={"workers": 2}),
    ]
    rows += [(r.ts, r.KIND, r.SCHEMA, r.to_json()) for r in extra]
    return rows


def same(a: np.ndarray, b: np.ndarray) -> bool:
    if a.dtype == object or b.dtype == object:
        return a.shape == b.shape and all(x == y for x, y in zip(a, b, strict=True))
    return bool(np.array_equal(a, b, equal_nan=True))


def assert_same(a: Timeline, b: Timeline) -> None:
    assert (a.start, a.end, a.source, a.counts, a.skipped) == (b.start, b.end, b.source, b.counts, b.skipped)
    groups = [("host", a.host, b.host)] + [(f"cgroup {p}", a.cgroups[p], b.cgroups.get(p, {})) for p in a.cgroups]
    assert set(a.cgroups) == set(b.cgroups) and set(a.processes) == set(b.processes)
    for key, track in a.processes.items():
        other = b.processes[key]
        assert (track.pid, track.start_time_s, track.comm, track.cmdline, track.memory_cgroup, track.model_files) == (
            other.pid, other.start_time_s, other.comm, other.cmdline, other.memory_cgroup, other.model_files)  # fmt: skip
        groups.append((f"process {key}", track.series, other.series))
    for where, sa, sb in groups:
        assert set(sa) == set(sb), where
        for name in sa:
            assert same(sa[name].ts, sb[name].ts) and same(sa[name].values, sb[name].values), (where, name)
    for table in ("requests", "batches", "routing", "loader", "torch", "gpu_processes"):
        ta, tb = getattr(a, table), getattr(b, table)
        assert set(ta.columns) == set(tb.columns), table
        for col in ta.columns:
            assert same(ta[col], tb[col]), (table, col)
    assert (a.ooms, a.cuda_ooms, a.configs) == (b.ooms, b.cuda_ooms, b.configs)
