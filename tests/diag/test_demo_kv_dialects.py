"""The reference backend's KV-cache budget (vLLM's admission and preemption by recompute) and its engine dialects.

The batcher runs the real demo model on a real checkpoint; the served dialects are scraped over real HTTP from a
``diag demo serve`` subprocess and parsed by the agent's own exposition parser.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from collectors import backends as bk
from collectors import exposition
from diag.demo.batcher import Batcher
from diag.demo.dialects import FILLED, DialectMetrics, Served
from diag.demo.harness import post_all, scrape, start_demo
from diag.demo.kvcache import BLOCK_TOKENS, KvBudget, blocks_for
from diag.demo.settings import DemoSettings
from diag.demo.weights import ModelConfig, ensure_weights, load_weights


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> object:
    path = ensure_weights(tmp_path_factory.mktemp("w"), ModelConfig.for_budget(8))
    return load_weights(path, "shared")


def _run(batcher: Batcher, jobs: list[tuple[list[int], int]]) -> list[object]:
    async def go() -> list[object]:
        return await asyncio.gather(*(batcher.submit(p, n) for p, n in jobs))

    batcher.start()
    try:
        return asyncio.run(go())
    finally:
        batcher.stop()


def test_blocks_round_up() -> None:
    assert (blocks_for(0), blocks_for(1), blocks_for(BLOCK_TOKENS), blocks_for(BLOCK_TOKENS + 1)) == (0, 1, 1, 2)


def test_a_full_cache_preempts_and_recomputes_without_changing_any_completion(weights: object) -> None:
    """Eight sequences of 40 + 60 tokens (7 blocks each at the end) in a 20-block cache: some are preempted and
    recomputed, and every request still gets its whole completion: recompute resumes where it stopped (the
    tokens from before the preemption are kept; sampling after it draws from a fresh generator)."""
    jobs = [([1 + i, 2, 3] * 13 + [7], 60) for i in range(8)]
    free = _run(Batcher(lambda: weights, mode="requests", max_batch_requests=8), jobs)  # type: ignore[arg-type, return-value]
    kv = KvBudget(20 * BLOCK_TOKENS)
    tight = _run(Batcher(lambda: weights, mode="requests", max_batch_requests=8, kv=kv), jobs)  # type: ignore[arg-type, return-value]
    assert kv.preemptions > 0
    assert [len(c.ids) for c in tight] == [len(c.ids) for c in free] == [60] * 8  # type: ignore[attr-defined]
    # a preempted request keeps what it generated before the preemption: some completions start alike
    assert sum(t.ids[:5] == f.ids[:5] for t, f in zip(tight, free, strict=True)) >= 1  # type: ignore[attr-defined]
    assert all(c.prompt_tokens == 40 for c in tight)  # type: ignore[attr-defined]
    assert kv.used_blocks == 0  # every block freed once the batches are done


def test_room_in_the_cache_never_preempts(weights: object) -> None:
    kv = KvBudget(8 * blocks_for(40 + 60 + 1) * BLOCK_TOKENS)
    _run(Batcher(lambda: weights, mode="requests", max_batch_requests=8, kv=kv), [([5] * 40, 60)] * 8)  # type: ignore[arg-type, return-value]
    assert kv.preemptions == 0


def test_each_dialect_exports_declared_families_only_and_parses() -> None:
    for dialect in ("vllm", "tgi", "llamacpp"):
        m = DialectMetrics(dialect, "demo", KvBudget(4096), max_prompt_tokens=256, max_output_tokens=64)
        m.arrived()
        m.finished(Served(10, 5, 0.1, 0.2, 0.5, 0.4, 0.1, 0.3))
        text = m.render()
        declared = {f.base for f in bk.families_of(dialect)}  # type: ignore[arg-type]
        typed = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
        assert typed and typed <= declared, typed - declared
        assert {bk.FAMILIES[n].base for n in FILLED[dialect]} == typed
        parsed = exposition.parse(text.encode(), "text/plain; version=0.0.4")
        assert parsed is not None
        for f in (bk.FAMILIES[n] for n in FILLED[dialect]):
            if f.buckets is not None and f.type == "histogram":
                les = [ln for ln in text.splitlines() if ln.startswith(f.name + "_bucket")]
                assert len(les) == len(f.buckets) + 1  # exactly the declared boundaries, and +Inf


def _fed(m: DialectMetrics) -> DialectMetrics:
    """The same requests told to ``m``: two served, one refused, one failed, one still in the system."""
    for r in (Served(10, 5, 0.1, 0.2, 0.5, 0.4, 0.1, 0.3), Served(200, 64, 1.5, 1.7, 4.0, 2.5, 0.2, 2.3)):
        m.arrived()
        m.finished(r)
    for refused in (True, False):
        m.arrived()
        m.left(refused=refused, failed=True)
    m.arrived()
    return m


def test_several_dialects_from_one_state_render_as_each_engine_alone() -> None:
    """A server exporting three engines' dialects at once writes each exactly as a server speaking that one would:
    the scenario suite judges one run as each engine, which holds only if nothing of one dialect leaks into another."""
    kv = KvBudget(4096)
    both = _fed(DialectMetrics("tgi", "demo", kv, max_prompt_tokens=256, max_output_tokens=64, also=("vllm", "llamacpp")))
    for dialect in ("vllm", "tgi", "llamacpp"):
        alone = _fed(DialectMetrics(dialect, "demo", kv, max_prompt_tokens=256, max_output_tokens=64))
        assert both.render(dialect) == alone.render(), dialect
    assert both.render() == both.render("tgi")  # the first is the one at /metrics
    with pytest.raises(ValueError, match="named twice"):
        DialectMetrics("vllm", "demo", kv, max_prompt_tokens=256, max_output_tokens=64, also=("vllm",))
    with pytest.raises(ValueError, match="must be one of"):
        DialectMetrics("vllm", "demo", kv, max_prompt_tokens=256, max_output_tokens=64, also=("llmdiag",))


def test_settings_refuse_more_dialects_unknown_ours_or_twice_and_survive_the_workers_json() -> None:
    for also in (("vllm",), ("sglang",), ("llmdiag",), ("tgi", "tgi")):
        with pytest.raises(ValueError, match="other engines' dialects, each once"):
            DemoSettings(metrics_dialect="vllm", also_metrics_dialects=also)
    with pytest.raises(ValueError, match="other engines' dialects, each once"):
        DemoSettings(also_metrics_dialects=("llmdiag",))
    for first, also in (("vllm", ("tgi", "llamacpp")), ("llmdiag", ("vllm", "tgi"))):
        settings = DemoSettings(metrics_dialect=first, also_metrics_dialects=also)
        assert settings.engine_dialects == tuple(d for d in (first, *also) if d != "llmdiag")
        assert DemoSettings.from_json(settings.to_json()) == settings  # how the spawned workers get them
    assert DemoSettings().engine_dialects == ()
    with pytest.raises(ValueError, match="needs --workers 1"):  # the engines' beside ours: still one process's state
        DemoSettings(also_metrics_dialects=("vllm",), workers=2)


def test_settings_refuse_a_budget_smaller_than_one_request_and_dialects_on_several_workers() -> None:
    with pytest.raises(ValueError, match="cannot hold one request"):
        DemoSettings(kv_cache_tokens=100)
    with pytest.raises(ValueError, match="needs --workers 1"):
        DemoSettings(metrics_dialect="vllm", workers=2)
    with pytest.raises(ValueError, match="metrics dialect"):
        DemoSettings(metrics_dialect="sglang")


@pytest.mark.process
@pytest.mark.parametrize("dialect", ["vllm", "tgi", "llamacpp"])
def test_the_server_speaks_the_dialect_from_its_live_state(tmp_path: Path, dialect: str) -> None:
    args = ["--metrics-dialect", dialect, "--kv-cache-tokens", "800", "--max-prompt-tokens", "256",
            "--max-output-tokens", "256", "--max-concurrency", "8", "--max-batch-requests", "8"]  # fmt: skip
    srv = start_demo(args, weights_mb=16, weights_dir=tmp_path / "w", log_dir=tmp_path, recorder=tmp_path / "rec.db")
    try:
        responses = post_all(srv.url, [{"prompt": "x" * 150, "max_tokens": 120}] * 16, concurrency=8)
        assert [r.status_code for r in responses] == [200] * 16
        samples = scrape(srv.url)
    finally:
        srv.stop()
    names = set(samples)
    assert not any(n.startswith("llmdiag_") for n in names)  # uninstrumented: the tracker's families are off
    served = {"vllm": "vllm:e2e_request_latency_seconds_count", "tgi": "tgi_request_count",
              "llamacpp": "llamacpp:tokens_predicted_total"}[dialect]  # fmt: skip
    value = sum(v for name in (served, served + "_total") for _, v in samples.get(name, []))
    assert value == (16 if dialect != "llamacpp" else 16 * 120)
    if dialect == "vllm":
        assert sum(v for _, v in samples["vllm:num_preemptions_total"]) > 0  # 8 x (150 + 120) tokens > 800
        assert all(lab == {"model_name": "demo", "engine": "0"} for lab, _ in samples["vllm:kv_cache_usage_perc"])
    assert not (tmp_path / "rec.db").exists()  # no flight recorder of ours either


@pytest.mark.process
def test_one_server_speaks_several_dialects_each_at_its_own_path(tmp_path: Path) -> None:
    args = ["--metrics-dialect", "vllm,tgi,llamacpp", "--max-prompt-tokens", "256", "--max-output-tokens", "64"]
    srv = start_demo(args, weights_mb=16, weights_dir=tmp_path / "w", log_dir=tmp_path, recorder=tmp_path / "rec.db")
    try:
        responses = post_all(srv.url, [{"prompt": "x" * 50, "max_tokens": 8}] * 6, concurrency=3)
        assert [r.status_code for r in responses] == [200] * 6
        at = {path: scrape(srv.url, path) for path in ("/metrics", "/metrics/vllm", "/metrics/tgi", "/metrics/llamacpp")}
    finally:
        srv.stop()
    assert at["/metrics"] == at["/metrics/vllm"]  # the first dialect at /metrics, as a real vLLM
    served = {"vllm": "vllm:e2e_request_latency_seconds_count", "tgi": "tgi_request_count",
              "llamacpp": "llamacpp:tokens_predicted_total"}  # fmt: skip
    prefixes = {"vllm": "vllm:", "tgi": "tgi_", "llamacpp": "llamacpp:"}
    for dialect, family in served.items():
        samples = at[f"/metrics/{dialect}"]
        total = sum(v for name in (family, family + "_total") for _, v in samples.get(name, []))
        assert total == (6 if dialect != "llamacpp" else 6 * 8), dialect
        assert samples and all(n.startswith(prefixes[dialect]) for n in samples), (dialect, sorted(samples)[:5])
    assert not (tmp_path / "rec.db").exists()


def test_an_unenforced_budget_counts_blocks_but_never_preempts(weights: object) -> None:
    """The default (no --kv-cache-tokens): usage is reported, batches form exactly as without a budget."""
    kv = KvBudget(20 * BLOCK_TOKENS)
    jobs = [([1 + i, 2, 3] * 13 + [7], 60) for i in range(8)]
    done = _run(Batcher(lambda: weights, mode="requests", max_batch_requests=8, kv=kv, kv_enforced=False), jobs)  # type: ignore[arg-type, return-value]
    assert kv.preemptions == 0 and len(done) == 8


@pytest.mark.process
def test_the_tracker_keeps_metrics_and_its_recorder_with_engines_dialects_beside_it(tmp_path: Path) -> None:
    """``--metrics-dialect llmdiag,vllm,tgi``: one run read both as the instrumented service (the tracker's /metrics
    and request rows) and as each engine (its families at /metrics/<dialect>) -- the scenario suite's joint runs."""
    from diag.sources.recorder import load_recorder

    args = ["--metrics-dialect", "llmdiag,vllm,tgi", "--max-prompt-tokens", "256", "--max-output-tokens", "64"]
    srv = start_demo(args, weights_mb=16, weights_dir=tmp_path / "w", log_dir=tmp_path, recorder=tmp_path / "rec.db")
    try:
        responses = post_all(srv.url, [{"prompt": "x" * 50, "max_tokens": 8}] * 5, concurrency=2)
        assert [r.status_code for r in responses] == [200] * 5
        at = {path: scrape(srv.url, path) for path in ("/metrics", "/metrics/vllm", "/metrics/tgi")}
        missing = httpx.get(srv.url + "/metrics/llamacpp", timeout=10).status_code
    finally:
        srv.stop()
    assert missing == 404  # only the dialects asked for
    assert at["/metrics"] and all(n.startswith("llmdiag_") or not n.startswith(("vllm:", "tgi_")) for n in at["/metrics"])
    assert any(n.startswith("llmdiag_") for n in at["/metrics"])
    assert sum(v for _, v in at["/metrics/vllm"]["vllm:e2e_request_latency_seconds_count"]) == 5
    assert sum(v for n in ("tgi_request_count", "tgi_request_count_total") for _, v in at["/metrics/tgi"].get(n, [])) == 5
    assert all(n.startswith("tgi_") for n in at["/metrics/tgi"])
    assert len(load_recorder(tmp_path / "rec.db").requests) == 5  # the tracker's rows, as on an instrumented server
