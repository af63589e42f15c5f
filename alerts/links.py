"""Links from alert annotations to the dashboard panel that shows the alert's signal.

Why built here and not written in the spec: a hand-written link names a dashboard uid and a panel that may not
exist (every shipped link once pointed at a dashboard no one had generated). Each link is built from the
dashboards' own definitions -- the uid, and the panel id from the one numbering the generated JSON uses -- so a
renamed or removed panel stops ``diag alerts`` with its name instead of shipping a dead link.

A link sets only dashboard variables the alert carries as labels (``var-job={{ $labels.job }}``): a label the
alert lacks would render empty, and an empty variable matches nothing. Values go through ``urlquery`` (Go's
``url.QueryEscape``), so a model named ``org/model v2`` stays one query parameter.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from urllib.parse import quote_plus

from dashboards.definitions import all_dashboards
from dashboards.spec import Dashboard


@dataclass(frozen=True)
class PanelRef:
    """A panel of a generated dashboard: its uid, its title, and the variables the alert's labels fill."""

    uid: str
    title: str
    variables: tuple[str, ...]


class BrokenLink(ValueError):
    """A link names a dashboard, panel or variable the generated dashboards do not have."""


@functools.cache
def _dashboards() -> dict[str, Dashboard]:
    return {d.uid: d for d in all_dashboards()}


def resolve(ref: PanelRef) -> tuple[Dashboard, int]:
    """The dashboard and panel id a reference names (BrokenLink when either is missing or a variable is unknown)."""
    board = _dashboards().get(ref.uid)
    if board is None:
        raise BrokenLink(f"no generated dashboard has uid {ref.uid!r} (uids: {', '.join(_dashboards())})")
    try:
        panel_id = board.panel_id(ref.title)
    except KeyError as exc:
        raise BrokenLink(str(exc.args[0])) from None
    known = {v.name for v in board.variables}
    unknown = [v for v in ref.variables if v not in known]
    if unknown:
        raise BrokenLink(f"dashboard {ref.uid} has no variable {unknown[0]!r} (variables: {', '.join(sorted(known))})")
    return board, panel_id


def panel_url(grafana_url: str, ref: PanelRef, fixed: dict[str, str] | None = None) -> str:
    """``<grafana>/d/<uid>?var-<v>=...&viewPanel=<id>``, an alert annotation template.

    ``ref.variables`` are filled from the alert's labels (``{{ $labels.<v> | urlquery }}``); ``fixed`` variables
    are known when the rule is generated. Why both: Prometheus expands annotations with the labels of the
    expression's result, before the rule's own labels are added, so a label the rule sets (an absent alert's
    ``slo``) renders empty in a template and must be written in as a value."""
    fixed = fixed or {}
    board, panel_id = resolve(PanelRef(ref.uid, ref.title, (*ref.variables, *fixed)))
    params = [f"var-{v}={{{{ $labels.{v} | urlquery }}}}" for v in ref.variables]
    params += [f"var-{k}={quote_plus(v, safe='')}" for k, v in fixed.items()]
    params.append(f"viewPanel={panel_id}")
    return f"{grafana_url}/d/{board.uid}?{'&'.join(params)}"
