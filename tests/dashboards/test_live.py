"""Every panel query returns data from a real Prometheus over a real system (see livestack.py).

Each ``ours or theirs`` alternative is evaluated on its own, so a broken upstream fallback cannot
hide behind a working llm-diag series: ours over the live window, sources this host cannot produce
over the backfilled window. The combined expression Grafana sends is evaluated over both. SLO panels
read the alert generator's recording rules (alerts/generated/*.rules.yaml); without that file on
this branch they are skipped with the reason, after their other queries were checked. With them,
the SLO-period panel waits (up to ~5 min) for the period rules' first value: they sum 5-minute
increases on 5-minute boundaries, so the first one exists only after such a boundary.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from alerts.slo_names import DASHBOARD_NAMES as SLO_RULES
from alerts.slo_names import PERIOD_RATIO
from dashboards.build import OOM_ANNOTATION, render
from dashboards.definitions import all_dashboards
from dashboards.promql import metric_names
from tests.dashboards.livestack import FAMILY, Live, live_producible, live_stack
from tests.livecg import skip_reason

# Out of the serial live group: the stack's load and OOM kills are made inside livecg.host_exclusive (see livestack.py);
# after that every check reads its own Prometheus over that window (or the backfilled one) and asks only for data,
# which another test's faults can add to but not take away.
pytestmark = [
    pytest.mark.live,
    pytest.mark.host_quiet(reason="its faults are made inside livecg.host_exclusive; its checks read its own window"),
]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CONSOLE_RE = re.compile(r":CONSOLE[:(]\d*\)?\]? ?(?P<message>.*)")
# The SLO period's rules sum 5-minute increases in a subquery aligned to 5-minute boundaries: they
# have a value only once such a boundary passed after the first recorded increase (up to 5 min).
PERIOD_RULES = frozenset({PERIOD_RATIO})
PANELS = [(d.uid, p.title) for d in all_dashboards() for p in d.panels]


def _reads_period_rules(uid: str, title: str) -> bool:
    (panel,) = [p for d in all_dashboards() if d.uid == uid for p in d.panels if p.title == title]
    return any(FAMILY[n] in PERIOD_RULES for q in panel.queries for a in q.alternatives for n in metric_names(a))


# The panels that must wait for the period rules run last (after every other check of the module but the preview,
# which needs them too): the other checks then take place during that wait instead of after it.
PERIOD_PANELS = [(u, t) for u, t in PANELS if _reads_period_rules(u, t)]
OTHER_PANELS = [(u, t) for u, t in PANELS if not _reads_period_rules(u, t)]


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    with live_stack() as stack:
        yield stack


def substitute(expr: str, step: float, rate_interval: float) -> str:
    out = expr.replace("$__rate_interval", f"{int(rate_interval)}s").replace("$__interval", f"{int(step)}s")
    return re.sub(r"\$\{?(job|instance|model|slo)\}?", ".+", out)


def query_range(live: Live, expr: str, start: float, end: float, step: float, rate_interval: float) -> list[dict[str, Any]]:
    # Prometheus evaluates at start, start+step, ...; a grid that ends short of `end` misses a sample younger than one
    # step (a recording rule that has just produced its first). Align the grid so `end` itself is evaluated.
    start = end - math.ceil((end - start) / step) * step
    r = httpx.get(f"{live.prom.url}/api/v1/query_range", trust_env=False, timeout=30.0, params={
        "query": substitute(expr, step, rate_interval), "start": start, "end": end, "step": step})  # fmt: skip
    body = r.json()
    assert body["status"] == "success", (expr, body)
    return list(body["data"]["result"])


def finite_points(result: list[dict[str, Any]]) -> list[float]:
    return [float(v) for s in result for _, v in s["values"] if math.isfinite(float(v))]


def live_window(live: Live, expr: str, end: float | None = None) -> list[dict[str, Any]]:
    return query_range(live, expr, live.live_start, end or live.live_end, 2.0, 10.0)


def backfill_window(live: Live, expr: str) -> list[dict[str, Any]]:
    return query_range(live, expr, live.backfill_start, live.backfill_end, 15.0, 60.0)


@pytest.mark.slow
@pytest.mark.parametrize(("uid", "title"), OTHER_PANELS, ids=[f"{u}:{t}" for u, t in OTHER_PANELS])
def test_every_panel_query_returns_data(live: Live, uid: str, title: str) -> None:
    check_panel(live, uid, title)


def check_panel(live: Live, uid: str, title: str) -> None:
    """Every alternative of every query returns data over its window; the combined query over both windows."""
    (dash,) = [d for d in all_dashboards() if d.uid == uid]
    (panel,) = [p for p in dash.panels if p.title == title]
    needs_rules = False
    end = live.live_end
    for query in panel.queries:
        for alt in query.alternatives:
            families = {FAMILY[n] for n in metric_names(alt)}
            if families & SLO_RULES and not live.rules:
                needs_rules = True
                continue
            for rule in sorted(families & PERIOD_RULES):
                assert live.prom.wait_for(rule, bool, 330), f"{rule}: never recorded"
                end = time.time()  # the rule's first sample is older than this; query_range evaluates at `end`
            if all(live_producible(f, live.node_exporter) for f in families):
                points = finite_points(live_window(live, alt, end))
                where = "live window"
            else:
                assert families - {"up"} <= live.backfilled, families - live.backfilled
                points = finite_points(backfill_window(live, alt))
                where = "backfilled window"
            assert points, f"{uid} / {title}: no data over the {where} for {alt}"
        if not (needs_rules and any(FAMILY[n] in SLO_RULES for a in query.alternatives for n in metric_names(a))):
            whole = query_range(live, query.expr, live.backfill_start, end, 5.0, 20.0)
            assert finite_points(whole), f"{uid} / {title}: the combined query returns nothing: {query.expr}"
    if needs_rules:
        pytest.skip(f"{uid} / {title}: the SLO recording rules (alerts/generated/*.rules.yaml) are not on this branch; "
                    "its other queries returned data")  # fmt: skip


def test_the_json_sends_exactly_the_checked_queries() -> None:
    for d in all_dashboards():
        board = render(d)
        sent = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
        assert sent == [q.expr for p in d.panels for q in p.queries]


def test_oom_kills_show_as_annotations_and_in_memory_events(live: Live) -> None:
    annotations = finite_points(live_window(live, OOM_ANNOTATION))
    assert annotations and max(annotations) >= 1, "the two kernel OOM kills are not annotated"
    kills = live_window(live, 'sum by (cgroup) (increase(llmdiag_cgroup_memory_events_total{event="oom_kill", '
                              'scope="hierarchical", job=~"$job", instance=~"$instance"}[$__rate_interval]))')  # fmt: skip
    assert any(p > 0 for p in finite_points(kills)), kills


def test_the_load_exercised_queueing_moe_and_batching(live: Live) -> None:
    rejected = live_window(live, 'sum(increase(llmdiag_admission_rejections_total{reason="queue_full"}[$__rate_interval]))')
    assert max(finite_points(rejected)) > 0
    overflow = live_window(live, "sum(increase(llmdiag_moe_expert_overflow_tokens_total[$__rate_interval]))")
    assert max(finite_points(overflow)) > 0
    skew = finite_points(live_window(live, "max(llmdiag_moe_expert_skew_ratio < +Inf)"))
    assert skew and max(skew) > 1.5  # the router's skew shows


def test_every_variable_offers_values_over_the_live_stack(live: Live) -> None:
    """Each query variable evaluated as Grafana would (All = .+): our demo's model from the request families, the
    SLOs and their models from the recording rules (when this branch has them)."""
    for d in all_dashboards():
        for var in render(d)["templating"]["list"]:
            if var.get("type") != "query":
                continue
            query = re.sub(r"\$\{?(job|instance|model|slo)\}?", ".+", var["query"])
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)|query_result\((.+)\)", query)
            assert m is not None, query
            if m.group(3):
                found = {hit.group(1) for s in live.prom.query(m.group(3)) if (hit := re.search(
                    var["regex"].strip("/"), "{" + ", ".join(f'{k}="{v}"' for k, v in s["metric"].items()) + "}"))}  # fmt: skip
            else:
                if any(FAMILY.get(n) in SLO_RULES for n in metric_names(m.group(1))) and not live.rules:
                    continue
                found = {s["metric"].get(m.group(2)) for s in live.prom.query(f"group by ({m.group(2)}) ({m.group(1)})")}
            assert found - {None, ""}, (d.uid, var["name"], var["query"])


@pytest.mark.slow
@pytest.mark.parametrize(("uid", "title"), PERIOD_PANELS, ids=[f"{u}:{t}" for u, t in PERIOD_PANELS])
def test_every_slo_period_panel_query_returns_data(live: Live, uid: str, title: str) -> None:
    check_panel(live, uid, title)


def _uses_slo_rules(panel: Any) -> bool:
    return any(FAMILY[n] in SLO_RULES for q in panel.queries for a in q.alternatives for n in metric_names(a))


def _chromium(page: Path, profile: Path) -> tuple[str, list[str]]:
    argv = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
            "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri()]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, [m.group("message") for line in proc.stderr.splitlines() if (m := CONSOLE_RE.search(line))]


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian chromium")
def test_preview_page_has_one_chart_per_panel_and_no_console_errors(live: Live, tmp_path: Path) -> None:
    out = tmp_path / "preview.html"
    if live.rules:  # the period panels need the period rules' first value (a 5-minute boundary): wait here too, so
        # this test holds on its own and not only after the period-panel tests waited for it
        assert live.prom.wait_for(PERIOD_RATIO, bool, 330), f"{PERIOD_RATIO}: never recorded"
    since = int(time.time() - live.backfill_start) + 30
    proc = subprocess.run([sys.executable, "-m", "diag.cli", "dashboards", "preview", "--prometheus", live.prom.url,
                           "--since", f"{since}s", "--out", str(out)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    slo_panels = sum(1 for d in all_dashboards() for p in d.panels if _uses_slo_rules(p))
    m = re.search(r"(\d+) panels, (\d+) without data", proc.stdout)
    assert m and int(m.group(1)) == len(PANELS)
    if int(m.group(2)) != (0 if live.rules else slo_panels):  # name the empty panels (a second pass of the queries)
        from diag.views.dashboards_preview import collect

        _, results = collect(live.prom.url, since)
        empty = [(r.dashboard, r.title, r.errors) for r in results if not r.series]
        pytest.fail(f"{proc.stdout.strip()}; empty now: {empty}")
    text = out.read_text()
    # self-contained: no scripts, stylesheets or fetched resources
    assert "<script" not in text and "<link" not in text and not re.search(r'(?:src|href)="(?:https?:)?//', text)
    dom, console = _chromium(out, tmp_path / "profile")
    assert console == [], console
    panels = re.findall(r'<div class="panel"[^>]*>(.*?)</div>', dom, re.S)
    assert len(panels) == len(PANELS)
    assert all(p.count("<svg") == 1 for p in panels)
