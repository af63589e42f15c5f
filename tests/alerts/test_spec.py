"""SLO spec validation: every mistake names its field, the shipped specs load, thresholds are real buckets."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from alerts.receiver_routes import DEFAULT_RECEIVER_URL
from alerts.spec import DEFAULT_SPEC_PATH, SpecError, live_histogram_buckets, load_spec, parse_spec
from collectors import catalog

VLLM_SPEC = DEFAULT_SPEC_PATH.with_name("slo-vllm.yaml")


def _doc() -> dict:
    return yaml.safe_load(DEFAULT_SPEC_PATH.read_text())


def test_default_spec_loads_with_workbook_factors() -> None:
    spec = load_spec()
    assert [s.name for s in spec.slos] == ["availability", "ttft", "queue-wait", "e2e"]
    assert [t.burn_factor(spec.period) for t in spec.slos[0].tiers] == [14.4, 6.0, 3.0, 1.0]
    assert spec.slos[0].budget == 0.005  # rounded, not 0.00499999...


def test_28d_and_7d_periods_scale_the_factors() -> None:
    doc = _doc()
    doc["period"] = "28d"
    assert [t.burn_factor("28d") for t in parse_spec(doc).tiers] == [13.44, 5.6, 2.8, 0.933333]
    doc["period"] = "7d"
    assert parse_spec(doc).tiers[0].burn_factor("7d") == 3.36


def test_vllm_spec_targets_vllm_histograms() -> None:
    spec = load_spec(VLLM_SPEC)
    assert spec.model_label == "model_name"
    assert spec.slos[1].sli.metric == "vllm:time_to_first_token_seconds"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["slos"][1]["latency"].update(threshold=2.0), "slos[1].latency.threshold: 2 s is not a bucket boundary"),
        (lambda d: d["slos"][0].update(objective=100), "slos[0].objective: 100 must be a percentage in (0, 100)"),
        (lambda d: d["slos"][0].update(objective="high"), "slos[0].objective: expected a number"),
        (lambda d: d.update(period="90d"), "spec.period: '90d' is not one of 30d, 28d, 7d"),
        (lambda d: d["tiers"][0].update(severity="urgent"), "spec.tiers[0].severity: 'urgent' is not one of page, ticket"),
        (lambda d: d["tiers"][0].update(short="2h"), "spec.tiers[0].short: 2h must be shorter than long (1h)"),
        (lambda d: d["tiers"][1].update(long="5x"), "spec.tiers[1].long: '5x' is not a duration"),
        (lambda d: d["slos"][2].update(tiers=["fast", "never"]), "slos[2].tiers: 'never' is not a tier"),
        (lambda d: d["slos"][0].update(colour="red"), "slos[0]: unknown field 'colour'"),
        (lambda d: d["slos"][1]["latency"].update(metric="llmdiag_queue_depth"), "slos[1].latency.metric: 'llmdiag_queue_depth'"),
        (lambda d: d["slos"][0]["availability"].update(metric="llmdiag_queue_depth"), "slos[0].availability.metric"),
        (lambda d: d["slos"].append(copy.deepcopy(d["slos"][0])), "slos[4].name: 'availability' is used twice"),
        (lambda d: d["labels"].update(severity="x"), "spec.labels.severity: reserved"),
        (lambda d: d.update(selector="job=llm"), "spec.selector"),
        (lambda d: d["tiers"].reverse(), "spec.tiers: list tiers fastest first"),
        (
            lambda d: d["tiers"][3].update(budget_percent=1e-6),
            "spec.tiers[3].budget_percent: 1e-06 is too small for a 30d period and a 3d window: the burn-rate threshold",
        ),
        (lambda d: d["routing"].update(page_url="http://127.0.0.1:9095/page"), "spec.routing.page_url: replaced by receiver_url"),
        (lambda d: d.update(routing={"ticket_url": "http://x/ticket"}), "spec.routing.ticket_url: replaced by receiver_url"),
        (lambda d: d.update(dashboard_url="http://grafana.local/d/x"), "spec.dashboard_url: replaced by grafana_url"),
        (
            lambda d: d["routing"].update(receiver_url="http://127.0.0.1:9095/webhook"),
            "spec.routing.receiver_url: 'http://127.0.0.1:9095/webhook' has a path (/webhook)",
        ),
        (lambda d: d["routing"].update(receiver_url="127.0.0.1:9095"), "spec.routing.receiver_url: '127.0.0.1:9095' is not"),
        (lambda d: d["routing"].update(receiver_url="http://u:secret@h:9095"), "no user:password"),
        (lambda d: d["routing"].update(receiver_url=""), "spec.routing.receiver_url: empty"),
        (lambda d: d["routing"].update(hook="x"), "spec.routing: unknown field 'hook' (allowed: receiver_url)"),
        (lambda d: d.update(grafana_url="http://g/?orgId=1"), "spec.grafana_url: 'http://g/?orgId=1' is not an http(s) base URL"),
        (lambda d: d.update(grafana_url="ftp://g"), "spec.grafana_url"),
    ],
)
def test_errors_name_the_field(edit, message: str) -> None:
    doc = _doc()
    edit(doc)
    with pytest.raises(SpecError) as err:
        parse_spec(doc)
    assert message in str(err.value)


def test_threshold_error_lists_the_boundaries() -> None:
    doc = _doc()
    doc["slos"][1]["latency"]["threshold"] = 3
    with pytest.raises(SpecError) as err:
        parse_spec(doc)
    listed = str(err.value).split("boundaries: ")[1].rstrip(")")
    assert [float(x) for x in listed.split(", ")] == list(catalog.GENAI_TTFT_BUCKETS)


def test_bad_yaml_and_missing_file_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("slos: [\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(bad)
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path / "absent.yaml")


def test_live_buckets_override_the_catalog() -> None:
    text = (
        "# TYPE vllm:time_to_first_token_seconds histogram\n"
        'vllm:time_to_first_token_seconds_bucket{le="0.5",model_name="m"} 1\n'
        'vllm:time_to_first_token_seconds_bucket{le="2.5",model_name="m"} 2\n'
        'vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 3\n'
        'vllm:time_to_first_token_seconds_count{model_name="m"} 3\n'
        'vllm:time_to_first_token_seconds_sum{model_name="m"} 3\n'
    )
    live = live_histogram_buckets(text)
    assert live == {"vllm:time_to_first_token_seconds": (0.5, 2.5)}
    doc = yaml.safe_load(VLLM_SPEC.read_text())
    doc["slos"] = [doc["slos"][1]]
    assert parse_spec(doc, live).slos[0].sli.threshold == 2.5
    doc["slos"][0]["latency"]["threshold"] = 1.0  # a catalog bucket the live server does not have
    with pytest.raises(SpecError, match=r"1 s is not a bucket boundary .*boundaries: 0.5, 2.5"):
        parse_spec(doc, live)
    doc["slos"][0]["latency"]["metric"] = "vllm:e2e_request_latency_seconds"
    with pytest.raises(SpecError, match="not a histogram on the live /metrics"):
        parse_spec(doc, live)


def test_urls_default_and_trailing_slashes_go() -> None:
    doc = _doc()
    del doc["routing"]
    del doc["grafana_url"]
    spec = parse_spec(doc)
    assert spec.receiver_url == DEFAULT_RECEIVER_URL and spec.grafana_url == ""
    doc.update(grafana_url="https://ops.example.internal/grafana/", routing={"receiver_url": "http://[::1]:9095/"})
    spec = parse_spec(doc)
    assert spec.grafana_url == "https://ops.example.internal/grafana" and spec.receiver_url == "http://[::1]:9095"


def test_the_period_is_never_also_a_window() -> None:
    """A tier whose long window is the period: the period's own group records it, never a second rule of that name."""
    doc = _doc()
    doc["period"] = "7d"
    doc["tiers"].append({"name": "week", "severity": "ticket", "long": "7d", "short": "1d", "budget_percent": 50})
    spec = parse_spec(doc)
    assert "7d" not in spec.windows and "1d" in spec.windows


def _github_anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("spec", [DEFAULT_SPEC_PATH, VLLM_SPEC])
def test_the_shipped_runbook_link_names_a_readme_section(spec: Path) -> None:
    """A runbook link to a section the README does not have opens the top of the page mid-incident."""
    url = load_spec(spec).runbook_url
    path, _, anchor = url.partition("#")
    assert path.endswith("/README.md") and anchor
    readme = (DEFAULT_SPEC_PATH.parents[1] / "README.md").read_text()
    headings = {_github_anchor(h) for h in re.findall(r"^#+ (.+)$", readme, re.M)}
    assert anchor in headings, (anchor, sorted(h for h in headings if h.startswith("alerts")))
