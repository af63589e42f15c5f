"""``diag dashboards preview``: every panel's queries from a real Prometheus, drawn into one HTML page.

For people without Grafana at hand, and as the visual proof that the dashboards return data: each
panel of each generated dashboard becomes one inline SVG chart (drawn with ``diag.views.charts``, as the
bundle report's charts are, so both look alike), in one self-contained page -- no scripts, no network, a strict CSP.
Template variables are set to "All" (``.+``); ``$__rate_interval`` follows Grafana's rule
max(step + scrape interval, 4 x scrape interval) with the scrape interval read from the server.
"""

from __future__ import annotations

import html
import math
import re
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from dashboards.build import render
from dashboards.definitions import all_dashboards
from diag.views.charts import PALETTE, as_datetimes, new_figure, reduce_minmax, time_axis, to_svg

DEFAULT_SCRAPE_S = 15.0
MAX_POINTS_PER_PANEL = 400
MAX_LINES = 12


class PreviewError(RuntimeError):
    """Prometheus could not be reached or refused every query (one clear line for the CLI)."""


@dataclass
class Window:
    start: float
    end: float
    step: float
    rate_interval: float

    def substitute(self, expr: str) -> str:
        """Grafana's variables as the preview sets them (All = .+)."""
        out = expr.replace("$__rate_interval", f"{int(self.rate_interval)}s").replace("$__interval", f"{int(self.step)}s")
        out = out.replace("$__range", f"{int(self.end - self.start)}s")
        return re.sub(r"\$\{?(job|instance|model|slo)\}?", ".+", out)


