"""llama.cpp with an ``n_ctx`` whose KV cache dwarfs its model: diagnosed ``unsafe_config``, naming the setting and
what it costs, with the OOM kill it causes as the symptom.

Why: llama.cpp reserves (and clears) the KV cache for the whole context when the context is created, 2 x layers x
n_ctx x the KV width x 2 bytes (f16), before any request. A server sized for its model -- a group of five times
the weights -- is OOM-killed at start-up once n_ctx is raised to 32768 (the model was trained for 4096): the KV
reservation alone is several times the weights. The agent reads the setting from the server's command line and
the model's dimensions from the GGUF header (``collectors/engine_config.py``); nothing in the server is
instrumented. Contrast: the same group with n_ctx 2048 starts and serves, and the configuration is not flagged.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diag.demo.engine.model import WrittenModel
from diag.demo.engine.server import EngineSettings
from diag.demo.scenarios.cgroups import ScenarioCgroups
from diag.units import format_bytes
from tests.engine.startup import finding, primaries, start_and_record
from tests.livecg import require_live

pytestmark = [pytest.mark.live, pytest.mark.process, pytest.mark.slow]
MIB = 1 << 20
HUGE_CTX = 32768
SANE_CTX = 2048
GROUP_IN_MODELS = 5  # the group's limit, in model sizes: room for the weights, the server and a sane context


def _kv_bytes(model: WrittenModel, n_ctx: int) -> int:
    """The f16 KV cache of the written model (K and V, every layer, one n_embd-wide row per position: no GQA)."""
    return 2 * model.shape.n_layer * n_ctx * model.shape.n_embd * 2


def _run(tmp_path: Path, model: WrittenModel, n_ctx: int, name: str):  # type: ignore[no-untyped-def]
    require_live()
    made = ScenarioCgroups(prefix="llmdiag-engine")
    try:
        group = made.create(name, GROUP_IN_MODELS * model.file_bytes)
        run = start_and_record(tmp_path, EngineSettings(model=model.path, n_ctx=n_ctx), group, name)
    finally:
        made.close()
    assert not made.leftovers
    print(name, primaries(run), run.oom_kills, [(f.rule, round(f.confidence, 2), f.summary) for f in run.analysis.findings])
    return run


def test_an_n_ctx_whose_kv_cache_dwarfs_the_model_is_unsafe_config(tmp_path: Path, engine_model: WrittenModel) -> None:
    kv = _kv_bytes(engine_model, HUGE_CTX)
    assert kv + engine_model.file_bytes > GROUP_IN_MODELS * engine_model.file_bytes  # the premise: it cannot fit
    run = _run(tmp_path, engine_model, HUGE_CTX, "ctx-huge")
    assert not run.started and run.oom_kills >= 1, run.error  # killed while it reserved the cache
    assert primaries(run) == ("unsafe_config",) * 3, (run.cli["findings"], run.bundle["findings"])
    config = finding(run, "config.unsafe")
    s = engine_model.shape
    assert f"n_ctx {HUGE_CTX}: KV cache f16 = 2 x {s.n_layer} layers x n_ctx {HUGE_CTX} x {s.n_embd}" in config.summary
    assert format_bytes(kv) in config.summary and f"{kv / engine_model.file_bytes:.1f} x the weights" in config.summary
    evidence = {e.what: e.value for e in config.evidence}
    assert evidence["KV cache reserved by n_ctx (1 server(s))"] == kv, evidence
    assert "set n_ctx" in config.remediation[0]
    oom = finding(run, "oom.host")  # the symptom: contributing, just under the cause
    assert 0.5 <= oom.confidence < config.confidence and "unsafe-configuration finding" in oom.summary
    assert "host_oom" in run.cli["verdict"]["contributing"]


def test_the_same_group_with_a_sane_n_ctx_starts_and_is_not_flagged(tmp_path: Path, engine_model: WrittenModel) -> None:
    assert _kv_bytes(engine_model, SANE_CTX) < engine_model.file_bytes  # the premise: the weights dominate
    run = _run(tmp_path, engine_model, SANE_CTX, "ctx-sane")
    assert run.started and run.oom_kills == 0, run.error
    assert "config.unsafe" in run.analysis.evaluated  # judged on the same settings, not skipped
    config = finding(run, "config.unsafe")
    assert config is None or config.confidence < 0.3, config
    assert primaries(run)[0] not in ("unsafe_config", "host_oom")
