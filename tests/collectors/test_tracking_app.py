"""The tracker inside a real FastAPI app, served by uvicorn on 127.0.0.1, driven by real HTTP.

This module also holds the test app (``make_app``, ``app_from_env``) and the in-thread server
helper that the other tracking tests reuse (the multiprocess test starts ``app_from_env`` under
``uvicorn --workers 2``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from collectors import catalog
from collectors.recorder import FlightRecorder
from collectors.records import REQUEST_OUTCOMES, LoaderEvent, RequestTiming
from collectors.tracking import AdmissionConfig, RequestTracker, instrument_fastapi
from tests.collectors.registry_samples import sample_value

pytestmark = pytest.mark.process

# --------------------------------------------------------------------------- the test app


def make_app(tracker: RequestTracker, ratio: float | None = None, tracer_provider: Any = None) -> FastAPI:
    """A small LLM-like service: every endpoint uses the tracker the way a real backend would."""
    app = FastAPI()
    gate = threading.Event()
    app.state.gate = gate
    app.state.tracker = tracker

    @app.get("/work")
    async def work(ms: float = 20.0) -> dict[str, Any]:
        async with tracker.request(route="/work") as req:
            await req.acquire()
            req.set_prompt_tokens(7)
            await asyncio.sleep(ms / 1000.0)
            req.set_output_tokens(3)
            return {"pid": os.getpid()}

    @app.get("/hold")
    async def hold() -> dict[str, Any]:
        async with tracker.request(route="/hold") as req:
            await req.acquire()
            while not gate.is_set():
                await asyncio.sleep(0.005)
            return {"pid": os.getpid()}

    @app.get("/release")
    def release() -> dict[str, bool]:
        gate.set()
        return {"released": True}

    @app.get("/slow")
    async def slow() -> dict[str, Any]:
        async with tracker.request(route="/slow") as req:
            await req.run(asyncio.sleep(30))
            return {"finished": True}

    @app.get("/boom")
    async def boom() -> dict[str, Any]:
        async with tracker.request(route="/boom") as req:
            await req.acquire()
            raise RuntimeError("model crashed")

    @app.get("/sync")
    def sync(ms: float = 10.0) -> dict[str, Any]:
        with tracker.request(route="/sync") as req:
            req.acquire_sync()
            for _ in range(3):
                time.sleep(ms / 3000.0)
                req.check_deadline()
            return {"thread": threading.current_thread().name}

    @app.get("/refresh")
    async def refresh() -> dict[str, Any]:
        async with tracker.request(route="/refresh") as req:
            # the bug this detects: a registry refresh on the request path, before the slot
            with tracker.track_loader("registry-refresh", cache_hit=False) as load:
                time.sleep(0.02)
                load.bytes_read = 4096
            await req.acquire()
            return {"in_request_path": load.event.in_request_path if load.event else None}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        req = tracker.request(route="/stream")  # arrival now; the block lives in the generator

        async def tokens() -> Any:
            async with req:
                await req.acquire()
                for i in range(3):
                    await asyncio.sleep(0.002)
                    if i == 0:
                        req.first_token()
                    yield f"tok{i} "
                req.set_output_tokens(3)

        return StreamingResponse(tokens(), media_type="text/plain")

    instrument_fastapi(app, tracker, ratio, tracer_provider=tracer_provider, metrics_path="/metrics", health_path="/health")
    return app


def app_from_env() -> FastAPI:
    """Factory for ``uvicorn --factory`` (subprocess tests): configured by LLMDIAG_TEST_* variables."""
    env = os.environ
    admission = AdmissionConfig(
        max_concurrency=int(env["LLMDIAG_TEST_MAX_CONCURRENCY"]) if env.get("LLMDIAG_TEST_MAX_CONCURRENCY") else None,
        queue_size=int(env["LLMDIAG_TEST_QUEUE_SIZE"]) if env.get("LLMDIAG_TEST_QUEUE_SIZE") else None,
        memory_high_watermark=float(env["LLMDIAG_TEST_WATERMARK"]) if env.get("LLMDIAG_TEST_WATERMARK") else None,
    )
    tracker = RequestTracker(
        model=env.get("LLMDIAG_TEST_MODEL", "test"),
        recorder=env.get("LLMDIAG_TEST_RECORDER") or False,
        admission=admission,
        span_sample_ratio=float(env.get("LLMDIAG_TEST_RATIO", "0")),
    )
    return make_app(tracker)


@contextlib.contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Run ``app`` with uvicorn in a thread on an ephemeral 127.0.0.1 port; yield its base URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


def read_requests(path: Path) -> list[RequestTiming]:
    with FlightRecorder(path) as rec:
        return [r for r in rec.read(["request"]) if isinstance(r, RequestTiming)]


@pytest.fixture
def spans() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _tracker(tmp_path: Path, registry: CollectorRegistry, provider: Any = None, **kwargs: Any) -> RequestTracker:
    admission = kwargs.pop("admission", AdmissionConfig())
    return RequestTracker(
        model="m",
        recorder=tmp_path / "rec.db",
        admission=admission,
        registry=registry,
        tracer_provider=provider,
        span_sample_ratio=kwargs.pop("ratio", 0.0),
        **kwargs,
    )


async def _gather(base: str, paths: list[str], timeout: float = 30.0) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base, timeout=timeout) as client:
        return await asyncio.gather(*(client.get(p) for p in paths))


# --------------------------------------------------------------------------- counting


def test_every_request_is_counted_exactly_once(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    tracker = _tracker(tmp_path, registry)
    app = make_app(tracker)
    n_ok, n_err = 40, 5
    with serve(app) as base:
        responses = asyncio.run(_gather(base, ["/work?ms=5"] * n_ok + ["/boom"] * n_err))
        with httpx.Client(base_url=base) as client:  # a streamed request, end to end
            assert client.get("/stream").text == "tok0 tok1 tok2 "
    tracker.close()
    assert sorted(r.status_code for r in responses) == [200] * n_ok + [500] * n_err
    rows = read_requests(tmp_path / "rec.db")
    total = n_ok + n_err + 1
    assert len(rows) == total
    by_outcome = {o: sum(1 for r in rows if r.outcome == o) for o in REQUEST_OUTCOMES}
    assert by_outcome == {"ok": n_ok + 1, "error": n_err, "queue_timeout": 0, "inference_timeout": 0, "rejected": 0}
    assert sample_value(registry, catalog.REQUESTS.name) == total
    assert sample_value(registry, catalog.REQUESTS.name, {"outcome": "error", "route": "/boom"}) == n_err
    assert sample_value(registry, catalog.REQUEST_E2E.name + "_count") == total
    assert sample_value(registry, catalog.REQUEST_INFERENCE.name + "_count") == total
    assert sample_value(registry, catalog.REQUEST_QUEUE_WAIT.name + "_count") == total
    assert sample_value(registry, catalog.ACTIVE_INFERENCES.name) == 0
    assert sample_value(registry, catalog.QUEUE_DEPTH.name) == 0
    work = [r for r in rows if r.route == "/work"]
    assert all(r.prompt_tokens == 7 and r.output_tokens == 3 and r.pid == os.getpid() for r in work)
    assert all(r.arrival <= r.start <= r.finish for r in rows if r.start is not None)
    streamed = next(r for r in rows if r.route == "/stream")
    assert streamed.ttft_s is not None and 0 < streamed.ttft_s <= streamed.finish - streamed.arrival
    assert sample_value(registry, catalog.REQUEST_TTFT.name + "_count") == 1


def test_one_slot_serialises_inference_and_the_wait_grows_in_the_queue(tmp_path: Path) -> None:
    """Five requests queue behind a held slot, then run one at a time.

    The holder keeps the slot until all five are seen queued, so every queued request arrived
    before the slot came free: its wait is then exactly the inference that ran ahead of it (plus
    what was left of the holder), whatever the host's speed. Assuming the five arrive together
    instead (each waiting the sum of all earlier inference) failed on a loaded host where the
    first request began running before the last had even connected."""
    registry = CollectorRegistry()
    tracker = _tracker(tmp_path, registry, admission=AdmissionConfig(max_concurrency=1))
    app = make_app(tracker)
    with serve(app) as base:

        async def scenario() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                holder = asyncio.create_task(client.get("/hold"))
                await _until(lambda: tracker.health()["active_inference"] == 1)
                queued = [asyncio.create_task(client.get("/work?ms=40")) for _ in range(5)]
                await _until(lambda: tracker.health()["queue_depth"] == 5)
                await client.get("/release")
                return [await holder, *[await q for q in queued]]

        responses = asyncio.run(scenario())
    tracker.close()
    assert [r.status_code for r in responses] == [200] * 6
    rows = sorted(read_requests(tmp_path / "rec.db"), key=lambda r: r.start or 0)
    assert [r.route for r in rows] == ["/hold"] + ["/work"] * 5
    # one slot: inference intervals never overlap, and each starts when the one before it ends
    for before, after in itertools.pairwise(rows):
        assert before.finish <= after.start + 1e-6
    work = rows[1:]
    released = rows[0].finish
    assert all(r.arrival < released for r in work)  # all five were queued before the slot came free
    for k, row in enumerate(work):
        # the wait is the time from arrival to the slot: the holder's remainder plus everything ahead
        assert row.queue_wait_s == pytest.approx(row.start - row.arrival, abs=1e-3)
        ahead = sum(r.inference_s or 0.0 for r in work[:k])
        assert row.queue_wait_s >= (released - row.arrival) + ahead - 1e-3
        assert (row.inference_s or 0.0) >= 0.04 - 1e-3  # its own work is only its 40 ms
    # backlog, not slowness: the last request waited for four others' 40 ms each, at least
    assert work[-1].queue_wait_s >= 4 * 0.04 - 1e-3
    assert sample_value(registry, catalog.ADMISSION_MAX_CONCURRENCY.name, {"model": "m"}) == 1


async def _until(condition: Any, deadline_s: float = 20.0) -> None:
    """Poll ``condition`` until it holds (a failure names the deadline rather than hanging)."""
    stop = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > stop:
            raise AssertionError(f"condition not met within {deadline_s} s")
        await asyncio.sleep(0.005)


# --------------------------------------------------------------------------- refusals


def test_full_queue_is_refused_with_429_and_counted_as_rejected(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    tracker = _tracker(tmp_path, registry, admission=AdmissionConfig(max_concurrency=1, queue_size=1, retry_after_s=2.0))
    app = make_app(tracker)
    with serve(app) as base:

        async def scenario() -> tuple[list[httpx.Response], dict[str, Any]]:
            async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                holder = asyncio.create_task(client.get("/hold"))  # takes the slot
                while tracker.health()["active_inference"] < 1:
                    await asyncio.sleep(0.005)
                queued = asyncio.create_task(client.get("/hold"))  # fills the queue
                while tracker.health()["queue_depth"] < 1:
                    await asyncio.sleep(0.005)
                health = (await client.get("/health")).json()
                refused = await asyncio.gather(*(client.get("/work") for _ in range(3)))
                await client.get("/release")
                return [await holder, await queued, *refused], health

        responses, health = asyncio.run(scenario())
    tracker.close()
    assert [r.status_code for r in responses] == [200, 200, 429, 429, 429]
    assert all(r.headers["retry-after"] == "2" for r in responses[2:])
    assert responses[2].json()["error"] == "queue_full"
    assert health["status"] == "degraded" and health["accepting_new_requests"] is False
    assert health["reasons"] == ["queue_full"]
    rows = read_requests(tmp_path / "rec.db")
    assert sorted(r.outcome for r in rows) == ["ok", "ok", "rejected", "rejected", "rejected"]
    assert all(r.start is None for r in rows if r.outcome == "rejected")
    assert sample_value(registry, catalog.REQUESTS.name) == 5
    assert sample_value(registry, catalog.REQUESTS.name, {"outcome": "rejected"}) == 3
    assert sample_value(registry, catalog.ADMISSION_REJECTIONS.name, {"reason": "queue_full"}) == 3
    assert sample_value(registry, catalog.REQUEST_E2E.name + "_count") == 2  # refusals are not latency samples


def test_queue_timeout_gives_503_and_its_own_outcome(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    tracker = _tracker(tmp_path, registry, admission=AdmissionConfig(max_concurrency=1, queue_timeout_s=0.1))
    with serve(make_app(tracker)) as base:

        async def scenario() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                holder = asyncio.create_task(client.get("/hold"))
                while tracker.health()["active_inference"] < 1:
                    await asyncio.sleep(0.005)
                timed_out = await client.get("/work")
                await client.get("/release")
                return [await holder, timed_out, await client.get("/work")]

        responses = asyncio.run(scenario())
    tracker.close()
    assert [r.status_code for r in responses] == [200, 503, 200]
    assert responses[1].json()["outcome"] == "queue_timeout"
    assert "retry-after" in responses[1].headers
    rows = read_requests(tmp_path / "rec.db")
    timed = [r for r in rows if r.outcome == "queue_timeout"]
    assert len(timed) == 1 and timed[0].start is None
    assert timed[0].finish - timed[0].arrival >= 0.1
    assert sample_value(registry, catalog.REQUESTS.name, {"outcome": "queue_timeout"}) == 1
    # the wait of a timed-out request is observed (a backlog must not hide behind censoring)
    assert sample_value(registry, catalog.REQUEST_QUEUE_WAIT.name + "_count") == 3
    assert sample_value(registry, catalog.QUEUE_DEPTH.name) == 0


def test_inference_timeout_cancels_the_work_and_gives_504(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    tracker = _tracker(tmp_path, registry, admission=AdmissionConfig(max_concurrency=2, inference_timeout_s=0.1))
    with serve(make_app(tracker)) as base, httpx.Client(base_url=base, timeout=30) as client:
        started = time.monotonic()
        response = client.get("/slow")
        elapsed = time.monotonic() - started
        health = client.get("/health").json()
    tracker.close()
    assert response.status_code == 504
    assert response.json()["outcome"] == "inference_timeout"
    assert elapsed < 10  # the 30 s sleep was cancelled, not waited for
    assert health["active_inference"] == 0  # the slot came back
    (row,) = read_requests(tmp_path / "rec.db")
    assert row.outcome == "inference_timeout" and row.start is not None
    assert sample_value(registry, catalog.REQUESTS.name, {"outcome": "inference_timeout"}) == 1


def test_memory_guard_refuses_with_503_and_health_degrades(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    tracker = _tracker(tmp_path, registry, admission=AdmissionConfig(memory_high_watermark=0.0001))
    with serve(make_app(tracker)) as base, httpx.Client(base_url=base) as client:
        refused = client.get("/work")
        health = client.get("/health")
    tracker.close()
    assert refused.status_code == 503
    assert refused.json()["error"] == "memory_watermark"
    assert "retry-after" in refused.headers
    assert health.status_code == 503
    body = health.json()
    assert body["status"] == "degraded" and body["accepting_new_requests"] is False
    assert body["reasons"] == ["memory_watermark"]
    assert body["memory_used_percent"] > 0.01 and body["memory_limit_bytes"] > 0
    (row,) = read_requests(tmp_path / "rec.db")
    assert row.outcome == "rejected"
    assert sample_value(registry, catalog.ADMISSION_REJECTIONS.name, {"reason": "memory_watermark"}) == 1
    assert sample_value(registry, catalog.MEMORY_GUARD_ACCEPTING.name, {"model": "m"}) == 0
    assert sample_value(registry, catalog.MEMORY_GUARD_USED.name, {"model": "m"}) > 0.0001


def test_health_is_ok_when_nothing_is_refused(tmp_path: Path) -> None:
    tracker = _tracker(tmp_path, CollectorRegistry(), admission=AdmissionConfig(memory_high_watermark=1.0))
    with serve(make_app(tracker)) as base, httpx.Client(base_url=base) as client:
        assert client.get("/work").status_code == 200
        health = client.get("/health")
    tracker.close()
    assert health.status_code == 200
    assert health.json()["status"] == "ok" and health.json()["accepting_new_requests"] is True


# --------------------------------------------------------------------------- spans


def test_llm_spans_are_children_of_the_server_span(tmp_path: Path, spans: Any) -> None:
    provider, exporter = spans
    tracker = _tracker(tmp_path, CollectorRegistry(), provider, ratio=1.0, queue_span_min_s=0.0)
    with serve(make_app(tracker)) as base, httpx.Client(base_url=base) as client:
        assert client.get("/work").status_code == 200
    tracker.close()
    finished = exporter.get_finished_spans()
    server = [s for s in finished if s.name == "GET /work"]
    assert len(server) == 1, [s.name for s in finished]
    queue = [s for s in finished if s.name == "llm.queue"]
    inference = [s for s in finished if s.name == "llm.inference"]
    assert len(queue) == 1 and len(inference) == 1
    # exclude_spans=["send","receive"]: no http send/receive spans
    assert not [s for s in finished if s.name.endswith(("http send", "http receive"))]
    for child in (queue[0], inference[0]):
        assert child.parent is not None and child.parent.span_id == server[0].context.span_id
        assert child.context.trace_id == server[0].context.trace_id
        assert child.attributes["gen_ai.operation.name"] == "text_completion"
        assert child.attributes["gen_ai.request.model"] == "m"
        assert child.attributes["gen_ai.provider.name"] == "llm-diag"
    assert inference[0].attributes["gen_ai.usage.input_tokens"] == 7
    assert inference[0].attributes["gen_ai.usage.output_tokens"] == 3
    assert inference[0].attributes["llm_diag.outcome"] == "ok" and inference[0].attributes["llm_diag.route"] == "/work"
    assert queue[0].end_time <= inference[0].start_time + 1000
    (row,) = read_requests(tmp_path / "rec.db")
    assert row.trace_id == format(server[0].context.trace_id, "032x")


def test_queue_span_only_when_the_request_waited(tmp_path: Path, spans: Any) -> None:
    provider, exporter = spans

    # Each step waits for what it needs, not for a time that stands for it: the slot is released once the request
    # has queued and then 0.3 s passed (it arrived before it queued: it waited at least that), or once its queue
    # timeout has answered it. Timed from the client's send instead, a send that a loaded host delayed by 0.1 s
    # would give a wait under the 0.2 s that makes a queue span, and a release delayed by 0.2 s would come after the
    # 0.5 s queue timeout. So the request that waits and then runs has no queue timeout to race (a tracker of its own).
    async def behind_a_holder(base: str, app: FastAPI, tracker: RequestTracker, gives_up: bool) -> list[httpx.Response]:
        app.state.gate.clear()
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            holder = asyncio.create_task(client.get("/hold"))  # an instant grant
            while tracker.health()["active_inference"] < 1:
                await asyncio.sleep(0.005)
            queued = asyncio.create_task(client.get("/work?ms=1"))
            while tracker.health()["queue_depth"] < 1 and not queued.done():
                await asyncio.sleep(0.005)
            if gives_up:
                await asyncio.wait({queued})  # its queue timeout answers it while the holder keeps the slot
            else:
                await asyncio.sleep(0.3)
            app.state.gate.set()
            return [await holder, await queued]

    responses: list[httpx.Response] = []
    for name, queue_timeout_s in (("waits", None), ("gives-up", 0.5)):
        (tmp_path / name).mkdir()
        tracker = _tracker(
            tmp_path / name, CollectorRegistry(), provider, ratio=1.0, queue_span_min_s=0.2,
            admission=AdmissionConfig(max_concurrency=1, queue_timeout_s=queue_timeout_s),
        )  # fmt: skip
        app = make_app(tracker)
        with serve(app) as base:
            responses += asyncio.run(behind_a_holder(base, app, tracker, gives_up=queue_timeout_s is not None))
        tracker.close()
    assert [r.status_code for r in responses] == [200, 200, 200, 503]
    by_trace: dict[int, dict[str, Any]] = {}
    for span in exporter.get_finished_spans():
        by_trace.setdefault(span.context.trace_id, {})[span.name] = span
    kinds = sorted(sorted(n for n in names if n.startswith("llm.")) for names in by_trace.values())
    # two instant grants: inference only; the one that waited 0.3 s: both; the timed-out one: queue only
    assert kinds == [["llm.inference"], ["llm.inference"], ["llm.inference", "llm.queue"], ["llm.queue"]]
    for names in by_trace.values():
        if "llm.inference" in names and "llm.queue" in names:
            assert names["llm.inference"].attributes["gen_ai.latency.time_in_queue"] >= 0.2
        elif "llm.queue" in names:
            assert names["llm.queue"].attributes["llm_diag.outcome"] == "queue_timeout"
        else:
            assert names["llm.inference"].attributes["gen_ai.latency.time_in_queue"] < 0.2


def test_sampling_zero_makes_no_llm_spans_and_no_server_span(tmp_path: Path, spans: Any) -> None:
    provider, exporter = spans
    tracker = _tracker(tmp_path, CollectorRegistry(), provider, ratio=0.0)
    with serve(make_app(tracker)) as base, httpx.Client(base_url=base) as client:
        for _ in range(20):
            assert client.get("/work?ms=1").status_code == 200
        # a caller's sampled trace still gets its server span (OTel parent-based sampling), but
        # ratio 0 means no llm.* spans at all
        parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        assert client.get("/work?ms=1", headers={"traceparent": parent}).status_code == 200
    tracker.close()
    finished = exporter.get_finished_spans()
    assert [s.name for s in finished] == ["GET /work"]
    assert format(finished[0].context.trace_id, "032x") == "4bf92f3577b34da6a3ce929d0e0e4736"
    rows = read_requests(tmp_path / "rec.db")
    assert len(rows) == 21 and not any(r.trace_id for r in rows)


def test_a_sampled_traceparent_is_traced_below_the_ratio(tmp_path: Path, spans: Any) -> None:
    provider, exporter = spans
    tracker = _tracker(tmp_path, CollectorRegistry(), provider, ratio=0.0001, queue_span_min_s=0.0)
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    unsampled = "00-5bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
    with serve(make_app(tracker)) as base, httpx.Client(base_url=base) as client:
        assert client.get("/work?ms=1", headers={"traceparent": parent}).status_code == 200
        assert client.get("/work?ms=1", headers={"traceparent": unsampled}).status_code == 200
    tracker.close()
    finished = exporter.get_finished_spans()
    assert sorted(s.name for s in finished) == ["GET /work", "llm.inference", "llm.queue"]
    assert {format(s.context.trace_id, "032x") for s in finished} == {"4bf92f3577b34da6a3ce929d0e0e4736"}


def test_partial_sampling_keeps_traces_whole(tmp_path: Path, spans: Any) -> None:
    provider, exporter = spans
    tracker = _tracker(tmp_path, CollectorRegistry(), provider, ratio=0.5, queue_span_min_s=0.0)
    with serve(make_app(tracker)) as base, httpx.Client(base_url=base) as client:
        for _ in range(60):
            assert client.get("/work?ms=1").status_code == 200
    tracker.close()
    by_trace: dict[int, list[str]] = {}
    for span in exporter.get_finished_spans():
        by_trace.setdefault(span.context.trace_id, []).append(span.name)
    # every traced request has all three spans; sampled-out requests have none at all
    assert all(sorted(v) == ["GET /work", "llm.inference", "llm.queue"] for v in by_trace.values())
    assert 5 <= len(by_trace) <= 55  # ~30 of 60; a fair coin essentially never leaves this range


# --------------------------------------------------------------------------- threads, loaders


def test_sync_handlers_share_the_slots_from_worker_threads(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    tracker = _tracker(tmp_path, registry, admission=AdmissionConfig(max_concurrency=1))
    with serve(make_app(tracker)) as base:
        responses = asyncio.run(_gather(base, ["/sync?ms=30"] * 4 + ["/work?ms=30"] * 4))
    tracker.close()
    assert all(r.status_code == 200 for r in responses)
    assert any(r.json().get("thread", "MainThread") != "MainThread" for r in responses[:4])
    rows = sorted(read_requests(tmp_path / "rec.db"), key=lambda r: r.start or 0)
    assert len(rows) == 8 and {r.route for r in rows} == {"/sync", "/work"}
    for before, after in itertools.pairwise(rows):  # one slot across threads and the loop
        assert before.finish <= after.start + 1e-6


def test_sync_deadline_raises_inference_timeout(tmp_path: Path) -> None:
    tracker = _tracker(tmp_path, CollectorRegistry(), admission=AdmissionConfig(inference_timeout_s=0.01))
    with serve(make_app(tracker)) as base, httpx.Client(base_url=base) as client:
        response = client.get("/sync?ms=90")
    tracker.close()
    assert response.status_code == 504
    (row,) = read_requests(tmp_path / "rec.db")
    assert row.outcome == "inference_timeout"


def test_loader_on_the_request_path_is_flagged(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    tracker = _tracker(tmp_path, registry)
    with serve(make_app(tracker)) as base, httpx.Client(base_url=base) as client:
        flagged = client.get("/refresh").json()["in_request_path"]
    with tracker.track_loader("background-refresh", cache_hit=True) as idle_load:
        time.sleep(0.005)
    tracker.close()
    assert flagged is True
    assert idle_load.event is not None and idle_load.event.in_request_path is False
    with FlightRecorder(tmp_path / "rec.db") as rec:
        loaders = [r for r in rec.read(["loader"]) if isinstance(r, LoaderEvent)]
    by_name = {e.name: e for e in loaders}
    assert by_name["registry-refresh"].in_request_path is True
    assert by_name["registry-refresh"].bytes_read == 4096 and by_name["registry-refresh"].cache_hit is False
    assert by_name["registry-refresh"].duration_s >= 0.02
    assert by_name["background-refresh"].in_request_path is False
    assert sample_value(registry, catalog.LOADER_EVENTS.name, {"cache": "miss", "in_request_path": "true"}) == 1
    assert sample_value(registry, catalog.LOADER_EVENTS.name, {"cache": "hit", "in_request_path": "false"}) == 1
    assert sample_value(registry, catalog.LOADER_READ.name) == 4096


# --------------------------------------------------------------------------- installation


def test_the_middleware_goes_in_through_fastapis_public_api(tmp_path: Path) -> None:
    """Installed with ``app.add_middleware``: the app's own ``build_middleware_stack`` is untouched, the
    tracking middleware is outermost of the user middleware, so the app's own middleware already runs
    inside the request's arrival; a second call changes nothing; after start-up Starlette refuses."""
    from collectors.tracking import TrackingMiddleware
    from collectors.tracking import spans as sp

    seen: list[bool] = []

    class Inner:  # the app's own middleware, added before instrument_fastapi
        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                seen.append(sp.CURRENT_ARRIVAL.get() is not None)
            await self.app(scope, receive, send)

    tracker = _tracker(tmp_path, CollectorRegistry())
    app = FastAPI()
    app.add_middleware(Inner)

    @app.get("/ok")
    async def ok() -> dict[str, bool]:
        async with tracker.request(route="/ok") as req:
            await req.acquire()
            return {"ok": True}

    instrument_fastapi(app, tracker)
    instrument_fastapi(app, tracker)  # ignored, with a warning
    assert [m.cls for m in app.user_middleware] == [TrackingMiddleware, Inner]
    assert "build_middleware_stack" not in vars(app)
    with serve(app) as base, httpx.Client(base_url=base) as client:
        assert client.get("/ok").status_code == 200
    tracker.close()
    assert seen == [True]

    started = FastAPI()
    with serve(started) as base, httpx.Client(base_url=base) as client:
        assert client.get("/docs").status_code == 200  # the stack is built now
        with pytest.raises(RuntimeError):  # too late: Starlette refuses middleware once it has started
            instrument_fastapi(started, RequestTracker(model="late", recorder=False, registry=CollectorRegistry()))


