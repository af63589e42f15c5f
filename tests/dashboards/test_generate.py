"""The generated dashboards: schema-valid, lint-clean, laid out correctly, catalog-checked, committed fresh.

Every check here is also shown to fail on a seeded defect (an unknown metric, an overlap, a fixed
rate window, a stale file), so a pass means the property holds rather than the check being blind.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from alerts import slo_names
from collectors import backends
from collectors import catalog as cat
from dashboards import definitions
from dashboards.build import LayoutError, check_dashboard, render
from dashboards.generate import DEFAULT_OUT, documents, stale
from dashboards.lint import lint
from dashboards.paths import GRAFANA_DASHBOARDS_DIR
from dashboards.promql import UnknownMetric, check_expr, known_metrics, metric_names, q, sel, series_known

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = REPO / "tests" / "fixtures" / "external" / "grafana-jsonschema"
DIAG = [sys.executable, "-m", "diag.cli"]
FAMILY = series_known()  # series name (histogram parts too) -> family
EXPECTED_UIDS = {"llmdiag-overview", "llmdiag-slo", "llmdiag-latency", "llmdiag-memory", "llmdiag-gpu",
                 "llmdiag-batching-moe", "llmdiag-engine", "llmdiag-fleet"}  # fmt: skip


@pytest.fixture(scope="module")
def boards() -> dict[str, dict[str, Any]]:
    return {d.uid: render(d) for d in definitions.all_dashboards()}


def _schema(name: str) -> dict[str, Any]:
    return json.loads((SCHEMAS / f"{name}.jsonschema.json").read_text())


def _validator(name: str, definition: str | None = None) -> jsonschema.Draft7Validator:
    schema = _schema(name)
    if definition is not None:
        schema = {**schema, "$ref": f"#/definitions/{definition}"}
    return jsonschema.Draft7Validator(schema)


def schema_errors(board: dict[str, Any]) -> list[str]:
    """Dashboard schema, then each panel's options / custom field config and each target against their schemas."""
    errors = [f"dashboard: {e.message}" for e in _validator("dashboard").iter_errors(board)]
    target_v = _validator("prometheus")
    for p in board["panels"]:
        if p["type"] == "row":
            continue
        kind = p["type"]
        errors += [f"{p['title']} options: {e.message}" for e in _validator(kind, "Options").iter_errors(p["options"])]
        if "FieldConfig" in _schema(kind)["definitions"]:
            custom = p["fieldConfig"]["defaults"].get("custom", {})
            errors += [f"{p['title']} custom: {e.message}" for e in _validator(kind, "FieldConfig").iter_errors(custom)]
        for t in p["targets"]:
            errors += [f"{p['title']} target: {e.message}" for e in target_v.iter_errors(t)]
    return errors


def test_the_set_is_the_eight_dashboards_with_stable_uids_and_the_tag(boards: dict[str, dict[str, Any]]) -> None:
    assert set(boards) == EXPECTED_UIDS
    titles = {b["title"] for b in boards.values()}
    assert titles == {"llm-diag / Overview", "llm-diag / SLOs", "llm-diag / Latency phases", "llm-diag / Memory & pressure",
                      "llm-diag / GPU", "llm-diag / Batching & MoE", "llm-diag / Inference engine",
                      "llm-diag / Fleet overview"}  # fmt: skip
    for b in boards.values():
        assert "llm-diag" in b["tags"] and b["editable"] is False and "__inputs" not in b
        (link,) = b["links"]
        assert link["type"] == "dashboards" and link["tags"] == ["llm-diag"] and link["keepTime"] and link["includeVars"]
        variables = {v["name"]: v for v in b["templating"]["list"]}
        slo = b["uid"] == "llmdiag-slo"
        assert variables["datasource"]["type"] == "datasource" and "current" not in variables["datasource"]
        for name in set(variables) - {"datasource"}:
            assert variables[name]["multi"] and variables[name]["allValue"] == ".+"
        if b["uid"] == "llmdiag-fleet":  # per host, no panel per model: a model variable would filter nothing
            assert list(variables) == ["datasource", "job", "instance"]
        else:
            assert list(variables) == ["datasource", "job", "instance", *(["slo"] if slo else []), "model"]
            model = variables["model"]["query"]
            if slo:  # the SLO rules' own series: the recording rules already name vLLM's model_name `model`
                assert model.startswith("label_values(llmdiag:slo_requests:increase5m{") and 'slo=~"$slo"' in model
            else:  # scoped to request series of each family, never label_values(model)
                assert "llmdiag_requests_total" in model and "vllm:num_requests_running" in model and '"model_name"' in model
                assert variables["model"]["regex"] == '/model="([^"]+)"/'
        (oom,) = b["annotations"]["list"]
        assert "llmdiag_oom_kills_total" in oom["expr"] and "node_vmstat_oom_kill" in oom["expr"]


