"""Every form an SLO spec takes -- a family, a histogram with a threshold, a Sloth-style raw ratio -- validated in one
line, generated, and proven by real promtool; an engine spec (vLLM) gets the engine's cause alerts instead of ours.

The promtool runs are real (``promtool test rules`` on the generated tests) and started together: each evaluates
hours of rule time. Every form is also shown to catch a broken rule, so a pass is not a blind check.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from alerts import engine_causes as ec
from alerts.generate import render, write
from alerts.spec import DEFAULT_SPEC_PATH, SpecError, load_spec, parse_spec
from collectors import backends
from diag.rules import levels
from diag.rules.classes import INCIDENT_CLASSES

PROMTOOL = shutil.which("promtool")
pytestmark = [pytest.mark.process, pytest.mark.slow,
              pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package prometheus)")]  # fmt: skip
ALERTS = DEFAULT_SPEC_PATH.parent
TGI_SPEC, VLLM_SPEC = ALERTS / "slo-tgi.yaml", ALERTS / "slo-vllm.yaml"
# A spec of the HTTP front end's counter, both as a family and as a raw ratio over the same family.
HTTP_SPEC: dict[str, Any] = {
    "version": 1, "model_label": "model_name", "labels": {"team": "llm"}, "grafana_url": "http://127.0.0.1:3000",
    "slos": [
        {"name": "http-availability", "objective": 99.5,
         "availability": {"metric": "http_requests_total", "label": "status", "good": ["2xx", "3xx", "4xx"]}},
        {"name": "http-5xx", "objective": 99.5,
         "error_query": 'sum by (job, model_name) (increase(http_requests_total{status=~"5.."}[{{.window}}]))',
         "total_query": "sum by (job, model_name) (increase(http_requests_total[{{.window}}]))"},
        {"name": "tgi-itl", "objective": 99, "latency": {"metric": "tgi_request_mean_time_per_token_duration",
                                                         "threshold": 0.0656840835571289}},
    ],
}  # fmt: skip
Run = Future[subprocess.CompletedProcess[str]]


def _generate(out: Path, doc: dict[str, Any], source: str) -> Path:
    write(render(parse_spec(doc), INCIDENT_CLASSES, source), out)
    return out


def _promtool(test_file: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(PROMTOOL), "test", "rules", str(test_file)], capture_output=True, text=True, timeout=900)


def _break(out: Path, rule_file: str, old: str, new: str) -> Path:
    path = out / rule_file
    text = path.read_text()
    assert old in text, (rule_file, old)
    path.write_text(text.replace(old, new))
    return out


# (spec, rule file to break, text, replacement, test file that must then fail)
BREAKAGES = [
    ("vllm", "engine-vllm.rules.yaml", f">= {levels.KV_CEILING}", ">= 0.99", "engine-vllm.test.yaml"),
    ("vllm", "engine-vllm.rules.yaml", ">= 3 *", ">= 30 *", "engine-vllm.test.yaml"),
    ("tgi", "slo-server-errors.rules.yaml", 'err=~"generation|dropped|incomplete"', 'err="dropped"',
     "slo-server-errors.test.yaml"),
    ("tgi", "slo-e2e.rules.yaml", 'le="2.5251168294042348"', 'le="2.5"', "slo-e2e.test.yaml"),
    ("http", "slo-http-5xx.rules.yaml", 'status=~"5.."', 'status=~"4.."', "slo-http-5xx.test.yaml"),
]  # fmt: skip


def _docs() -> dict[str, dict[str, Any]]:
    return {"vllm": yaml.safe_load(VLLM_SPEC.read_text()), "tgi": yaml.safe_load(TGI_SPEC.read_text()), "http": HTTP_SPEC}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Each spec generated and every test file run by promtool; then each breakage's run. All started together."""
    docs = _docs()
    outs = {name: _generate(tmp_path_factory.mktemp(name), doc, f"{name}.yaml") for name, doc in docs.items()}
    with ThreadPoolExecutor(max_workers=2) as pool:
        clean = {(name, p.name): pool.submit(_promtool, p) for name, out in outs.items()
                 for p in sorted((out / "tests").glob("*.test.yaml"))}  # fmt: skip
        broken: dict[tuple[str, str], Run] = {}
        for spec, rule_file, old, new, test_file in BREAKAGES:
            out = _break(_generate(tmp_path_factory.mktemp(f"broken-{spec}"), docs[spec], f"{spec}.yaml"), rule_file, old, new)
            broken[(spec, old)] = pool.submit(_promtool, out / "tests" / test_file)
        yield {"outs": outs, "clean": clean, "broken": broken}


def test_every_form_generates_tests_that_pass_on_real_promtool(runs: dict[str, Any]) -> None:
    files = {key: run.result() for key, run in runs["clean"].items()}
    for key, result in files.items():
        assert result.returncode == 0, (key, result.stdout[-3000:], result.stderr[-2000:])
    names = {key[1] for key in files}
    assert {"engine-vllm.test.yaml", "slo-server-errors.test.yaml", "slo-e2e.test.yaml", "slo-http-5xx.test.yaml",
            "slo-http-availability.test.yaml", "slo-tgi-itl.test.yaml"} <= names  # fmt: skip
    outs = runs["outs"]
    raw = yaml.safe_load((outs["http"] / "tests" / "slo-http-5xx.test.yaml").read_text())["tests"]
    assert any("raw ratio" in t["name"] and "promql_expr_test" in t for t in raw)
    engine = yaml.safe_load((outs["vllm"] / "tests" / "engine-vllm.test.yaml").read_text())["tests"]
    assert {t["alert_rule_test"][1]["alertname"] for t in engine} == {ec.KV_ALERT, ec.QUEUE_ALERT, ec.PREEMPT_ALERT}
    assert all(t["alert_rule_test"][1]["exp_alerts"] for t in engine)  # each fires with its labels and annotations


