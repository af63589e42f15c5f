"""Every engine panel returns data in a real Prometheus for each dialect it claims, on a host of that dialect alone.

One real Prometheus holds three hosts' history, each backfilled (``promtool tsdb create-blocks-from openmetrics``)
from an exposition of one dialect's families as ``collectors.backends`` declares them -- names, types, labels and
buckets of vLLM @005a810b, TGI @db931fc and llama.cpp's server @aa6192d3 (none of which can run here) -- under its
own ``job``. Each panel's queries are then evaluated with ``$job`` set to one dialect's job, as Grafana would on
that host: every alternative of that dialect must return finite points, and so must the ``or`` Grafana sends. A
panel that claims a dialect (docs/DASHBOARDS.md says which) is proven for it; an alternative that names a family
the dialect lacks, or a query broken for one dialect but rescued by another, fails here.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from collectors import backends
from dashboards.definitions import engine
from dashboards.engine import alternative_dialects, engine_panels, panel_dialects
from dashboards.synthetic import exposition
from tests.dashboards.livestack import prometheus_with
from tests.promserver import PromServer, require_prometheus

pytestmark = pytest.mark.process
ENGINES = ("vllm", "tgi", "llamacpp")
STEP_S = 5.0
WINDOW_S = 10 * 60


def _job(dialect: str) -> str:
    return f"{dialect}-host"


@pytest.fixture(scope="module")
def prom() -> Iterator[tuple[PromServer, float, float]]:
    require_prometheus()
    if shutil.which("promtool") is None:
        pytest.skip("needs promtool (Debian package 'prometheus')")
    work = Path(tempfile.mkdtemp(prefix="llmdiag-families-"))
    try:
        end = time.time() - 60
        start = end - WINDOW_S
        data = work / "data"
        for dialect in ENGINES:  # one exposition (and one set of blocks) per dialect: each host has only its own
            names = [f.name for f in backends.families_of(dialect) if f.type != "summary"]
            path = work / f"{dialect}.om"
            labels = {"job": _job(dialect), "instance": f"{dialect}-1:8000"}
            path.write_text("\n".join(exposition(names, start, end, STEP_S, labels)) + "\n")
            proc = subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(path), str(data)],
                                  capture_output=True, text=True, timeout=300)  # fmt: skip
            assert proc.returncode == 0, proc.stderr[-2000:]
        with prometheus_with(data, {}, [], work) as server:
            yield server, start, end
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _range(server: PromServer, expr: str, dialect: str, start: float, end: float) -> list[float]:
    text = expr.replace("$__rate_interval", "60s").replace("$job", _job(dialect))
    text = re.sub(r"\$\{?(instance|model)\}?", ".+", text)
    r = httpx.get(f"{server.url}/api/v1/query_range", trust_env=False, timeout=30.0,
                  params={"query": text, "start": start, "end": end, "step": 15})  # fmt: skip
    body: dict[str, Any] = r.json()
    assert body["status"] == "success", (text, body)
    return [float(v) for s in body["data"]["result"] for _, v in s["values"] if math.isfinite(float(v))]


CASES = [(p.title, d) for p in engine_panels() for d in panel_dialects(p)]


def test_every_engine_panel_claims_vllm_and_the_saturation_panel_exists() -> None:
    """vLLM hosts get every panel; TGI and llama.cpp the ones whose family they export (the docs table's rows)."""
    assert all("vllm" in panel_dialects(p) for p in engine_panels())
    assert {d for p in engine_panels() for d in panel_dialects(p)} == set(ENGINES)
    assert [r.title for r in engine().rows][-1] == "Host and cgroup memory beside the engine"


@pytest.mark.parametrize(("title", "dialect"), CASES, ids=[f"{t}:{d}" for t, d in CASES])
def test_each_claimed_dialect_fills_the_panel_on_its_own(prom: tuple[PromServer, float, float], title: str,
                                                         dialect: str) -> None:  # fmt: skip
    server, start, end = prom
    (panel,) = [p for p in engine_panels() if p.title == title]
    checked = 0
    for query in panel.queries:
        mine = [a for a in query.alternatives if alternative_dialects(a) == {dialect}]
        for alt in mine:
            assert _range(server, alt, dialect, start, end), f"{title}: no {dialect} data for {alt}"
            checked += 1
        if mine:
            assert _range(server, query.expr, dialect, start, end), f"{title}: the combined query is empty on {dialect}"
    assert checked, f"{title} claims {dialect} but has no alternative of its own"


def test_a_dialect_the_panel_does_not_claim_leaves_it_empty(prom: tuple[PromServer, float, float]) -> None:
    """The check can fail: TTFT on a TGI-only host (TGI exports no time to first token) has no data."""
    server, start, end = prom
    (ttft,) = [p for p in engine_panels() if p.title == "Time to first token"]
    assert "tgi" not in panel_dialects(ttft)
    assert not any(_range(server, q.expr, "tgi", start, end) for q in ttft.queries)
    assert any(_range(server, q.expr, "vllm", start, end) for q in ttft.queries)


def test_the_docs_table_is_the_rendered_one() -> None:
    """docs/DASHBOARDS.md carries the table rendered from the panels (so no name in it is spelt by hand)."""
    from dashboards.engine import UPSTREAM_VLLM, markdown_table

    doc = (Path(__file__).resolve().parents[2] / "docs" / "DASHBOARDS.md").read_text()
    assert markdown_table() in doc
    assert set(UPSTREAM_VLLM.values()) <= {p.title for p in engine_panels()}
