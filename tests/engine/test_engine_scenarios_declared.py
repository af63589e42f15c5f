"""The engine scenarios as declared: each registered with its class and attachments, refused in one line where it
cannot run, and the fourth-copy limit's arithmetic -- no engine, no root, no process.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from diag.demo.engine.copies import limit_for_one_short
from diag.demo.scenarios import ENGINE_SCENARIO_NAMES, SCENARIO_NAMES
from diag.demo.scenarios.engine_scenarios import ATTACHMENTS, ENGINE_ATTACHMENTS
from diag.demo.scenarios.library import SCENARIOS
from diag.rules.classes import HEALTHY, INCIDENT_CLASSES

MIB = 1 << 20


def test_every_engine_scenario_is_registered_apart_from_the_reference_backends() -> None:
    assert set(ENGINE_ATTACHMENTS) == set(ENGINE_SCENARIO_NAMES) <= set(SCENARIOS)
    assert not set(ENGINE_SCENARIO_NAMES) & set(SCENARIO_NAMES)  # their fixtures and suite are the reference backend's
    expected = {name: SCENARIOS[name].expected for name in ENGINE_SCENARIO_NAMES}
    assert set(expected.values()) <= {*INCIDENT_CLASSES, HEALTHY}
    assert expected["engine-healthy"] == HEALTHY and expected["engine-fourth-copy"] == "host_oom"
    for name, attachments in ENGINE_ATTACHMENTS.items():
        assert attachments and set(attachments) <= set(ATTACHMENTS), name
        assert SCENARIOS[name].defaults["attachment"] == attachments[0]  # the default is one it takes


def test_an_attachment_a_scenario_does_not_take_is_a_one_line_usage_error() -> None:
    from diag.cli.main import app

    with pytest.raises(ValueError, match="it takes outside"):
        SCENARIOS["engine-copies"].params({"attachment": "wrapped"})
    result = CliRunner().invoke(app, ["demo", "--scenario", "engine-n-ctx", "--param", "attachment=inside"])
    assert result.exit_code == 2 and "attachment 'inside'" in result.output and "Traceback" not in result.output


def test_a_dialect_on_an_engine_scenario_is_refused_not_ignored() -> None:
    """llama.cpp's server serves its own /metrics: a vLLM or TGI dialect cannot apply there, so asking for one is a
    usage error before anything starts (root or not), while the reference backend's scenarios still take it."""
    from diag.cli.main import app
    from diag.demo.scenarios import run_scenario

    for name in ENGINE_SCENARIO_NAMES:
        with pytest.raises(ValueError, match="cannot apply"):
            SCENARIOS[name].check_dialect("vllm")
        SCENARIOS[name].check_dialect(None)
    SCENARIOS["queue"].check_dialect("tgi")
    with pytest.raises(ValueError, match="--dialect vllm cannot apply"):
        run_scenario("engine-queue", dialect="vllm")
    result = CliRunner().invoke(app, ["demo", "--scenario", "engine-queue", "--dialect", "vllm"])
    assert result.exit_code == 2 and "--dialect vllm cannot apply" in result.output and "Traceback" not in result.output


def test_the_fourth_copy_limit_holds_the_running_copies_and_half_a_model_more() -> None:
    running, model, per_server = 3, 64 * MIB, 110 * MIB
    limit = limit_for_one_short(running * per_server, running, model)
    assert limit == running * per_server + (per_server - model) + model // 2
    assert running * per_server < limit < (running + 1) * per_server  # three fit, a fourth does not
    with pytest.raises(ValueError):
        limit_for_one_short(0, 3, model)
    with pytest.raises(ValueError):
        limit_for_one_short(running * per_server, 0, model)