BROKEN = [(s, o) for s, _, o, _, _ in BREAKAGES]


@pytest.mark.parametrize(("spec", "old"), BROKEN, ids=[f"{s}:{o}" for s, o in BROKEN])
def test_the_generated_tests_catch_a_broken_rule(runs: dict[str, Any], spec: str, old: str) -> None:
    result = runs["broken"][(spec, old)].result()
    assert result.returncode != 0, result.stdout[-2000:]
    assert "FAILED" in result.stdout + result.stderr


def test_the_vllm_spec_gets_vllm_cause_alerts_instead_of_the_trackers(runs: dict[str, Any]) -> None:
    out = runs["outs"]["vllm"]
    engine = yaml.safe_load((out / "engine-vllm.rules.yaml").read_text())["groups"][0]["rules"]
    kv = next(r for r in engine if r["alert"] == ec.KV_ALERT)
    assert backends.VLLM_KV_USAGE.name in kv["expr"] and backends.VLLM_PREEMPTIONS.name in kv["expr"]
    assert f">= {levels.KV_CEILING}" in kv["expr"] and f">= {levels.PREEMPTIONS_UP}" in kv["expr"]
    assert "/d/llmdiag-engine?" in kv["annotations"]["dashboard_url"]
    causes = {r["alert"] for g in yaml.safe_load((out / "causes.rules.yaml").read_text())["groups"] for r in g["rules"]}
    assert "LLMDiagOOMKill" in causes and "LLMDiagMemoryPressure" in causes  # the host's causes stay
    assert not causes & {"LLMDiagQueueWaitDominates", "LLMDiagRequestsRefused", "LLMDiagMemoryGuardRefusing"}
    ours = render(load_spec(), INCIDENT_CLASSES)
    assert not any(name.startswith("engine-") for name in ours.files)  # our tracker's spec: no engine alerts
    assert "LLMDiagQueueWaitDominates" in ours.files["causes.rules.yaml"]


def test_histogram_form_snaps_to_the_declared_bound_and_accepts_tgi() -> None:
    spec = load_spec(TGI_SPEC)
    e2e = next(s for s in spec.slos if s.name == "e2e")
    assert e2e.sli.threshold in backends.TGI_REQUEST_DURATION.buckets  # type: ignore[union-attr]
    http = parse_spec(HTTP_SPEC)
    assert [type(s.sli).__name__ for s in http.slos] == ["Availability", "RawRatio", "Latency"]


def _slo_doc(**slo: Any) -> dict[str, Any]:
    return {"version": 1, "slos": [{"name": "x", "objective": 99, **slo}]}


ERRORS = [
    (_slo_doc(histogram="tgi_request_duration", threshold_seconds=2.5),
     "slos[0].threshold_seconds: 2.5 s is not a bucket boundary"),
    (_slo_doc(histogram="vllm:no_such_seconds", threshold_seconds=1),
     "slos[0].histogram: 'vllm:no_such_seconds' is not a histogram"),
    (_slo_doc(histogram="tgi_request_count", threshold_seconds=1), "is a counter, not a histogram"),
    (_slo_doc(threshold_seconds=1), "slos[0].histogram: required with threshold_seconds"),
    (_slo_doc(histogram="tgi_request_duration"), "slos[0].threshold_seconds: required"),
    (_slo_doc(total_query="sum(increase(x[{{.window}}]))"), "slos[0].error_query: required with total_query"),
    (_slo_doc(error_query="sum(increase(x[{{.window}}]))"), "slos[0].total_query: required"),
    (_slo_doc(error_query="sum(rate(x[5m]))", total_query="sum(increase(x[{{.window}}]))"), "has no {{.window}}"),
    (_slo_doc(error_query="sum(increase(x[{{.window}}])", total_query="sum(increase(x[{{.window}}]))"), "unclosed '('"),
    (_slo_doc(error_query='x{a="b}[{{.window}}]', total_query="sum(increase(x[{{.window}}]))"), "unterminated string"),
    (_slo_doc(histogram="tgi_request_duration", threshold_seconds=1.1222741464, error_query="a", total_query="b"),
     "give exactly one of"),
    (_slo_doc(availability={"metric": "tgi_queue_size", "label": "x", "good": ["y"]}), "is a gauge, not a counter"),
    ({"version": 1, "engine": "sglang", "slos": [{"name": "x", "objective": 99,
      "availability": {"metric": "http_requests_total", "label": "status", "good": ["2xx"]}}]}, "spec.engine: 'sglang'"),
]  # fmt: skip


@pytest.mark.parametrize(("doc", "message"), ERRORS, ids=[m for _, m in ERRORS])
def test_bad_forms_are_refused_in_one_line_naming_the_field(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(doc)
    text = str(err.value)
    assert message in text, text
    assert "\n" not in text and len(text) < 2000
