"""diag alerts: the generator's output is valid for Prometheus 2.42 and Alertmanager 0.25, and --check catches staleness."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from alerts.cause_rules import UnknownIncidentClass, cause_rule_groups
from alerts.causes import CAUSES
from alerts.generate import DEFAULT_OUT
from alerts.spec import load_spec
from diag.rules.base import INCIDENT_CLASSES

DIAG = [sys.executable, "-m", "diag.cli"]
PROMTOOL = shutil.which("promtool")
AMTOOL = shutil.which("amtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package prometheus)")
needs_amtool = pytest.mark.skipif(AMTOOL is None, reason="amtool not installed (Debian package prometheus-alertmanager)")


def _diag(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*DIAG, *args], capture_output=True, text=True, timeout=120, check=False)


def test_committed_files_are_up_to_date() -> None:
    result = _diag("alerts", "--check")
    assert result.returncode == 0, result.stderr


def test_check_fails_when_stale(tmp_path: Path) -> None:
    assert _diag("alerts", "--out", str(tmp_path)).returncode == 0
    assert _diag("alerts", "--out", str(tmp_path), "--check").returncode == 0
    rules = tmp_path / "slo.rules.yaml"
    rules.write_text(rules.read_text().replace("14.4", "14.5"))
    result = _diag("alerts", "--out", str(tmp_path), "--check")
    assert result.returncode == 1
    assert "slo.rules.yaml" in result.stderr and "stale" in result.stderr


def test_bad_spec_is_one_line_exit_2(tmp_path: Path) -> None:
    doc = yaml.safe_load(Path("alerts/slo.yaml").read_text())
    doc["slos"][1]["latency"]["threshold"] = 2
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    result = _diag("alerts", "--slo", str(bad), "--out", str(tmp_path / "o"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "slos[1].latency.threshold: 2 s is not a bucket boundary" in lines[0]
    assert "Traceback" not in result.stderr and not (tmp_path / "o").exists()
    assert _diag("alerts", "--slo", str(tmp_path / "nope.yaml")).returncode == 2


def test_tier_that_cannot_fire_is_warned_and_left_out(tmp_path: Path) -> None:
    doc = yaml.safe_load(Path("alerts/slo.yaml").read_text())
    doc["slos"] = [doc["slos"][0]]
    doc["slos"][0]["objective"] = 90  # 14.4 x 10 % > 100 %: the fast page can never fire
    spec = tmp_path / "low.yaml"
    spec.write_text(yaml.safe_dump(doc))
    result = _diag("alerts", "--slo", str(spec), "--out", str(tmp_path / "o"))
    assert result.returncode == 0, result.stderr
    assert "tier fast can never fire" in result.stderr and "tier medium can never fire" not in result.stderr
    rules = yaml.safe_load((tmp_path / "o" / "slo.rules.yaml").read_text())
    tiers = [r["labels"]["tier"] for g in rules["groups"] for r in g["rules"] if r.get("alert") == "LLMDiagSLOBurn"]
    assert tiers == ["medium", "slow", "long"]


def test_cause_classes_are_the_engines() -> None:
    classes = {c.diag_class for c in CAUSES if c.diag_class is not None}
    assert classes <= set(INCIDENT_CLASSES)
    assert {"memory_pressure", "host_oom", "thrashing", "queue_backlog", "duplicate_model_processes", "gpu_oom"} <= classes
    with pytest.raises(UnknownIncidentClass, match="host_oom"):
        cause_rule_groups(load_spec(), [c for c in INCIDENT_CLASSES if c != "host_oom"])


def test_recording_rules_follow_the_contract() -> None:
    rules = yaml.safe_load((DEFAULT_OUT / "slo.rules.yaml").read_text())
    names = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    for w in ("5m", "30m", "1h", "2h", "6h", "1d", "3d", "30d"):
        assert {f"llmdiag:slo_errors:increase{w}", f"llmdiag:slo_requests:increase{w}",
                f"llmdiag:slo_error_ratio:ratio{w}"} <= names  # fmt: skip
    assert "llmdiag:slo_objective:ratio" in names
    burn = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "LLMDiagSLOBurn"]
    assert len(burn) == 4 * 4
    for r in burn:
        assert {"slo", "tier", "severity", "long_window", "short_window", "burn_factor"} <= set(r["labels"])
        assert "budget is gone in {{ $value | humanizeDuration }}" in r["annotations"]["summary"]
        assert r["annotations"]["runbook_url"] and r["annotations"]["dashboard_url"]


@needs_promtool
def test_promtool_check_rules() -> None:
    files = sorted(map(str, DEFAULT_OUT.glob("*.rules.yaml")))
    result = subprocess.run([PROMTOOL, "check", "rules", *files], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@needs_promtool
def test_vllm_spec_rules_check(tmp_path: Path) -> None:
    assert _diag("alerts", "--slo", "alerts/slo-vllm.yaml", "--out", str(tmp_path)).returncode == 0
    text = (tmp_path / "slo.rules.yaml").read_text()
    assert 'label_replace(increase(vllm:time_to_first_token_seconds_bucket{le="2.5"}[5m]), "model", "$1", "model_name"' in text
    assert 'le=~"1(\\\\.0)?"' in text  # queue-wait threshold 1.0 s matches "1" and "1.0"
    files = sorted(map(str, tmp_path.glob("*.rules.yaml")))
    result = subprocess.run([PROMTOOL, "check", "rules", *files], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_amtool
def test_alertmanager_snippet_checks_and_routes() -> None:
    config = str(DEFAULT_OUT / "alertmanager.yaml")
    result = subprocess.run([AMTOOL, "check-config", config], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    for labels, receiver in (
        (["alertname=LLMDiagSLOBurn", "severity=page", "tier=fast", "slo=ttft"], "llm-diag-page"),
        (["alertname=LLMDiagSLOBurn", "severity=ticket", "tier=slow", "slo=ttft"], "llm-diag-ticket"),
        (["alertname=LLMDiagOOMKill", "severity=page", "diag_class=host_oom"], "llm-diag-page"),
    ):
        args = ["config", "routes", "test", f"--config.file={config}", f"--verify.receivers={receiver}", *labels]
        routed = subprocess.run([AMTOOL, *args], capture_output=True, text=True, check=False)
        assert routed.returncode == 0, routed.stdout + routed.stderr
    doc = yaml.safe_load(Path(config).read_text())
    fast = doc["inhibit_rules"][0]
    assert fast["source_matchers"] == ['alertname="LLMDiagSLOBurn"', 'tier="fast"', 'slo=~".+"']
    assert fast["target_matchers"] == ['alertname="LLMDiagSLOBurn"', 'tier=~"medium|slow|long"']
    assert fast["equal"] == ["slo", "model"]
