"""What a real engine taught the gate, checked without one (the live runs are tests/engine/test_engine_gate.py):

- a streamed answer that ends without ``data: [DONE]`` is cut off, not complete, even when its HTTP framing is
  whole -- llama-cpp-python's server ends every open event stream that way on SIGTERM;
- a failed open-loop step that the rules call healthy or inconclusive (a server with no metrics queueing behind one
  model lock shows the host nothing) is diagnosed from the client's side: served below the rate asked, latency
  growing through the step, timeouts -- and a step that kept up, or a closed loop, gets no such line.
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx

from diag.gate.criteria import HostFacts, judge
from diag.gate.inprocess import HttpxClient
from diag.gate.load import Deadlines, Result, StepLoad, request_body, send
from diag.gate.runner import StepReport, client_queue
from diag.gate.spec import parse_spec
from diag.rules.engine import Analysis

EVENT = b'data: {"choices": [{"text": "a", "finish_reason": null}]}\n\n'


def _sse_app(events: int, done: bool):  # type: ignore[no-untyped-def]
    """An ASGI app answering every POST with ``events`` token events, then ``[DONE]`` only if ``done``."""

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(events):
            await send({"type": "http.response.body", "body": EVENT, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n" if done else b"", "more_body": False})

    return app


def _streamed(events: int, done: bool) -> Result:
    spec = parse_spec({"stream": True, "steps": [{"name": "s", "rate": 1, "duration": 1, "prompt_tokens": 2,
                                                  "output_tokens": 4}]})  # fmt: skip
    step = spec.steps[0]

    async def run() -> Result:
        transport = httpx.ASGITransport(app=_sse_app(events, done))
        async with HttpxClient(httpx.AsyncClient(base_url="http://engine", transport=transport)) as client:
            loop = asyncio.get_running_loop()
            deadlines = Deadlines(loop, 5.0)
            body = request_body(spec, step, random.Random(0))
            assert json.loads(json.dumps(body))["stream"] is True
            try:
                return await send(client, spec, body, loop.time(), deadlines)  # type: ignore[arg-type]
            finally:
                deadlines.close()

    return asyncio.run(run())


def test_a_stream_that_ends_without_done_is_cut_off_not_complete() -> None:
    whole = _streamed(4, done=True)
    assert whole.ok and whole.output_tokens == 4 and len(whole.itl_s) == 3
    cut = _streamed(2, done=False)
    assert not cut.ok and cut.status == 200 and cut.error == "the stream ended without data: [DONE]"
    assert cut.output_tokens == 2  # what arrived is still counted
    empty = _streamed(0, done=False)
    assert not empty.ok and empty.first_token is None


def _load(latencies: list[float], rate: float, errors: int = 0) -> StepLoad:
    spec = parse_spec({"steps": [{"name": "peak", "rate": rate, "duration": "10s", "prompt_tokens": 4, "output_tokens": 4,
                                  "criteria": {"e2e_p99_s": 1, "error_ratio": 0}}]})  # fmt: skip
    results = [Result(scheduled=i / rate, sent=i / rate, done=i / rate + lat, status=200) for i, lat in enumerate(latencies)]
    for r in results[len(results) - errors :]:
        r.error, r.status = "timeout", None
    end = max(r.done for r in results)
    return StepLoad(spec.steps[0], 0.0, 1000.0, results, load_end=len(latencies) / rate, end=end)


def test_a_failed_step_the_rules_call_healthy_names_the_queue_the_client_saw() -> None:
    queued = _load([0.3 + 0.8 * i for i in range(24)], rate=4, errors=6)  # each waits longer; the last six time out
    line = client_queue(queued)
    assert line.startswith("queue_backlog (client side): served ") and "of the 4 asked" in line, line
    assert "6 of 24 timed out" in line and "for the first third of arrivals" in line
    facts = HostFacts(0.0, "host", 0)
    report = StepReport(queued.step, queued, judge(queued, queued.step.criteria, facts), facts,
                        Analysis("healthy", [], [], [], (1000.0, 1030.0)))  # fmt: skip
    assert not report.passed
    assert report.diagnosis() == f"{line} (the host's side: healthy)"
    assert report.to_dict()["diagnosis"]["client"] == line and report.to_dict()["diagnosis"]["primary"] == "healthy"


def test_a_step_that_kept_up_or_a_closed_loop_gets_no_client_line() -> None:
    steady = _load([0.2] * 40, rate=4)
    assert client_queue(steady) == ""
    closed = parse_spec({"steps": [{"name": "c", "concurrency": 2, "duration": "5s", "prompt_tokens": 4, "output_tokens": 4}]})
    slow = [Result(scheduled=float(i), sent=float(i), done=i + 0.5 * i, status=200) for i in range(9)]
    assert client_queue(StepLoad(closed.steps[0], 0.0, 0.0, slow, load_end=9.0, end=14.0)) == ""


def test_a_target_without_metrics_is_a_note_not_a_failure() -> None:
    from diag.cli.gate import _metrics_note

    note = _metrics_note(False, "GET /metrics: HTTP 404", scrape=True)
    assert note.startswith("the target serves no Prometheus metrics (GET /metrics: HTTP 404)")
    assert "judged on the client's figures and the host's samples" in note
    assert "--no-scrape" in _metrics_note(True, "", scrape=False)
    assert _metrics_note(True, "", scrape=True) == ""