def test_uids_do_not_depend_on_content() -> None:
    before = {d.uid for d in definitions.all_dashboards()}
    assert before == EXPECTED_UIDS and all(len(u) <= 40 for u in before)


def test_every_dashboard_validates_against_grafanas_json_schema(boards: dict[str, dict[str, Any]]) -> None:
    for uid, b in boards.items():
        assert schema_errors(b) == [], uid


def test_the_schema_check_catches_a_bad_dashboard(boards: dict[str, dict[str, Any]]) -> None:
    bad = copy.deepcopy(boards["llmdiag-overview"])
    bad["panels"][1]["gridPos"]["w"] = "12"
    bad["bogus"] = 1
    bad["panels"][2]["options"]["graphMode"] = "sparkle"
    assert len(schema_errors(bad)) >= 3


def test_the_linter_port_passes_with_zero_violations(boards: dict[str, dict[str, Any]]) -> None:
    for b in boards.values():
        assert [str(v) for v in lint(b)] == []


@pytest.mark.parametrize(
    ("rule", "mutate"),
    [
        ("uneditable-dashboard", lambda b: b.update(editable=True)),
        ("template-datasource-rule", lambda b: b["templating"]["list"][0].update(name="ds")),
        ("template-instance-rule", lambda b: b["templating"]["list"][2].update(allValue=".*")),
        ("template-job-rule", lambda b: b["templating"]["list"][1].update(multi=False)),
        ("template-on-time-change-reload-rule", lambda b: b["templating"]["list"][3].update(refresh=1)),
        ("panel-datasource-rule", lambda b: b["panels"][1].update(datasource={"type": "prometheus", "uid": "abc123"})),
        ("panel-title-description-rule", lambda b: b["panels"][1].update(description="")),
        ("panel-units-rule", lambda b: b["panels"][1]["fieldConfig"]["defaults"].update(unit="tok/s")),
        ("panel-no-targets-rule", lambda b: b["panels"][1].update(targets=[])),
        ("target-rate-interval-rule", lambda b: b["panels"][1]["targets"][0].update(
            expr=b["panels"][1]["targets"][0]["expr"].replace("$__rate_interval", "5m"))),
        ("target-instance-rule", lambda b: b["panels"][1]["targets"][0].update(
            expr=b["panels"][1]["targets"][0]["expr"].replace(', instance=~"$instance"', ""))),
        ("target-job-rule", lambda b: b["panels"][1]["targets"][0].update(
            expr=b["panels"][1]["targets"][0]["expr"].replace('job=~"$job", ', ""))),
        ("target-counter-agg-rule", lambda b: b["panels"][1]["targets"][0].update(
            expr='sum(llmdiag_requests_total{job=~"$job", instance=~"$instance"})')),
        ("target-promql-rule", lambda b: b["panels"][1]["targets"][0].update(expr="sum(rate(up[$__rate_interval])")),
    ],
)  # fmt: skip
def test_each_lint_rule_catches_its_defect(boards: dict[str, dict[str, Any]], rule: str, mutate: Any) -> None:
    bad = copy.deepcopy(boards["llmdiag-overview"])
    mutate(bad)
    assert rule in {v.rule for v in lint(bad)}


def test_panel_ids_refids_and_grid(boards: dict[str, dict[str, Any]]) -> None:
    for b in boards.values():
        ids = [p["id"] for p in b["panels"]]
        assert len(ids) == len(set(ids)) and min(ids) >= 1
        for p in b["panels"]:
            g = p["gridPos"]
            assert g["x"] + g["w"] <= 24
            refs = [t["refId"] for t in p.get("targets", [])]
            assert len(refs) == len(set(refs))
        check_dashboard(b)  # the same checks the generator runs, on the final JSON


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b["panels"][2]["gridPos"].update(x=b["panels"][1]["gridPos"]["x"]), "overlap"),
        (lambda b: b["panels"][1]["gridPos"].update(x=20, w=8), "24-column"),
        (lambda b: b["panels"][2].update(id=b["panels"][1]["id"]), "duplicate id"),
        (lambda b: b["panels"][1]["targets"].append(dict(b["panels"][1]["targets"][0])), "refIds"),
        (lambda b: b["panels"][0]["gridPos"].update(w=12), "full width"),
    ],
)
def test_the_post_build_pass_rejects_a_broken_grid(boards: dict[str, dict[str, Any]], mutate: Any, message: str) -> None:
    bad = copy.deepcopy(boards["llmdiag-overview"])
    mutate(bad)
    with pytest.raises(LayoutError, match=message):
        check_dashboard(bad)


