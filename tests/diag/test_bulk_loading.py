"""The fast loading path (``TimelineBuilder.add_bodies``, parallel ``load_recorder``) gives exactly the
Timeline the per-record path (``add_json`` row by row) gives -- on realistic rows and on odd ones
(bad JSON, a wrong kind, a missing or non-numeric time, nested values, keys that come and go, a
process seen under two cgroups' worth of samples, strings where numbers belong) -- whichever of its
paths a batch takes: typed (msgspec Structs), json (one ``json.loads`` + dict columns) or per row."""

from __future__ import annotations

import json
import math
import multiprocessing
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import diag.sources.recorder as loaders
from collectors.recorder import FlightRecorder
from collectors.records import (
    HostSnapshot,
    ProcessSample,
    RequestTiming,
)
from diag.timeline import Timeline, TimelineBuilder, builder, fastdecode
from tests.diag.loader_rows import T0, assert_same, records


def _per_row(path: Path) -> Timeline:
    b = TimelineBuilder(source=f"recorder:{path}")
    with FlightRecorder(path, readonly=True) as rec:
        for _ts, kind, body in rec.rows():
            b.add_json(body, kind)
    return b.build()


def _write(path: Path, odd_rows: bool) -> Path:
    with FlightRecorder(path) as rec:
        rec.write_rows(records(np.random.default_rng(3), 400, odd_rows))
    return path


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("bulk") / "clean.db", odd_rows=False)


@pytest.fixture(scope="module")
def recorder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("bulk") / "odd.db", odd_rows=True)


def test_bulk_equals_per_row(clean: Path, recorder: Path) -> None:
    reference = _per_row(clean)
    assert not reference.skipped and len(reference.requests) == 400 and len(reference.processes) == 2
    assert_same(reference, loaders.load_recorder(clean, workers=1))  # every batch through the bulk handlers
    reference = _per_row(recorder)
    assert reference.skipped  # the odd rows are there, and are counted the same way
    assert_same(reference, loaders.load_recorder(recorder, workers=1))


