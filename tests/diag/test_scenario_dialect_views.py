"""One scenario run served in several engines' dialects, judged as each engine: what the agent scrapes, which
records each engine's view keeps, and what is refused before anything starts -- no process, no root.
"""

from __future__ import annotations

from typing import Any

import pytest

from diag.demo.scenarios.context import scrape_urls
from diag.demo.scenarios.runner import dialect_view, run_scenario_in_dialects


def test_the_agent_scrapes_one_path_per_dialect_and_nothing_for_ours() -> None:
    url = "http://127.0.0.1:8000"
    assert scrape_urls(url, ("llmdiag",)) == []  # the tracker records; nothing to scrape
    assert scrape_urls(url, ("tgi",)) == [f"{url}/metrics"]  # one engine: its /metrics, as a real one
    assert scrape_urls(url, ("vllm", "tgi", "llamacpp")) == [
        f"{url}/metrics/vllm",
        f"{url}/metrics/tgi",
        f"{url}/metrics/llamacpp",
    ]


def _backend(path: str, ts: float) -> dict[str, Any]:
    return {"kind": "backend", "ts": ts, "target": f"http://127.0.0.1:8000{path}", "up": True}


def test_each_dialects_view_keeps_every_sample_of_the_host_and_only_its_own_scrapes() -> None:
    records = [
        {"kind": "host", "ts": 1.0},
        {"kind": "cgroup", "ts": 1.0, "path": "/llmdiag/service"},
        {"kind": "process", "ts": 1.0, "pid": 42},
        _backend("/metrics/vllm", 1.0),
        _backend("/metrics/tgi", 1.0),
        _backend("/metrics/llamacpp", 1.0),
        _backend("/metrics/vllm", 2.0),
    ]
    for dialect in ("vllm", "tgi", "llamacpp"):
        view = dialect_view(records, dialect)
        kept = [r for r in view if r["kind"] == "backend"]
        assert kept and all(r["target"].endswith(f"/metrics/{dialect}") for r in kept), dialect
        assert [r for r in view if r["kind"] != "backend"] == records[:3]  # the agent's own samples, all of them
    assert len(dialect_view(records, "vllm")) == 5
    # a path that merely starts like another dialect's is not taken for it
    assert dialect_view([_backend("/metrics/vllm-old", 1.0)], "vllm") == []


@pytest.mark.parametrize(
    ("dialects", "says"),
    [
        (["vllm", "vllm"], "each once"),
        (["llmdiag", "vllm"], "engines' dialects"),
        ([], "engines' dialects"),
        (["vllm", "sglang"], "dialect 'sglang'"),
    ],
)
def test_dialects_that_cannot_apply_are_refused_before_anything_starts(dialects: list[str], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        run_scenario_in_dialects("queue", dialects)


def test_an_engine_scenario_refuses_the_reference_backends_dialects() -> None:
    with pytest.raises(ValueError, match="cannot apply"):
        run_scenario_in_dialects("engine-queue", ["vllm", "tgi"])