def test_a_panel_naming_an_unknown_metric_fails_generation_with_its_name() -> None:
    with pytest.raises(UnknownMetric, match="llmdiag_gpu_temperature_celsius"):
        sel("llmdiag_gpu_temperature_celsius")
    with pytest.raises(UnknownMetric, match="vllm:num_requests_swapped"):  # removed upstream: declared nowhere
        q('vllm:num_requests_swapped{job=~"$job", instance=~"$instance"}')
    # A raw string smuggled past the helpers is caught by the final scan of the JSON.
    board = render(definitions.gpu())
    board["panels"][1]["targets"][0]["expr"] += ' or llmdiag_made_up_bytes{job=~"$job"}'
    with pytest.raises(UnknownMetric, match="llmdiag_made_up_bytes"):
        check_dashboard(board)


@pytest.mark.process
def test_the_cli_reports_an_unknown_metric_in_one_line(tmp_path: Path) -> None:
    script = (
        "import sys\nfrom dashboards import definitions, generate\nfrom dashboards.promql import q\n"
        "from dashboards.spec import Dashboard, Row, ts\n"
        "generate.all_dashboards = lambda: [Dashboard('x', 'x', 'x', (Row('r', (ts('t', 'd', 's', "
        'q(\'llmdiag_no_such_seconds{job=~"$job", instance=~"$instance"}\')),)),))]\n'
        "from diag.cli.main import app\nsys.argv = ['diag', 'dashboards', '--out', sys.argv[1]]\napp()\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "llmdiag_no_such_seconds" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def _described(description: str) -> list[re.Pattern[str]]:
    """Metric names written in a description, as patterns: ``a_*_total``, ``a_{x,y}_bytes`` and ``ratio<W>`` allowed."""
    out = []
    for word in re.findall(r"(?:llmdiag|vllm|tgi|node|container|DCGM|up)[\w:*{},<>]*", description):
        word = word.rstrip(",:")
        pattern = re.escape(word).replace(r"\*", r"\w+").replace("<W>", r"\w+")
        pattern = re.sub(r"\\\{([^}]*)\\\}", lambda m: "(" + m.group(1).replace(",", "|") + ")", pattern)
        out.append(re.compile(pattern + "$"))
    return out


def test_descriptions_name_the_metrics_they_query(boards: dict[str, dict[str, Any]]) -> None:
    for b in boards.values():
        for p in b["panels"]:
            if p["type"] == "row":
                continue
            names = set().union(*(metric_names(t["expr"]) for t in p["targets"]))
            families = {FAMILY[n] for n in names}
            patterns = _described(p["description"])
            assert any(pat.match(f) for pat in patterns for f in families), (b["uid"], p["title"], families)
            assert p["fieldConfig"]["defaults"].get("unit"), (b["uid"], p["title"])
            assert len(p["description"]) > 80  # the metrics *and* what to do


def test_ratios_are_nan_safe(boards: dict[str, dict[str, Any]]) -> None:
    for b in boards.values():
        for p in b["panels"]:
            for t in p.get("targets", []):
                # every division by a series is by (den > 0); constants (/ 100) and group_left joins excepted
                for m in re.finditer(r"\)\s*/\s*(?!\(1 - )(\(|[a-zA-Z])", t["expr"]):
                    tail = t["expr"][m.start() :]
                    assert re.match(r"\)\s*/\s*(\(.*> 0\)|on\()", tail, re.S), (p["title"], t["expr"])


def test_upstream_names_are_pinned_data_with_versions(boards: dict[str, dict[str, Any]]) -> None:
    known = known_metrics()
    upstream = {f.name: f for f in cat.DASHBOARD_UPSTREAM}
    used = set()
    for b in boards.values():
        for p in b["panels"]:
            for t in p.get("targets", []):
                used |= {FAMILY[n] for n in metric_names(t["expr"])}
    theirs = {n for n in used if not n.startswith("llmdiag")} - {"up"}
    assert theirs, "no upstream equivalents queried"
    exporters = set()
    for name in theirs:
        # an inference backend's family as collectors.backends declares it, or another exporter's from the catalog
        if name in backends.FAMILIES:
            fam = backends.FAMILIES[name]
            assert fam.versions, name
            exporters.add(backends.DIALECT_NAMES[fam.dialect])
        else:
            assert name in upstream, name
            assert upstream[name].versions
            exporters.add(upstream[name].exporter)
        assert known[name]
    assert exporters == {"vLLM", "TGI", "llama.cpp server", "node_exporter", "cAdvisor", "dcgm-exporter"}


def test_overview_slo_panels_query_the_alerts_recording_rules(boards: dict[str, dict[str, Any]]) -> None:
    exprs = [t["expr"] for p in boards["llmdiag-overview"]["panels"] for t in p.get("targets", [])]
    burn = [e for e in exprs if "llmdiag:slo_error_ratio:ratio1h" in e]
    assert burn and "/ on(slo, model) group_left() (1 - llmdiag:slo_objective:ratio" in burn[0]
    assert any(slo_names.PERIOD_RATIO in e for e in exprs)
    assert not any(re.search(r"ratio(30d|28d|7d)\b", e) for b in boards.values() for p in b["panels"]
                   for e in (t["expr"] for t in p.get("targets", [])))  # fmt: skip


def test_the_slo_dashboard_answers_per_slo_and_model(boards: dict[str, dict[str, Any]]) -> None:
    """Attainment, budget left, each tier's windows against its threshold, burn rates: from the rules' own series."""
    board = boards["llmdiag-slo"]
    panels = {p["title"]: p for p in board["panels"] if p["type"] != "row"}
    assert {"Attainment", "Error budget remaining", definitions.TIER_PANEL, "Burn rate", definitions.EVENTS_PANEL} <= set(panels)
    tier = [t["expr"] for t in panels[definitions.TIER_PANEL]["targets"]]
    assert [metric_names(e) for e in tier] == [{slo_names.TIER_LONG_RATIO}, {slo_names.TIER_SHORT_RATIO},
                                               {slo_names.TIER_THRESHOLD}]  # fmt: skip
    burn = {n for t in panels["Burn rate"]["targets"] for n in metric_names(t["expr"])}
    assert burn == {slo_names.RATIO.format(w=w) for w in slo_names.WINDOWS} | {slo_names.OBJECTIVE}
    for p in panels.values():
        for t in p["targets"]:
            assert 'slo=~"$slo"' in t["expr"] and 'model=~"$model"' in t["expr"], (p["title"], t["expr"])


@pytest.mark.process
def test_one_provisioning_path_everywhere() -> None:
    """The generated provisioning.yaml, `diag dashboards --help` and the README name one directory."""
    provisioning = yaml.safe_load((DEFAULT_OUT / "provisioning.yaml").read_text())
    assert provisioning["providers"][0]["options"]["path"] == GRAFANA_DASHBOARDS_DIR
    help_text = subprocess.run([*DIAG, "dashboards", "--help"], capture_output=True, text=True, timeout=60,
                               env={**os.environ, "COLUMNS": "200"}).stdout  # fmt: skip
    readme = (REPO / "README.md").read_text()
    for text in (help_text, readme):
        assert GRAFANA_DASHBOARDS_DIR in text
        assert set(re.findall(r"/[\w/.-]*grafana/dashboards[\w/.-]*", text)) == {GRAFANA_DASHBOARDS_DIR}


@pytest.mark.process
def test_committed_json_is_fresh_and_the_check_fails_when_stale(tmp_path: Path) -> None:
    assert stale(DEFAULT_OUT) == []
    ok = subprocess.run([*DIAG, "dashboards", "--check"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    copy_dir = tmp_path / "gen"
    shutil.copytree(DEFAULT_OUT, copy_dir)
    path = copy_dir / "llmdiag-memory.json"
    path.write_text(path.read_text().replace("MemAvailable", "MemFree", 1))
    bad = subprocess.run([*DIAG, "dashboards", "--check", "--out", str(copy_dir)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "llmdiag-memory.json" in bad.stderr
    out = tmp_path / "fresh"
    wrote = subprocess.run([*DIAG, "dashboards", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert wrote.returncode == 0, wrote.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(documents())
    assert (out / "provisioning.yaml").read_text().startswith("# Grafana") and "type: file" in (
        out / "provisioning.yaml"
    ).read_text()
    for name, text in documents().items():
        assert (out / name).read_text() == text == (DEFAULT_OUT / name).read_text()


@pytest.mark.process
@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["dashboards", "--check", "preview", "--prometheus", "http://127.0.0.1:1", "--out", "x.html"], "--out/--check"),
        (["dashboards", "preview", "--prometheus", "localhost:9090", "--out", "x.html"], "--prometheus"),
        (["dashboards", "preview", "--prometheus", "http://127.0.0.1:1", "--since", "soon", "--out", "x.html"], "--since"),
        (["dashboards", "preview", "--prometheus", "http://127.0.0.1:1", "--out", "x.png"], "--out"),
    ],
)
def test_bad_cli_input_is_one_line_and_exit_2(argv: list[str], needle: str) -> None:
    proc = subprocess.run([*DIAG, *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr


def test_check_expr_ignores_labels_functions_and_durations() -> None:
    expr = ('histogram_quantile(0.95, sum by (le, phase) (rate(llmdiag_batch_requests_bucket{job=~"$job", '
            'phase="prefill"}[$__rate_interval]))) / on(instance) group_left() (x_y > 0) offset 5m')  # fmt: skip
    assert metric_names(expr) == {"llmdiag_batch_requests_bucket", "x_y"}
    with pytest.raises(UnknownMetric, match="x_y"):
        check_expr(expr)
