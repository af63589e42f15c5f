"""The generated promtool unit tests pass on the generated rules, and fail when a rule is broken.

Each promtool run evaluates hours of rule time and takes 10-25 s of one core; the runs are independent,
so the module starts them all at once (``runs``) and each test waits for its own: on two cores that
is about half the wall time of running them one after the other, and every run is still checked.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from alerts.generate import DEFAULT_OUT

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian package prometheus; `make test` installs it)"
)


# (rule text to break, its replacement, the name of the generated test that must then fail)
BREAKAGES = [
    (">= 50)", ">= 0)", "min-events gate"),  # no gate on the medium page: one error among 13 requests pages
    # a slower fast tier misses its detection time: 2 h clean + ceil(14.4 x 0.01 x 60 min) + 1
    ("> 0.144)", "> 0.2)", "time: 2h10m"),
    ('le="2.5"', 'le="5.0"', "every request failing"),  # the wrong bucket counts slow requests as good
]
Run = Future[subprocess.CompletedProcess[str]]


def _run(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    """Every promtool run of this module, started together: ``"cli"`` and one per broken rule (keyed by the rule text)."""
    with ThreadPoolExecutor(max_workers=1 + len(BREAKAGES)) as pool:
        started = {"cli": pool.submit(_run, [sys.executable, "-m", "diag.cli", "alerts", "test"], 900)}
        for old, new, _failing in BREAKAGES:
            test_file = _broken_copy(tmp_path_factory.mktemp("broken"), old, new)
            started[old] = pool.submit(_run, [str(PROMTOOL), "test", "rules", str(test_file)], 600)
        yield started


@pytest.mark.slow
@pytest.mark.process
def test_diag_alerts_test_runs_every_generated_test(runs: dict[str, Run]) -> None:
    result = runs["cli"].result()
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    files = sorted(p.name for p in (DEFAULT_OUT / "tests").glob("*.test.yaml"))
    assert files == ["causes.test.yaml", "fleet.test.yaml", "slo-availability.test.yaml", "slo-e2e.test.yaml",
                     "slo-queue-wait.test.yaml", "slo-ttft.test.yaml"]  # fmt: skip
    assert result.stdout.count("SUCCESS") == len(files)


def test_every_slo_has_every_case_and_every_cause_a_test() -> None:
    for slo in ("availability", "ttft", "queue-wait", "e2e"):
        names = [t["name"] for t in yaml.safe_load((DEFAULT_OUT / "tests" / f"slo-{slo}.test.yaml").read_text())["tests"]]
        for case in (
            "healthy traffic",
            "every tier",
            "full outage pages by",
            "then clears on recovery",
            "opens a ticket, no page",
            "zero traffic",
            "pages nobody (min-events gate)",
            "absent alert after",
            "target down",
        ):
            assert any(case in n for n in names), (slo, case, names)
    rules = yaml.safe_load((DEFAULT_OUT / "causes.rules.yaml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    tests = yaml.safe_load((DEFAULT_OUT / "tests" / "causes.test.yaml").read_text())["tests"]
    tested = {t["alert_rule_test"][1]["alertname"] for t in tests}
    assert tested == alerts


def _broken_copy(tmp_path: Path, old: str, new: str) -> Path:
    out = tmp_path / "generated"
    shutil.copytree(DEFAULT_OUT, out)
    rules = out / "slo-ttft.rules.yaml"
    text = rules.read_text()
    assert old in text
    rules.write_text(text.replace(old, new))
    return out / "tests" / "slo-ttft.test.yaml"


@pytest.mark.process
@pytest.mark.parametrize(("old", "new", "failing"), BREAKAGES)
def test_generated_tests_catch_a_broken_rule(runs: dict[str, Run], old: str, new: str, failing: str) -> None:
    result = runs[old].result()  # promtool on a copy of the generated rules with `old` replaced by `new`
    assert result.returncode != 0
    assert failing in result.stdout + result.stderr
