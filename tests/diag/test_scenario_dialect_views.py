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
        (["vllm", "llmdiag"], "engines' dialects"),
        (["llmdiag"], "engines' dialects"),
        ([], "engines' dialects"),
        (["vllm", "sglang"], "dialect 'sglang'"),
    ],
)
def test_dialects_that_cannot_apply_are_refused_before_anything_starts(dialects: list[str], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        run_scenario_in_dialects("queue", dialects)


def test_a_joint_run_of_a_scenario_with_several_workers_is_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="runs 2 workers"):
        run_scenario_in_dialects("healthy", ["llmdiag", "vllm"])


def test_the_instrumented_view_drops_the_engines_scrapes_and_the_engines_views_drop_the_tracker() -> None:
    records = [
        {"kind": "host", "ts": 1.0},
        {"kind": "cgroup", "ts": 1.0, "path": "/llmdiag/service"},
        {"kind": "request", "ts": 1.0},
        {"kind": "batch", "ts": 1.0},
        {"kind": "config", "ts": 1.0},
        _backend("/metrics/vllm", 1.0),
        _backend("/metrics/tgi", 1.0),
        {"kind": "backend", "ts": 1.0, "target": "http://127.0.0.1:9000/metrics", "up": True},  # another service
    ]
    ours = dialect_view(records, "llmdiag")
    assert [r["kind"] for r in ours] == ["host", "cgroup", "request", "batch", "config", "backend"]
    assert ours[-1]["target"].endswith(":9000/metrics")
    vllm = dialect_view(records, "vllm")
    assert [r["kind"] for r in vllm] == ["host", "cgroup", "backend"] and vllm[-1]["target"].endswith("/metrics/vllm")


def test_every_record_kind_is_the_trackers_or_the_agents() -> None:
    """A new record kind must be placed: written in the service (left out of an engine's view) or by the agent."""
    from collectors import records as rec
    from diag.demo.scenarios.runner import TRACKER_KINDS

    agents = {"host", "cgroup", "process", "gpu", "oom", "watch_scope", "backend", "alert"}
    kinds = {cls.KIND for cls in vars(rec).values() if isinstance(cls, type) and issubclass(cls, rec.Record) and cls.KIND}
    assert kinds == TRACKER_KINDS | agents and not TRACKER_KINDS & agents


def test_the_agent_scrapes_the_engines_paths_beside_the_tracker() -> None:
    url = "http://127.0.0.1:8000"
    assert scrape_urls(url, ("llmdiag", "vllm")) == [f"{url}/metrics/vllm"]
    assert scrape_urls(url, ("llmdiag", "vllm", "tgi")) == [f"{url}/metrics/vllm", f"{url}/metrics/tgi"]


def test_the_joint_views_of_the_scenario_suite() -> None:
    from tests.sharedruns import joint_views

    assert joint_views("queue") == ("llmdiag", "vllm", "tgi", "llamacpp")
    assert joint_views("kv-saturation") == ("vllm", "tgi", "llamacpp")  # its own run is vLLM's, uninstrumented
    assert joint_views("healthy") == ()  # two workers
    assert joint_views("leak") == ()  # its recorder goes whole to the triage suite
    assert joint_views("loader-refresh") == ()  # read from the tracker's records only


def test_an_engine_scenario_refuses_the_reference_backends_dialects() -> None:
    with pytest.raises(ValueError, match="cannot apply"):
        run_scenario_in_dialects("engine-queue", ["vllm", "tgi"])