@pytest.mark.process
def test_small_batches_and_parallel_parts_equal_per_row(recorder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = _per_row(recorder)
    monkeypatch.setattr(loaders, "BATCH_ROWS", 7)  # many batches, odd rows land in different ones
    assert_same(reference, loaders.load_recorder(recorder, workers=1))
    monkeypatch.setattr(loaders, "PARALLEL_MIN_ROWS", 10)
    parts = loaders._plan(recorder, None, None, 3)
    assert len(parts) == 3  # really split: three readers, two of them forked
    assert_same(reference, loaders.load_recorder(recorder, workers=3))


def test_a_readers_builder_crosses_the_pipe_whole_and_writable(clean: Path) -> None:
    """A forked reader's arrays arrive out of band, each straight into a buffer of its own: equal, ordinary arrays."""
    sent = loaders._read_part(clean, None, None, "x").compact()
    recv, send = multiprocessing.Pipe(duplex=False)
    status, got = "", None
    with recv, send:
        writer = threading.Thread(target=loaders._send_builder, args=(send, sent))  # a pipe holds only so much
        writer.start()
        status, got = loaders._receive_builder(recv)
        writer.join()
    assert status == "ok" and isinstance(got, TimelineBuilder)
    (ts, values), *_ = got.groups["host"][None].chunks["memory.total"]
    assert ts.flags.writeable and values.flags.writeable and ts.size == 400
    assert_same(loaders._read_part(clean, None, None, "x").build(), got.build())


@pytest.mark.process
def test_since_window_is_respected(recorder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loaders, "PARALLEL_MIN_ROWS", 10)
    until = T0 + 300
    tl = loaders.load_recorder(recorder, since_s=100, until=until, workers=2)
    assert tl.start >= until - 100 and tl.end <= until
    assert tl.host["memory.total"].ts.size == 101  # [200, 300] inclusive, each second once


# --------------------------------------------------------------------------- typed decoding (diag/timeline/fastdecode.py)


def _bodies_by_kind(rows: list[tuple[float, str, int, str]]) -> dict[str, list[str]]:
    by_kind: dict[str, list[str]] = {}
    for _ts, kind, _schema, body in sorted(rows, key=lambda r: r[0]):
        by_kind.setdefault(kind, []).append(body)
    return by_kind


def _per_row_of(by_kind: dict[str, list[str]]) -> Timeline:
    b = TimelineBuilder(source="x")
    for kind, bodies in by_kind.items():
        for body in bodies:
            b.add_json(body, kind)
    return b.build()


def test_clean_rows_take_the_typed_path_and_equal_per_row() -> None:
    by_kind = _bodies_by_kind(records(np.random.default_rng(5), 120, odd_rows=False))
    for as_bytes in (False, True):
        b = TimelineBuilder(source="x")
        for kind, bodies in by_kind.items():
            b.add_bodies(kind, [body.encode() for body in bodies] if as_bytes else bodies)
        hot = sum(len(v) for k, v in by_kind.items() if k in fastdecode.TYPED_KINDS)
        # not silently falling back: typed, or strict for the cgroup rows (the host rows' meminfo keys come and go)
        assert fastdecode.AVAILABLE and b.decode_paths["typed"] + b.decode_paths["strict"] == hot
        assert b.decode_paths["strict"] == len(by_kind["cgroup"])
        assert_same(_per_row_of(by_kind), b.build())


def _body(kind: str, ts: float, **fields: Any) -> str:
    return json.dumps({"kind": kind, "schema": 1, "ts": ts, **fields})


def test_a_row_typed_decoding_rejects_costs_only_its_batch() -> None:
    """Values the json path reads as numbers but typed decoding refuses (strings, bools, ints where a bool
    belongs, NaN, numbers beyond float range) send their batch down the json path; the next batch is typed again."""
    good = {
        "request": lambda i: _body("request", T0 + i, arrival=T0 + i - 1, start=None, finish=T0 + i, route="/r"),
        "process": lambda i: _body("process", T0 + i, pid=7, start_time_s=5, rss_bytes=1000 + i, comm="w"),
        "host": lambda i: _body("host", T0 + i, memory={"total": 10, "free": i}, psi={"memory": {"some": {"avg10": 0.5}}}),
        "cgroup": lambda i: _body("cgroup", T0 + i, path="/g", usage_bytes=i, under_oom=False, stat={"anon": i}),
    }
    odd = {
        "request": _body("request", T0 + 100.5, arrival="12.5", prompt_tokens=True, route=7),
        "process": _body("process", T0 + 100.5, pid=7, start_time_s=5, rss_bytes=10**400, major_faults="3"),
        "host": _body("host", T0 + 100.5, memory={"total": "11", "free": 1e400}, vmstat={"pgfault": True}),
        "cgroup": '{"kind": "cgroup", "ts": %r, "path": "/g", "usage_bytes": NaN, "under_oom": 1}' % (T0 + 100.5),
    }
    for kind, make in good.items():
        first = [make(i) for i in range(50)]
        second = [make(i) for i in range(50, 100)] + [odd[kind]]  # one odd row in the second batch
        third = [make(i) for i in range(101, 150)]
        b = TimelineBuilder(source="x")
        for batch in (first, second, third):
            b.add_bodies(kind, batch)
        assert b.decode_paths["typed"] + b.decode_paths["strict"] == len(first) + len(third), kind
        assert b.decode_paths["json"] + b.decode_paths["per_row"] == len(second), kind
        assert_same(_per_row_of({kind: first + second + third}), b.build())


def test_typed_keeps_what_the_track_key_and_facts_look_like() -> None:
    """``start_time_s`` 5 and 5.0 are different tracks ("7@5" / "7@5.0"), as on the per-row path; facts are the
    last truthy value per track, across batches."""
    rows = [_body("process", T0 + i, pid=7, start_time_s=5 if i % 2 else 5.0, comm="a" if i < 3 else "",
                  cmdline=None, model_files=["/m"] if i == 1 else [], rss_bytes=i) for i in range(6)]  # fmt: skip
    b = TimelineBuilder(source="x")
    b.add_bodies("process", rows[:3])
    b.add_bodies("process", rows[3:])
    assert b.decode_paths["typed"] == 6
    tl = b.build()
    assert set(tl.processes) == {"7@5", "7@5.0"} and tl.processes["7@5"].model_files == {"/m"}
    assert tl.processes["7@5.0"].comm == "a" and tl.processes["7@5"].comm == "a"
    assert_same(_per_row_of({"process": rows}), tl)
    # the json path groups the same way: "42" and 42 are one track, 0.0 and -0.0 two
    odd = [_body("process", T0 + i, pid="42" if i % 3 == 0 else 42, start_time_s=-0.0 if i % 2 else 0.0,
                 comm=f"c{i}", rss_bytes=i) for i in range(9)]  # fmt: skip
    b = TimelineBuilder(source="x")
    b.add_bodies("process", odd)
    assert b.decode_paths["json"] == 9
    tl = b.build()
    assert set(tl.processes) == {"42@0.0", "42@-0.0"} and tl.processes["42@0.0"].comm == "c8"
    assert_same(_per_row_of({"process": odd}), tl)


_FLOAT_TEXTS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.sampled_from(["5e-324", "2.2250738585072014e-308", "1.7976931348623157e308", "1E5", "-0.0", "-0", "0.1e1",
                     "9007199254740993", "18446744073709551615", "1e-400", "123456789012345678901234567890"]),
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(_FLOAT_TEXTS, min_size=1, max_size=8))
def test_typed_numbers_are_the_floats_json_gives(texts: list[str]) -> None:
    """Every number typed decoding accepts is the float ``float(json.loads(text))`` gives (ints included)."""
    bodies = [f'{{"kind":"request","ts":1,"arrival":{t},"prompt_tokens":{t}}}' for t in texts]
    rows = fastdecode.decode("request", "[" + ",".join(bodies) + "]")
    assert rows is not None
    for row, text in zip(rows, texts, strict=True):
        expected = float(json.loads(text))
        assert math.copysign(1, row.arrival) == math.copysign(1, expected) and row.arrival == expected, text
        assert row.prompt_tokens == expected


