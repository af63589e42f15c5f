"""Spec -> grafana-foundation-sdk builders -> JSON, then our post-build pass.

The SDK (pinned: the Grafana 11/12 flavour) gives typed builders and Grafana's own key names; it
does not assign panel ids or target refIds (every row gets id 0) and its auto-layout misplaces
panels after rows. So ``finish`` lays the grid out from the spec, numbers ids and refIds, drops
keys Grafana 12 would move into a hidden controls menu, and ``check_dashboard`` then proves the
result: unique ids and refIds, no overlaps, x + w <= 24, rows full-width and one unit high, and
every query naming only known metrics.
"""

from __future__ import annotations

import json
import re
import string
from typing import Any

from grafana_foundation_sdk.builders import common as common_builder
from grafana_foundation_sdk.builders import dashboard as sdk
from grafana_foundation_sdk.builders import heatmap as sdk_heatmap
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import heatmap as heatmap_models
from grafana_foundation_sdk.models import prometheus as prom_models
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DashboardLinkType,
    DataSourceRef,
    VariableRefresh,
    VariableSort,
)

from dashboards.promql import SEL, check_expr, m
from dashboards.spec import Dashboard, Panel

TAG = "llm-diag"
GRID_WIDTH = 24
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
OOM_ANNOTATION = (
    f"sum by (job, instance) (increase({m('llmdiag_oom_kills_total')}{{{SEL}}}[$__rate_interval])) > 0"
    f" or sum by (job, instance) (increase({m('node_vmstat_oom_kill')}{{{SEL}}}[$__rate_interval])) > 0"
)


class LayoutError(ValueError):
    """The generated grid or numbering is broken (an overlap, a panel past column 24, a duplicate id)."""


def _variables(board: sdk.Dashboard, d: Dashboard) -> sdk.Dashboard:
    board = board.with_variable(sdk.DatasourceVariable("datasource").label("Data source").type("prometheus"))
    for v in d.variables:
        check_expr(_variable_expr(v.query), f"{d.uid} / variable {v.name}")
        var = (sdk.QueryVariable(v.name).label(v.label).query(v.query).datasource(DATASOURCE)
               .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
               .multi(True).include_all(True).all_value(".+"))  # fmt: skip
        if v.regex:
            var = var.regex(v.regex)
        board = board.with_variable(var)
    return board


def _variable_expr(query: str) -> str:
    """The PromQL inside ``label_values(EXPR, label)`` or ``query_result(EXPR)``."""
    for prefix, suffix in (("label_values(", r",\s*\w+\)"), ("query_result(", r"\)")):
        if query.startswith(prefix):
            return re.sub(suffix + "$", "", query[len(prefix) :])
    raise LayoutError(f"variable query {query!r} is neither label_values(...) nor query_result(...)")


def _target(query: Any, legend: str) -> prometheus.Dataquery:
    t = prometheus.Dataquery().expr(query.expr).legend_format(legend or "__auto").datasource(DATASOURCE)
    if query.heatmap:
        t = t.format(prom_models.PromQueryFormat.HEATMAP)
    return t.instant() if query.instant else t.range()


def _panel(p: Panel) -> Any:
    if p.kind == "stat":
        b = (stat.Panel().reduce_options(common_builder.ReduceDataOptions().calcs(["lastNotNull"]))
             .color_mode(common.BigValueColorMode.VALUE).graph_mode(common.BigValueGraphMode.AREA))  # fmt: skip
    elif p.kind == "heatmap":
        b = (sdk_heatmap.Panel().calculate(False)
             .color(sdk_heatmap.HeatmapColorOptions().mode(heatmap_models.HeatmapColorMode.SCHEME).scheme("Oranges")
                    .steps(64).exponent(0.5).fill("dark-orange").reverse(False))
             .y_axis(sdk_heatmap.YAxisConfig().unit(p.unit))
             .cell_values(sdk_heatmap.CellValues().unit("short")))  # fmt: skip
    else:
        b = (
            timeseries.Panel()
            .line_width(1)
            .fill_opacity(20 if p.stacked else 5)
            .legend(
                common_builder.VizLegendOptions()
                .show_legend(True)
                .display_mode(common.LegendDisplayMode.LIST)
                .placement(common.LegendPlacement.BOTTOM)
            )
            .tooltip(common_builder.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.DESCENDING))
        )
        if p.stacked:
            b = b.stacking(common_builder.StackingConfig().mode(common.StackingMode.NORMAL))
    b = b.title(p.title).description(p.description).datasource(DATASOURCE).unit(p.unit)
    for query in p.queries:
        b = b.with_target(_target(query, query.legend))
    return b


