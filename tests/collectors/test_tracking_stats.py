"""Batches, MoE routing maths, torch allocator snapshot, CUDA OOM messages, and the record hand-off."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
import types
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from collectors import catalog
from collectors.recorder import (
    REQUEST_NO_START_US,
    REQUEST_NO_TRACE_ID,
    REQUEST_NULL,
    REQUEST_ROW_FIELDS,
    FlightRecorder,
    RecorderWriter,
)
from collectors.records import BatchStats, CudaOomError, RequestTiming, RoutingStats, record_from_json
from collectors.tracking import (
    RequestTracker,
    batch_stats,
    capture_cuda_oom,
    parse_cuda_oom_message,
    routing_stats,
    torch_cuda_status,
    torch_memory_snapshot,
)
from collectors.tracking.buffer import RecordBuffer, request_row
from tests.collectors.registry_samples import sample_value

GiB = 1 << 30
MiB = 1 << 20

# --------------------------------------------------------------------------- MoE routing


def test_routing_summary_maths() -> None:
    stats = routing_stats("moe", 3, [10, 2, 4, 4, 0, 20, 4, 4], capacity=8)
    assert stats.top_expert_tokens == 20
    assert stats.median_expert_tokens == 4.0  # sorted: 0 2 4 4 4 4 10 20
    assert stats.skew == 5.0  # 20 / 4
    assert stats.balancedness == pytest.approx((48 / 8) / 20)  # mean 6 / max 20
    assert stats.overflow_tokens == (10 - 8) + (20 - 8)
    assert stats.expert_tokens == [10, 2, 4, 4, 0, 20, 4, 4] and stats.layer == 3


def test_routing_edge_cases() -> None:
    even = routing_stats("moe", 0, [5, 5, 5, 5])
    assert (even.skew, even.balancedness, even.overflow_tokens) == (1.0, 1.0, 0)
    sparse = routing_stats("moe", 0, [0, 0, 0, 9])  # median 0: skew undefined
    assert sparse.skew is None and sparse.balancedness == pytest.approx(0.25)
    idle = routing_stats("moe", 0, [0, 0])
    assert idle.skew is None and idle.balancedness is None
    assert routing_stats("moe", 0, [1, 3]).median_expert_tokens == 2.0  # even count: mean of the middle two
    for bad in ([], [1, -1]):
        with pytest.raises(ValueError):
            routing_stats("moe", 0, bad)


def test_batch_validation() -> None:
    stats = batch_stats("m", requests=4, input_tokens=9000, max_request_tokens=8000, phase="prefill")
    assert (stats.requests, stats.input_tokens, stats.max_request_tokens, stats.phase) == (4, 9000, 8000, "prefill")
    assert batch_stats("m", requests=1, input_tokens=300).max_request_tokens == 300
    for bad in (
        {"requests": -1, "input_tokens": 1},
        {"requests": 2, "input_tokens": 10, "max_request_tokens": 11},
        {"requests": 1, "input_tokens": 1, "phase": "warmup"},
    ):
        with pytest.raises(ValueError):
            batch_stats("m", **bad)  # type: ignore[arg-type]


def test_tracker_records_batches_and_routing(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    tracker = RequestTracker("moe", recorder=tmp_path / "r.db", registry=registry)
    assert tracker.record_batch(requests=2, input_tokens=30000, max_request_tokens=29000, phase="prefill")
    assert tracker.record_batch(requests=64, input_tokens=6400, max_request_tokens=100, phase="prefill")
    assert tracker.record_batch(requests=1, input_tokens=5, max_request_tokens=6) is None  # impossible: counted
    layer0 = tracker.record_routing(0, [100, 1, 1, 1], capacity=50)
    tracker.record_routing(1, [0, 0, 0, 7])
    tracker.close()
    assert layer0 is not None and layer0.skew == 100.0
    with FlightRecorder(tmp_path / "r.db") as rec:
        records = list(rec.read(["batch", "routing"]))
    assert [type(r) for r in records] == [BatchStats, BatchStats, RoutingStats, RoutingStats]
    assert records[2].expert_tokens == [100, 1, 1, 1]  # full counts live in the recorder only
    assert sample_value(registry, catalog.BATCH_INPUT_TOKENS.name + "_count") == 2
    assert sample_value(registry, catalog.BATCH_INPUT_TOKENS.name + "_sum") == 36400
    assert sample_value(registry, catalog.BATCH_REQUESTS.name + "_sum") == 66
    assert sample_value(registry, catalog.MOE_EXPERT_SKEW.name, {"layer": "0"}) == 100.0
    assert math.isinf(sample_value(registry, catalog.MOE_EXPERT_SKEW.name, {"layer": "1"}))
    assert sample_value(registry, catalog.MOE_EXPERT_BALANCEDNESS.name, {"layer": "0"}) == pytest.approx(25.75 / 100)
    assert sample_value(registry, catalog.MOE_EXPERT_OVERFLOW.name, {"layer": "0"}) == 50
    assert sample_value(registry, catalog.TRACKER_ERRORS.name, {"stage": "batch"}) == 1
    # never one series per expert
    expert_series = [s for f in registry.collect() for s in f.samples if "expert" in s.labels or "expert_id" in s.labels]
    assert expert_series == []


# --------------------------------------------------------------------------- CUDA OOM messages

OOM_DOC = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.25 GiB is free. "
    "Process 12345 has 40.00 GiB memory in use. Including non-PyTorch memory, this process has 77.89 GiB memory in use. "
    "Of the allocated memory 60.12 GiB is allocated by PyTorch, and 16.50 GiB is reserved by PyTorch but unallocated. "
    "If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
    "fragmentation.  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
# vLLM worker log (2.x): the process itself listed, no "Including non-PyTorch" sentence
OOM_VLLM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.25 GiB. GPU 1 has a total capacity of 93.02 GiB "
    "of which 1.18 GiB is free. Process 2752205 has 91.82 GiB memory in use. Of the allocated memory 90.63 GiB is "
    "allocated by PyTorch, and 120.54 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is "
    "large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)
# PyTorch 2.1 ("capacty" typo, "0 bytes", max_split_size_mb advice)
OOM_21 = (
    "CUDA out of memory. Tried to allocate 5.96 GiB. GPU 0 has a total capacty of 23.69 GiB of which 5.25 GiB is free. "
    "Process 2006998 has 256.00 MiB memory in use. Including non-PyTorch memory, this process has 18.17 GiB memory in use. "
    "Of the allocated memory 17.88 GiB is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated. If "
    "reserved but unallocated memory is large try setting max_split_size_mb to avoid fragmentation."
)
# PyTorch 1.x
OOM_1X = (
    "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.90 GiB total capacity; 14.95 GiB already "
    "allocated; 9.75 MiB free; 15.07 GiB reserved in total by PyTorch)"
)


def test_parse_the_documented_message() -> None:
    err = parse_cuda_oom_message(OOM_DOC)
    assert isinstance(err, CudaOomError)
    assert err.device == 0
    assert err.tried_to_allocate_bytes == 2 * GiB
    assert err.total_capacity_bytes == round(79.15 * GiB)
    assert err.free_bytes == round(1.25 * GiB)
    assert err.process_in_use_bytes == round(77.89 * GiB)
    assert err.allocated_by_pytorch_bytes == round(60.12 * GiB)
    assert err.reserved_unallocated_bytes == round(16.50 * GiB)
    assert err.other_processes == [{"pid": 12345, "bytes": 40 * GiB}]
    # fragmentation signature the rule looks for: the request fits in the reserved-but-unallocated slack
    assert err.tried_to_allocate_bytes <= err.reserved_unallocated_bytes


def test_parse_other_real_formats() -> None:
    vllm = parse_cuda_oom_message(OOM_VLLM)
    assert vllm is not None and vllm.device == 1
    assert vllm.process_in_use_bytes is None
    assert vllm.reserved_unallocated_bytes == round(120.54 * MiB)
    assert vllm.other_processes == [{"pid": 2752205, "bytes": round(91.82 * GiB)}]
    old21 = parse_cuda_oom_message(OOM_21)
    assert old21 is not None and old21.total_capacity_bytes == round(23.69 * GiB)
    assert old21.reserved_unallocated_bytes == 0
    assert old21.other_processes == [{"pid": 2006998, "bytes": 256 * MiB}]
    v1 = parse_cuda_oom_message(OOM_1X)
    assert v1 is not None
    assert (v1.device, v1.tried_to_allocate_bytes, v1.free_bytes) == (0, 20 * MiB, round(9.75 * MiB))
    assert v1.allocated_by_pytorch_bytes == round(14.95 * GiB)
    assert v1.reserved_unallocated_bytes == round(15.07 * GiB) - round(14.95 * GiB)
    assert parse_cuda_oom_message("RuntimeError: shape mismatch") is None


def test_capture_records_and_reraises(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    tracker = RequestTracker("m", recorder=tmp_path / "r.db", registry=registry)

    class OutOfMemoryError(RuntimeError):  # what torch raises, without torch
        pass

    with pytest.raises(OutOfMemoryError), tracker.capture_cuda_oom():
        raise OutOfMemoryError(OOM_DOC)
    with pytest.raises(KeyError), tracker.capture_cuda_oom():
        raise KeyError("not an OOM")
    seen: list[CudaOomError] = []
    with pytest.raises(OutOfMemoryError), capture_cuda_oom(seen.append):
        raise OutOfMemoryError(OOM_VLLM)
    tracker.close()
    assert len(seen) == 1 and seen[0].device == 1
    with FlightRecorder(tmp_path / "r.db") as rec:
        (stored,) = rec.read(["cuda_oom"])
    assert isinstance(stored, CudaOomError) and stored.reserved_unallocated_bytes == round(16.5 * GiB)
    assert sample_value(registry, catalog.CUDA_OOM_ERRORS.name, {"device": "0"}) == 1


# --------------------------------------------------------------------------- torch allocator


def test_torch_absent_gives_an_empty_snapshot() -> None:
    if "torch" in sys.modules or torch_cuda_status() is None:
        pytest.skip("torch with CUDA is importable here")
    snap = torch_memory_snapshot(0)
    assert snap.device == 0 and snap.allocated_bytes is None and snap.reserved_bytes is None
    assert torch_cuda_status() is not None


def test_torch_snapshot_from_memory_stats(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No GPU here: a stand-in ``torch`` module is injected at the import boundary (mocked, by necessity)."""
    stats = {
        "allocated_bytes.all.current": 60 * GiB,
        "reserved_bytes.all.current": 76 * GiB,
        "allocated_bytes.all.peak": 70 * GiB,
        "reserved_bytes.all.peak": 78 * GiB,
        "num_ooms": 2,
        "num_alloc_retries": 17,
    }
    fake = types.ModuleType("torch")
    fake.cuda = types.SimpleNamespace(is_available=lambda: True, memory_stats=lambda device: stats)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", fake)
    registry = CollectorRegistry()
    tracker = RequestTracker("m", recorder=tmp_path / "r.db", registry=registry)
    snap = tracker.record_torch_memory(1)
    tracker.close()
    assert (snap.device, snap.allocated_bytes, snap.reserved_bytes) == (1, 60 * GiB, 76 * GiB)
    assert (snap.peak_allocated_bytes, snap.peak_reserved_bytes, snap.num_ooms, snap.num_alloc_retries) == (
        70 * GiB, 78 * GiB, 2, 17,
    )  # fmt: skip
    assert sample_value(registry, catalog.TORCH_MEMORY["reserved"].name, {"device": "1"}) == 76 * GiB
    with FlightRecorder(tmp_path / "r.db") as rec:
        assert rec.count("torch_memory") == 1