def test_a_span_asked_for_during_inference_is_live_and_is_the_one_exported(tmp_path: Path, spans: Any) -> None:
    """``req.span`` / ``req.inference_context()`` during the request give the live ``llm.inference``
    span (built on first use); what the handler put on it and the finish attributes end up on one span,
    and a span the handler opens in ``inference_context()`` is its child."""
    provider, exporter = spans
    tracker = _tracker(tmp_path, CollectorRegistry(), provider, ratio=1.0)
    app = FastAPI()

    @app.get("/live")
    async def live() -> dict[str, bool]:
        async with tracker.request(route="/live") as req:
            assert not req.span.is_recording()  # no slot yet: nothing to record on
            await req.acquire()
            req.span.set_attribute("app.stage", "decode")
            with provider.get_tracer("app").start_as_current_span("app.step", context=req.inference_context()):
                pass
            assert req.span is req.span  # the same live span every time
            return {"ok": True}

    instrument_fastapi(app, tracker, tracer_provider=provider)
    with serve(app) as base, httpx.Client(base_url=base) as client:
        assert client.get("/live").status_code == 200
    tracker.close()
    finished = {s.name: s for s in exporter.get_finished_spans()}
    inference, step = finished["llm.inference"], finished["app.step"]
    assert [s.name for s in exporter.get_finished_spans()].count("llm.inference") == 1
    assert inference.attributes["app.stage"] == "decode"
    assert inference.attributes["llm_diag.outcome"] == "ok"
    assert inference.attributes["gen_ai.request.model"] == "m"
    assert step.parent is not None and step.parent.span_id == inference.context.span_id
    assert inference.parent is not None and inference.parent.span_id == finished["GET /live"].context.span_id