def to_sdk(d: Dashboard) -> sdk.Dashboard:
    board = (sdk.Dashboard(d.title).uid(d.uid).description(d.description).tags([TAG, *d.extra_tags]).readonly()
             .tooltip(DashboardCursorSync.CROSSHAIR).refresh("30s").time("now-1h", "now").timezone("browser"))  # fmt: skip
    board = _variables(board, d)
    board = board.link(sdk.DashboardLink("llm-diag dashboards").type(DashboardLinkType.DASHBOARDS).tags([TAG])
                       .as_dropdown(True).include_vars(True).keep_time(True))  # fmt: skip
    board = board.annotation(sdk.AnnotationQuery().name("OOM kills").datasource(DATASOURCE).enable(True)
                             .icon_color("red").expr(OOM_ANNOTATION).title_format("OOM kill on {{instance}}")
                             .text_format("The kernel OOM-killed a process ({{job}})."))  # fmt: skip
    for row in d.rows:
        board = board.with_row(sdk.Row(row.title))
        for p in row.panels:
            board = board.with_panel(_panel(p))
    return board


def finish(raw: dict[str, Any], d: Dashboard) -> dict[str, Any]:
    """The post-build pass: grid from the spec, ids, refIds, and Grafana-12 placement keys dropped."""
    y = 0
    ids = iter(pid for _, pid in d.numbered())
    out_panels = raw["panels"]
    it = iter(out_panels)
    for row in d.rows:
        row_json = next(it)
        row_json["gridPos"] = {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y}
        row_json["id"] = next(ids)
        y += 1
        x, line_h = 0, 0
        for p in row.panels:
            pj = next(it)
            if x + p.w > GRID_WIDTH:
                x, y, line_h = 0, y + line_h, 0
            pj["gridPos"] = {"h": p.h, "w": p.w, "x": x, "y": y}
            pj["id"] = next(ids)
            for i, target in enumerate(pj.get("targets", [])):
                target["refId"] = string.ascii_uppercase[i]
            x += p.w
            line_h = max(line_h, p.h)
        y += line_h
    for item in (*raw.get("links", []), *raw.get("annotations", {}).get("list", [])):
        item.pop("placement", None)
    for var in raw.get("templating", {}).get("list", []):
        for key in ("auto", "auto_count", "auto_min"):
            var.pop(key, None)
    return raw


def check_dashboard(raw: dict[str, Any]) -> None:
    """Raise LayoutError / UnknownMetric when the built dashboard breaks a rule."""
    ids: set[int] = set()
    cells: dict[tuple[int, int], str] = {}
    for p in raw["panels"]:
        pid = p.get("id")
        if not isinstance(pid, int) or pid <= 0 or pid in ids:
            raise LayoutError(f"{raw['uid']}: panel {p.get('title')!r} has a missing or duplicate id {pid}")
        ids.add(pid)
        g = p["gridPos"]
        if g["x"] < 0 or g["w"] <= 0 or g["x"] + g["w"] > GRID_WIDTH:
            raise LayoutError(f"{raw['uid']}: panel {p['title']!r} is outside the 24-column grid: {g}")
        if p["type"] == "row" and (g != {"h": 1, "w": GRID_WIDTH, "x": 0, "y": g["y"]} or p.get("panels")):
            raise LayoutError(f"{raw['uid']}: row {p['title']!r} must be full width, 1 high, and not nest panels")
        for dx in range(g["w"]):
            for dy in range(g["h"]):
                cell = (g["x"] + dx, g["y"] + dy)
                if cell in cells:
                    raise LayoutError(f"{raw['uid']}: panels {cells[cell]!r} and {p['title']!r} overlap at {cell}")
                cells[cell] = p["title"]
        refs = [t.get("refId") for t in p.get("targets", [])]
        if len(set(refs)) != len(refs) or not all(refs):
            raise LayoutError(f"{raw['uid']}: panel {p['title']!r} has missing or duplicate refIds {refs}")
        for t in p.get("targets", []):
            check_expr(t["expr"], f"{raw['uid']} / {p['title']}")
    panels = raw["panels"]
    if panels and panels[0]["type"] != "row":
        raise LayoutError(f"{raw['uid']}: the first panel must be a row")
    for ann in raw.get("annotations", {}).get("list", []):
        check_expr(ann.get("expr", ""), f"{raw['uid']} / annotation {ann.get('name')}")


def render(d: Dashboard) -> dict[str, Any]:
    """Build, post-process and check one dashboard; returns the JSON document."""
    built = to_sdk(d).build()
    raw = json.loads(JSONEncoder().encode(built))  # compact: the C encoder; files are indented once, in generate
    raw = finish(raw, d)
    check_dashboard(raw)
    return raw