def test_small_byte_batches_equal_per_row(recorder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = _per_row(recorder)
    monkeypatch.setattr(loaders, "BATCH_BYTES", 2000)  # a couple of host rows per batch, a few requests
    builder = loaders._read_part(recorder, None, None, f"recorder:{recorder}")
    assert builder.decode_paths["typed"] and builder.decode_paths["per_row"]  # clean batches typed, odd ones not
    assert_same(reference, builder.build())
    assert loaders.batch_rows(["x" * 1000] * 4) == 2 and loaders.batch_rows(["x"] * 4) == 2000


def test_an_integer_beyond_float_range_is_a_missing_value_not_a_crash(tmp_path: Path) -> None:
    body = _body("process", T0, pid=3, rss_bytes=10**400, pss_bytes=5)
    b = TimelineBuilder()
    b.add_json(body, "process")
    tl = b.build()
    assert tl.counts == {"process": 1} and set(tl.processes["3@None"].series) == {"pss"}


def test_windows_of_one_instant_and_out_of_order_bodies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The windowed reader keeps every row: 30 requests at one instant (more than a window holds), and rows
    whose stored time order disagrees with their bodies' (the joined window is refused; read row by row)."""
    rows = [(T0, "request", 1, _body("request", T0, arrival=T0 - i, finish=T0, route=f"/r{i % 3}")) for i in range(30)]
    rows += [(T0 + 1 + i, "process", 1, _body("process", T0 + 100 - i, pid=9, rss_bytes=i, comm=f"c{i}")) for i in range(20)]
    with FlightRecorder(tmp_path / "r.db") as rec:
        rec.write_rows(rows)
    monkeypatch.setattr(loaders, "BATCH_ROWS", 7)
    tl = loaders.load_recorder(tmp_path / "r.db", workers=1)
    assert tl.counts == {"request": 30, "process": 20}
    assert tl.processes["9@None"].comm == "c19"  # the last row in stored order, not the one with the latest body time
    assert_same(_per_row(tmp_path / "r.db"), tl)


def test_add_array_is_all_or_nothing() -> None:
    bodies = [_body("request", T0 + i, arrival=T0) for i in range(5)]
    b = TimelineBuilder()
    assert not b.add_array("request", "[" + ",".join(reversed(bodies)) + "]", 5, ordered=True)  # times go backwards
    assert not b.add_array("request", "[" + ",".join(bodies) + "]", 4)  # not the count the caller expects
    assert not b.add_array("oom", "[]", 0)  # a kind without typed decoding
    assert b.add_array("request", "[]", 0)  # nothing to take: taken
    assert not b.counts and not b.decode_paths
    assert b.add_array("request", "[" + ",".join(bodies) + "]", 5, ordered=True)
    assert b.counts == {"request": 5}


def test_late_writers_are_read_in_time_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tracker's batch written late sits among later rows, and a process's samples written out of time order: the
    recorder is read in time order, so the requests come in time order and the process gets its latest sample's facts."""
    rows = [(T0 + i, "host", 1, HostSnapshot(ts=T0 + i, memory={"total": i}).to_json()) for i in range(300)]
    late = [RequestTiming(ts=T0 + 5 + i / 10, arrival=T0, finish=T0 + 5 + i / 10, route=f"/r{i}") for i in range(20)]
    rows[250:250] = [(r.ts, r.KIND, r.SCHEMA, r.to_json()) for r in late]  # written at ~T0+250, about T0+5
    swapped = [ProcessSample(ts=T0 + 20 + i, pid=9, comm=f"c{i}", rss_bytes=i) for i in range(6)]
    rows[30:30] = [(p.ts, p.KIND, p.SCHEMA, p.to_json()) for p in reversed(swapped)]  # newest sample written first
    with FlightRecorder(tmp_path / "r.db") as rec:
        rec.write_rows(rows)
    monkeypatch.setattr(loaders, "BATCH_BYTES", 4000)  # many windows
    tl = loaders.load_recorder(tmp_path / "r.db", workers=1)
    assert tl.counts == {"host": 300, "process": 6, "request": 20}
    assert tl.processes["9@None"].comm == "c5" and tl.requests["route"][0] == "/r0"
    assert_same(_per_row(tmp_path / "r.db"), tl)


def _host(i: int, **changes: Any) -> dict[str, Any]:
    line = {"avg10": 0.5 + i, "avg60": 0.25, "avg300": 0.125, "total_us": 1000 * i}
    row: dict[str, Any] = {
        "kind": "host", "schema": 1, "ts": T0 + i,
        "psi": {"memory": {"some": dict(line), "full": dict(line)}, "cpu": {"some": dict(line)}},
        "memory": {"free": 10 * i, "total": 100, "available": None},  # not the declared order: the JSON's is kept
        "vmstat": {"pgmajfault": i}, "missing": {},
    }  # fmt: skip
    for path, value in changes.items():
        *heads, last = path.split(".")
        target = row
        for head in heads:
            target = target[head]
        if value is _DROP:
            target.pop(last, None)
        else:
            target[last] = value
    return row


_DROP = object()
# Batches strict decoding must either read exactly as the json path does, or hand back (key order, keys that come and
# go, keys not declared, absent or empty nested records): row 2 of each batch is changed as given.
_ODD_HOSTS: dict[str, tuple[dict[str, Any], str]] = {
    "clean": ({}, "strict"),
    "a key in a new order": ({"memory": {"total": 100, "available": 3, "free": 20}}, "strict"),
    "a key only some rows have": ({"memory.dirty": 5}, "typed"),
    "a key some rows lack": ({"memory.free": _DROP}, "typed"),
    "a key not declared": ({"vmstat.not_a_counter": 1}, "typed"),
    "a PSI file only some rows have": ({"psi.io": {"some": {"avg10": 1, "avg60": 1, "avg300": 1, "total_us": 1}}},
                                       "typed"),
    "a PSI file some rows lack": ({"psi.cpu": _DROP}, "typed"),
    "a PSI file that is null": ({"psi.cpu": None}, "typed"),
    "a line some rows lack": ({"psi.memory.full": _DROP}, "strict"),
    "an empty line": ({"psi.memory.full": {}}, "typed"),
    "a line lacking a number": ({"psi.memory.some.avg60": _DROP}, "typed"),
    "a line with a key not declared": ({"psi.memory.some.avg1": 3}, "strict"),
    "a null family": ({"memory": None}, "typed"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_ODD_HOSTS))
def test_strict_decoding_reads_what_the_json_path_reads_or_hands_the_batch_back(case: str) -> None:
    """Host rows with meminfo, vmstat and PSI read as records (strict decoding) give the Timeline the per-row path
    gives, and the typed path's series order, and a batch they do not fit goes the typed way."""
    changes, path = _ODD_HOSTS[case]
    bodies = [json.dumps(_host(i, **(changes if i == 2 else {}))) for i in range(6)]
    b = TimelineBuilder(source="x")
    b.add_bodies("host", bodies)
    assert dict(b.decode_paths) == {path: len(bodies)}, case
    typed = TimelineBuilder(source="x")
    assert typed._add_typed("host", builder._BULK["host"], "[" + ",".join(bodies) + "]", len(bodies), strict=False)
    per_row, fast, before = _per_row_of({"host": bodies}), b.build(), typed.build()
    assert_same(per_row, fast)
    assert list(fast.host) == list(before.host), case


def test_strict_batches_follow_their_own_first_rows_key_order() -> None:
    """Each batch's new series come in the order of its first row's keys, across batches and both decodings."""
    first = [json.dumps(_host(i, **{"memory": {"total": 100, "free": i}})) for i in range(3)]
    second = [json.dumps(_host(i, **{"memory": {"dirty": i, "free": i, "total": 100}})) for i in range(3, 6)]
    b, typed = TimelineBuilder(source="x"), TimelineBuilder(source="x")
    for batch in (first, second):
        b.add_bodies("host", batch)
        assert typed._add_typed("host", builder._BULK["host"], "[" + ",".join(batch) + "]", len(batch), strict=False)
    assert b.decode_paths["strict"] == 6
    per_row, fast = _per_row_of({"host": first + second}), b.build()
    assert_same(per_row, fast)
    assert list(fast.host) == list(typed.build().host)
    assert [n for n in fast.host if n.startswith("memory.")] == ["memory.total", "memory.free", "memory.dirty"]