# --------------------------------------------------------------------------- the record hand-off


def _row_and_record(fields: dict[str, object]) -> tuple[tuple, RequestTiming]:
    base = {"arrival": 1796045020.1000004, "start": None, "finish": 1796045021.0, "outcome": "ok", "route": "/r",
            "model": "m", "prompt_tokens": None, "output_tokens": None, "ttft_s": None, "pid": 42, "trace_id": None}  # fmt: skip
    f = {**base, **fields}
    row = request_row(**f)  # type: ignore[arg-type]
    assert row is not None, f
    return row, RequestTiming(ts=f["finish"], **f)  # type: ignore[arg-type]


def _assert_same_record(text: str, expected: RequestTiming) -> None:
    generic = RequestTiming.to_json(expected)
    assert list(json.loads(text)) == list(json.loads(generic))  # same keys, same order
    back = record_from_json(text)
    assert isinstance(back, RequestTiming)
    for name, value in dataclasses.asdict(record_from_json(generic)).items():
        got = getattr(back, name)
        if name in ("ts", "arrival", "start", "finish") and value is not None:
            assert got == pytest.approx(value, abs=1e-6)  # timestamps: microseconds
        elif name == "ttft_s" and value is not None:
            assert got == pytest.approx(value, rel=1e-14)  # SQLite writes REALs with 15 significant digits
        else:
            assert got == value, name


