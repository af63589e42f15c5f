"""What a dashboard is made of, before the SDK sees it: rows of panels, each with its queries.

Why our own small spec: the SDK's auto-layout misplaces panels after rows and assigns no ids or
refIds, and the live tests need each panel's queries (and each ``ours or theirs`` alternative)
without re-parsing JSON. The spec is the single source; ``build`` turns it into SDK builders and
then into checked JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dashboards.promql import Query

PanelKind = Literal["timeseries", "stat", "heatmap"]


@dataclass(frozen=True)
class Panel:
    kind: PanelKind
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    w: int = 12
    h: int = 8
    stacked: bool = False


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Variable:
    """A query variable (multi-select, All = ``.+``). ``regex`` extracts values from a ``query_result()`` query."""

    name: str
    label: str
    query: str
    regex: str = ""


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    rows: tuple[Row, ...]
    variables: tuple[Variable, ...]  # after the datasource variable, in this order
    extra_tags: tuple[str, ...] = field(default=())

    @property
    def panels(self) -> list[Panel]:
        return [p for r in self.rows for p in r.panels]

    def numbered(self) -> list[tuple[Row | Panel, int]]:
        """Rows and panels in grid order with their ids (1, 2, ...): the one numbering of the JSON and of links.

        Why here and not only in the post-build pass: alert annotations link ``viewPanel=<id>``, and a link
        must name the id the committed JSON has; both read this."""
        out: list[tuple[Row | Panel, int]] = []
        for row in self.rows:
            out.append((row, len(out) + 1))
            out.extend((p, len(out) + 1) for p in row.panels)
        return out

    def panel_id(self, title: str) -> int:
        """The id of the panel titled ``title``; KeyError naming the dashboard and its panels when there is none."""
        ids = {item.title: pid for item, pid in self.numbered() if isinstance(item, Panel)}
        if title not in ids:
            raise KeyError(f"dashboard {self.uid} has no panel titled {title!r} (panels: {', '.join(ids)})")
        return ids[title]


def ts(title: str, description: str, unit: str, *queries: Query, w: int = 12, h: int = 8, stacked: bool = False) -> Panel:
    return Panel("timeseries", title, description, unit, queries, w, h, stacked)


def stat(title: str, description: str, unit: str, *queries: Query, w: int = 4, h: int = 4) -> Panel:
    return Panel("stat", title, description, unit, queries, w, h, False)


def heatmap(title: str, description: str, unit: str, *queries: Query, w: int = 12, h: int = 8) -> Panel:
    return Panel("heatmap", title, description, unit, queries, w, h, False)
