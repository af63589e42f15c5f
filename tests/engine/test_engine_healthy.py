"""llama.cpp under steady load it can serve, on both attachments: no incident.

Why: every class the rules name on the engine is worth only as much as their silence when nothing is wrong. One
client at a time keeps the model busy (closed loop: the next request as the last ends) without a queue, in a group
with room for the model and its buffers; neither the client's rows nor the server's own (``diag wrap``) may read as
an incident.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diag.demo.engine.client import drive_until
from diag.demo.engine.model import WrittenModel
from diag.rules.classes import HEALTHY
from diag.rules.engine import analyze
from tests.engine.attached import ATTACHMENTS, run_attached
from tests.livecg import require_live

pytestmark = [pytest.mark.live, pytest.mark.process, pytest.mark.slow]
LOAD_S, TOKENS = 32.0, 16  # the leak rule judges no less than 30 s of memory samples


@pytest.mark.parametrize("attachment", ATTACHMENTS)
def test_steady_load_the_engine_serves_is_no_incident(tmp_path: Path, engine_model: WrittenModel, attachment: str) -> None:
    require_live()
    run = run_attached(tmp_path, engine_model, "healthy", attachment, kmsg=True,
                       load=lambda url, pid: drive_until(url, LOAD_S, concurrency=1, max_tokens=TOKENS, pid=pid))  # fmt: skip
    rows, timeline = run.rows, run.timeline
    assert run.oom_kills == 0 and len(rows) >= 10 and all(r.outcome == "ok" for r in rows)
    analysis = analyze(timeline)
    print(
        attachment,
        analysis.primary,
        analysis.too_little_data,
        [(f.rule, round(f.confidence, 2), f.summary) for f in analysis.findings],
    )
    assert analysis.primary == HEALTHY, (analysis.to_dict()["findings"], analysis.too_little_data)