@pytest.mark.parametrize(
    "fields",
    [
        {"start": None, "prompt_tokens": None, "trace_id": None, "outcome": "rejected"},
        {"start": 1796045020.5, "prompt_tokens": 12, "output_tokens": 0, "ttft_s": 1e-7, "trace_id": "ab" * 16},
        {"start": 1796045020.2, "route": '/v1/"quoted"\\path\u00e9\n', "model": "m\u4e2d"},
        {"arrival": 1796045020.0, "start": 1796045020.000001, "finish": 1796045021.999999},  # carries at the second
        {"arrival": 0.0000004, "start": 0.5, "finish": 1.0, "ttft_s": 2.0},  # tiny values still round-trip
    ],
)
def test_sqlite_renders_the_generic_json(fields: dict[str, object], tmp_path: Path) -> None:
    """A request row, rendered to JSON by SQLite inside the INSERT, is the record ``Record.to_json`` writes."""
    row, expected = _row_and_record(fields)
    with FlightRecorder(tmp_path / "r.db") as rec:
        assert rec.write_request_rows([row]) == 1
        ((ts, kind, schema, body),) = rec._db.execute("SELECT ts, kind, schema, body FROM records").fetchall()
    assert (kind, schema) == ("request", RequestTiming.SCHEMA) and ts == pytest.approx(expected.ts, abs=1e-6)
    _assert_same_record(body, expected)


