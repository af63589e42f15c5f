"""The fleet recording rules: generated for every spec, accepted by promtool, their unit tests pass and catch a break.

The rules' values are checked by the generated promtool test (alerts/generated/tests/fleet.test.yaml: two hosts,
one stalling in a group more than on the host, one without kernel-log access, an engine's scrape that must not
count); here that test is run, and run against broken copies of the rules, which it must fail.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from alerts import fleet_names as fleet
from alerts.generate import DEFAULT_OUT, render
from alerts.spec import load_spec
from diag.rules.classes import INCIDENT_CLASSES

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package prometheus)")


def _rules(text: str) -> dict[str, str]:
    return {r["record"]: r["expr"] for g in yaml.safe_load(text)["groups"] for r in g["rules"]}


def test_every_fleet_name_is_recorded_by_every_spec() -> None:
    for spec_file in ("alerts/slo.yaml", "alerts/slo-vllm.yaml", "alerts/slo-tgi.yaml"):
        files = render(load_spec(Path(spec_file)), INCIDENT_CLASSES, spec_file).files
        assert set(_rules(files[fleet.RULE_FILE])) == fleet.NAMES, spec_file
        assert "tests/fleet.test.yaml" in files


def test_each_rule_keeps_the_host_labels() -> None:
    """The dashboard filters them by job and instance: a rule that aggregated those away would show the whole fleet."""
    for name, expr in _rules((DEFAULT_OUT / fleet.RULE_FILE).read_text()).items():
        assert expr.startswith("max by (job, instance"), (name, expr)


def _run(test_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(PROMTOOL), "test", "rules", "fleet.test.yaml"], cwd=test_dir, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip


@needs_promtool
@pytest.mark.process
def test_the_generated_promtool_test_passes() -> None:
    result = _run(DEFAULT_OUT / "tests")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


BREAKS = [
    # only the host's PSI: a's group stalling at 0.5 goes unseen
    (
        "llmdiag_cgroup_pressure_memory_stalled_seconds_total[5m]",
        'llmdiag_cgroup_pressure_memory_stalled_seconds_total{cgroup="/"}[5m]',
        fleet.WORST_MEMORY_STALL,
    ),
    ("max_over_time(llmdiag_incident[1h])", "llmdiag_incident", fleet.INCIDENT_1H),  # forgets the hour
    ('scope="hierarchical"', 'scope="local"', fleet.OOM_KILLS_1H),  # a group's own kills only, children's missed
    ("and on (job, instance)", "or on (job, instance)", fleet.AGENT_SERIES),  # the engine's scrape counted too
]


@needs_promtool
@pytest.mark.process
@pytest.mark.parametrize(("old", "new", "rule"), BREAKS, ids=[b[2] for b in BREAKS])
def test_the_promtool_test_fails_on_a_broken_rule(tmp_path: Path, old: str, new: str, rule: str) -> None:
    text = (DEFAULT_OUT / fleet.RULE_FILE).read_text()
    assert old in text, old
    (tmp_path / fleet.RULE_FILE).write_text(text.replace(old, new))
    (tmp_path / "tests").mkdir()
    shutil.copy(DEFAULT_OUT / "tests" / "fleet.test.yaml", tmp_path / "tests")
    result = _run(tmp_path / "tests")
    assert result.returncode != 0
    assert f'expr: "{rule}"' in result.stdout + result.stderr, result.stdout[-3000:]