@dataclass
class PanelResult:
    dashboard: str
    panel_id: int
    title: str
    kind: str
    unit: str
    series: list[tuple[str, np.ndarray, np.ndarray]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def scrape_interval(client: httpx.Client, url: str) -> float:
    """The server's global scrape interval (what Grafana's data source setting should equal)."""
    try:
        body = client.get(f"{url}/api/v1/status/config").json()
        m = re.search(r"scrape_interval:\s*(\d+(?:\.\d+)?)(ms|s|m|h)", body["data"]["yaml"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise PreviewError(f"cannot read the Prometheus config at {url}: {exc}") from exc
    if m is None:
        return DEFAULT_SCRAPE_S
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def window(since_s: float, scrape_s: float, now: float | None = None) -> Window:
    end = time.time() if now is None else now
    step = max(scrape_s, math.ceil(since_s / MAX_POINTS_PER_PANEL))
    return Window(end - since_s, end, step, max(step + scrape_s, 4 * scrape_s))


def query_range(client: httpx.Client, url: str, expr: str, w: Window) -> list[dict[str, Any]]:
    r = client.get(f"{url}/api/v1/query_range", params={"query": expr, "start": w.start, "end": w.end, "step": w.step})
    body = r.json()
    if body.get("status") != "success":
        raise PreviewError(body.get("error", f"HTTP {r.status_code}"))
    return list(body["data"]["result"])


def _legend(fmt: str, metric: dict[str, str]) -> str:
    if not fmt or fmt == "__auto":
        return ", ".join(f"{k}={v}" for k, v in sorted(metric.items()) if k != "__name__") or "value"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), fmt).strip() or "value"


def collect(url: str, since_s: float, client: httpx.Client | None = None,
            headers: dict[str, str] | None = None) -> tuple[Window, list[PanelResult]]:  # fmt: skip
    """Run every panel's queries; a failing query is reported in its panel, not raised.

    ``headers``: sent with every request (``--header``/``--tenant``), never written into the page."""
    own = client is None
    client = client or httpx.Client(timeout=30.0, trust_env=False, headers=headers or {})
    try:
        w = window(since_s, scrape_interval(client, url))
        results = []
        for d in all_dashboards():
            raw = render(d)
            for p in raw["panels"]:
                if p["type"] == "row":
                    continue
                res = PanelResult(d.title, p["id"], p["title"], p["type"], p["fieldConfig"]["defaults"].get("unit", ""))
                for t in p["targets"]:
                    try:
                        for s in query_range(client, url, w.substitute(t["expr"]), w):
                            pts = np.asarray(s["values"], dtype=object)
                            ts = pts[:, 0].astype(np.float64)
                            vals = np.asarray([float(v) for v in pts[:, 1]], dtype=np.float64)
                            res.series.append((_legend(t.get("legendFormat", ""), s["metric"]), ts, vals))
                    except (httpx.HTTPError, ValueError, PreviewError) as exc:
                        res.errors.append(f"{t['refId']}: {exc}")
                results.append(res)
        return w, results
    finally:
        if own:
            client.close()


_SCALES = {"bytes": (float(1 << 30), "GiB"), "percentunit": (0.01, "%"), "s": (1.0, "s"), "reqps": (1.0, "req/s"),
           "ops": (1.0, "/s")}  # fmt: skip


def chart_svg(res: PanelResult, key: str) -> str:
    """One chart: lines for time series and stats, a bucket-rate image for heatmaps; 'no data' drawn when empty."""
    fig, (ax,) = new_figure(1, height=2.2, width=7.0)
    scale, label = _SCALES.get(res.unit, (1.0, res.unit if res.unit not in ("short", "none") else ""))
    finite = [(n, t, v) for n, t, v in res.series if np.isfinite(v).any()]
    if res.kind == "heatmap" and finite:
        _heatmap(ax, finite, label)
    elif finite:
        for i, (name, t, v) in enumerate(finite[:MAX_LINES]):
            ok = np.isfinite(v)
            rt, rv = reduce_minmax(t[ok], v[ok])
            ax.plot(as_datetimes(rt), rv / scale, color=PALETTE[i % len(PALETTE)], linewidth=1.1, label=name[:40],
                    marker="o" if rt.size == 1 else None, markersize=2)  # fmt: skip
        ax.set_ylabel(label)
        if len(finite) > 1:
            ax.legend(loc="upper left", ncols=2)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    time_axis(ax, maxticks=6)
    ax.set_title(res.title, loc="left")
    with warnings.catch_warnings():
        # matplotlib's date locator falls back to a 30-unit tick interval for some ranges and says so
        # once per chart; the chart is right, and forty copies of the note would bury real errors
        warnings.filterwarnings("ignore", message="AutoDateLocator was unable", category=UserWarning)
        return to_svg(fig, key)


def _heatmap(ax: Any, series: list[tuple[str, np.ndarray, np.ndarray]], label: str) -> None:
    """Cumulative bucket rates -> per-bucket rates over time (what Grafana's heatmap format does)."""

    def le(name: str) -> float:
        try:
            return float(name)
        except ValueError:
            return math.inf

    series = sorted(series, key=lambda s: le(s[0]))
    times = np.unique(np.concatenate([t for _, t, _ in series]))
    grid = np.full((len(series), times.size), np.nan)
    for i, (_, t, v) in enumerate(series):
        grid[i, np.searchsorted(times, t)] = v
    grid = np.nan_to_num(np.diff(np.vstack([np.zeros(times.size), grid]), axis=0), nan=0.0).clip(min=0)
    step = float(np.median(np.diff(times))) if times.size > 1 else 1.0
    edges = np.append(times, times[-1] + step)  # flat shading: one more edge than cells
    ax.pcolormesh(as_datetimes(edges), np.arange(len(series) + 1), grid, cmap="Oranges", shading="flat")
    ticks = list(range(0, len(series), max(1, len(series) // 6)))
    ax.set_yticks([t + 0.5 for t in ticks], [series[t][0] for t in ticks])
    ax.set_ylabel(f"le ({label})" if label else "le")


def page(url: str, since_s: float, w: Window, results: list[PanelResult]) -> str:
    """The self-contained HTML page (inline SVG, inline CSS, no scripts)."""
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; img-src data:\">",
        "<title>llm-diag dashboards preview</title><style>body{font-family:sans-serif;margin:1em 2em}"
        ".panel{display:inline-block;vertical-align:top;margin:0 1em 1em 0;max-width:48%}.panel svg{width:100%;height:auto}"
        ".err{color:#b00;font-size:small}</style></head><body>",
        f"<h1>llm-diag dashboards preview</h1><p>{html.escape(url)} &middot; last {since_s:.0f} s, step {w.step:.0f} s, "
        f"$__rate_interval = {w.rate_interval:.0f} s, every variable = All</p>",
    ]
    current = None
    for i, res in enumerate(results):
        if res.dashboard != current:
            current = res.dashboard
            parts.append(f"<h2>{html.escape(current)}</h2>")
        parts.append(f'<div class="panel" data-dashboard="{html.escape(res.dashboard)}" data-panel-id="{res.panel_id}">')
        parts.append(chart_svg(res, f"p{i}"))
        parts.extend(f'<p class="err">{html.escape(e)}</p>' for e in res.errors)
        parts.append("</div>")
    parts.append("</body></html>\n")
    return "".join(parts)


def preview(url: str, since_s: float, headers: dict[str, str] | None = None) -> tuple[str, list[PanelResult]]:
    w, results = collect(url.rstrip("/"), since_s, headers=headers)
    return page(url, since_s, w, results), results