def test_request_rows_bind_no_none_and_hand_built_null_rows_render_alike(tmp_path: Path) -> None:
    """``request_row`` binds sentinels, never None (Python's sqlite3 sends each None through its costly
    adapter lookup); a row holding SQL NULLs instead -- built by hand, or by an older caller -- still
    renders the very same record."""
    row, expected = _row_and_record({"start": None, "prompt_tokens": None, "ttft_s": None, "trace_id": None})
    assert None not in row
    nulls = tuple(
        None if name in ("start_us", "prompt_tokens", "output_tokens", "ttft_s", "pid", "trace_id_hex") and v is not None
        and v in (REQUEST_NULL, REQUEST_NO_START_US, REQUEST_NO_TRACE_ID) else v
        for name, v in zip(REQUEST_ROW_FIELDS, row, strict=True)
    )  # fmt: skip
    assert nulls.count(None) == 5  # start, both token counts, ttft, trace id (pid is set)
    with FlightRecorder(tmp_path / "r.db") as rec:
        assert rec.write_request_rows([row, nulls]) == 2
        bodies = [b for (b,) in rec._db.execute("SELECT body FROM records ORDER BY id")]
    assert bodies[0] == bodies[1]
    _assert_same_record(bodies[1], expected)


_times = st.floats(min_value=0.0, max_value=4e9, allow_nan=False)
_counts = st.none() | st.integers(min_value=0, max_value=2**62)


@settings(max_examples=150, deadline=None)
@given(
    arrival=_times, start=st.none() | _times, finish=_times, outcome=st.sampled_from(["ok", "error", "rejected"]),
    route=st.text(max_size=40), model=st.text(max_size=20), prompt_tokens=_counts, output_tokens=_counts,
    ttft_s=st.none() | st.floats(min_value=0.0, max_value=1e6, allow_nan=False),
    pid=st.none() | st.integers(min_value=1, max_value=2**22),
    trace_id=st.none() | st.from_regex(r"[0-9a-f]{32}", fullmatch=True),
)  # fmt: skip
def test_sqlite_rendering_matches_for_any_request(tmp_path_factory: pytest.TempPathFactory, **fields: object) -> None:
    row, expected = _row_and_record(fields)
    with FlightRecorder(tmp_path_factory.mktemp("r") / "r.db") as rec:
        rec.write([], [row, row])  # the mixed path: records and request rows in one transaction
        bodies = [b for (b,) in rec._db.execute("SELECT body FROM records")]
    assert len(bodies) == 2
    _assert_same_record(bodies[0], expected)


