"""A queue behind llama-cpp-python's model lock, seen from outside only, is diagnosed as ``queue_backlog``.

Why: the server serialises every request through one model (a two-level anyio lock, first come first
served); under more concurrent requests than it can decode, they wait in that queue while the model is
busy -- the most common incident on a single-model engine. Two attachments, one verdict:

- outside: nothing in the server is instrumented; the agent watches its cgroup and process, and the request rows
  are what the load generator saw (arrival, first streamed token, last token: ``diag/demo/engine/client.py`` says
  what ``start`` means there);
- wrapped: the same server under ``diag wrap``; the rows are the server's own, written to the agent's recorder,
  with the start marked where the request takes the model lock.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from collectors.recorder import FlightRecorder
from diag.demo.engine.client import drive
from diag.demo.engine.model import WrittenModel
from diag.rules.engine import analyze
from tests.engine.attached import ATTACHMENTS, run_attached
from tests.livecg import require_live

pytestmark = [pytest.mark.live, pytest.mark.process, pytest.mark.slow]
REQUESTS, CONCURRENCY, TOKENS = 48, 8, 24


@pytest.mark.parametrize("attachment", ATTACHMENTS)
def test_overload_behind_the_model_lock_is_a_queue_backlog(tmp_path: Path, engine_model: WrittenModel, attachment: str) -> None:
    require_live()
    prompts = [f"request {i}: why is the service slow?" for i in range(REQUESTS)]
    run = run_attached(tmp_path, engine_model, "queue", attachment,
                       lambda url, pid: drive(url, prompts, concurrency=CONCURRENCY, max_tokens=TOKENS, pid=pid))  # fmt: skip
    rows, timeline, recorder = run.rows, run.timeline, run.recorder
    t0 = min(r.arrival for r in rows)
    assert all(r.outcome == "ok" and r.output_tokens == TOKENS for r in rows), [r.to_dict() for r in rows[:3]]
    assert len(timeline.cgroups) == 1  # the agent watched the engine's own group
    held = {f for track in timeline.processes.values() for f in track.model_files}
    assert str(engine_model.path) in held, held  # and saw the engine map the .gguf
    if attachment == "wrapped":  # the server's rows: every completion, each with the start its model lock marked
        with FlightRecorder(recorder, readonly=True) as rec:
            served = [r for r in rec.read(["request"]) if r.route == "/v1/completions"]
        assert len(served) == REQUESTS and all(r.start is not None and r.start >= r.arrival for r in served)
    analysis = analyze(timeline)
    print(analysis.primary, [(f.rule, round(f.confidence, 2), f.summary) for f in analysis.findings])
    ratios = sorted(r.queue_wait_s / r.inference_s for r in rows if r.inference_s)
    backlog = next((f for f in analysis.findings if f.rule == "requests.queue_backlog"), None)
    assert backlog is not None and backlog.confidence >= 0.6, (analysis.to_dict()["findings"], "wait/inference", ratios[:10])
    # a neighbour's host-wide pressure that leaves the engine's own group calm ranks under a confident backlog
    # (diag/rules/precedence.py), so the verdict is the backlog even on a busy shared host
    assert analysis.primary == "queue_backlog", analysis.to_dict()["findings"]
    assert max(r.finish for r in rows) - t0 < 45