@pytest.mark.parametrize(
    "fields",
    [{"finish": float("nan")}, {"arrival": -1.0}, {"start": 1e12}, {"prompt_tokens": 3.0}, {"ttft_s": float("inf")},
     {"trace_id": 'x"y'}],
)  # fmt: skip
def test_request_row_refuses_what_sqlite_would_render_wrong(fields: dict[str, object]) -> None:
    base = {"arrival": 1.0, "start": None, "finish": 2.0, "outcome": "ok", "route": "/r", "model": "m", "prompt_tokens": None,
            "output_tokens": None, "ttft_s": None, "pid": 1, "trace_id": None}  # fmt: skip
    assert request_row(**{**base, **fields}) is None  # type: ignore[arg-type]


def test_tracker_records_odd_requests_through_the_generic_path(tmp_path: Path) -> None:
    """A request the row path refuses (a float token count) is still recorded, as a plain record."""
    tracker = RequestTracker("m", recorder=tmp_path / "r.db", registry=CollectorRegistry())
    with tracker.request(route="/odd") as req:
        req.acquire_sync()
        req.prompt_tokens = 7.5  # type: ignore[assignment]  # the attribute is public; set_prompt_tokens would int() it
    with tracker.request(route="/even") as req:
        req.acquire_sync()
        req.set_prompt_tokens(8)
    tracker.close()
    with FlightRecorder(tmp_path / "r.db") as rec:
        got = sorted(((r.route, r.prompt_tokens) for r in rec.read(["request"])), key=str)
    assert got == [("/even", 8), ("/odd", 7.5)]


def test_buffer_counts_what_it_cannot_keep(tmp_path: Path) -> None:
    drops: list[tuple[str, int]] = []
    writer = RecorderWriter(tmp_path / "r.db")
    buffer = RecordBuffer(writer, max_pending=3, batch_size=1000, interval_s=60, on_drop=lambda s, n: drops.append((s, n)))
    now = time.time()  # recent: the recorder trims rows past its retention
    records = [RequestTiming(ts=now + i, arrival=now, finish=now + i) for i in range(5)]
    kept = [buffer.submit(r) for r in records]
    assert kept == [True, True, True, False, False]
    assert drops == [("recorder_drop", 1), ("recorder_drop", 1)]
    buffer.close()
    with FlightRecorder(tmp_path / "r.db") as rec:
        assert [r.ts - now for r in rec.read(["request"])] == pytest.approx([0.0, 1.0, 2.0], abs=1e-5)


def test_buffer_hands_over_whole_batches(tmp_path: Path) -> None:
    writer = RecorderWriter(tmp_path / "r.db")
    buffer = RecordBuffer(writer, batch_size=10, interval_s=60)
    now = time.time()
    for i in range(25):  # records and request rows share the batches
        if i % 2:
            buffer.submit(RequestTiming(ts=now, arrival=now, finish=now))
        else:
            buffer.submit(request_row(now, None, now, "ok", "/r", "m", None, None, None, 1, None))  # type: ignore[arg-type]
    # two full batches went to the writer from the submitting thread; 5 wait for the timer or a flush
    assert len(buffer._pending) == 5
    assert buffer.flush()
    assert writer.written == 25
    buffer.close()


# --------------------------------------------------------------------------- loader decorator


def test_track_loader_decorates_sync_and_async_functions(tmp_path: Path) -> None:
    import asyncio

    tracker = RequestTracker("m", recorder=tmp_path / "r.db", registry=CollectorRegistry())

    @tracker.track_loader("sync-load", bytes_read=10, cache_hit=True)
    def load(x: int) -> int:
        return x * 2

    @tracker.track_loader("async-load", cache_hit=False)
    async def aload(x: int) -> int:
        await asyncio.sleep(0)
        return x + 1

    @tracker.track_loader("failing-load")
    def broken() -> None:
        raise OSError("checkpoint missing")

    assert load(3) == 6 and load(4) == 8
    assert asyncio.run(aload(1)) == 2
    with pytest.raises(OSError):
        broken()
    # waiting request in flight (arrived, no slot yet): a loader now is on its path
    req = tracker.request("/x")
    assert load(5) == 10
    req.finish()
    tracker.close()
    with FlightRecorder(tmp_path / "r.db") as rec:
        events = list(rec.read(["loader"]))
    assert [(e.name, e.in_request_path) for e in events] == [  # type: ignore[attr-defined]
        ("sync-load", False), ("sync-load", False), ("async-load", False), ("failing-load", False), ("sync-load", True),
    ]  # fmt: skip
    assert events[0].bytes_read == 10 and events[0].cache_hit is True  # type: ignore[attr-defined]
