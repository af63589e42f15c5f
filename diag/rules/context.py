"""Per-analysis context: what several rules compute from one timeline, computed once per ``analyze`` call.

Why not module-level caches: a cache keyed on "the last table seen" outlives the analysis, holds a
million-row table alive, and can hand one timeline's answer to another whose table happens to be the
same object. Here the memo lives exactly as long as one analysis; rules stay pure functions of
(timeline, context), and a rule called directly (tests, ``ctx=None``) simply computes afresh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from diag.timeline import Timeline

T = TypeVar("T")


class AnalysisContext:
    """Memo of shared passes over one timeline (request analysis, service scope, memory assessment)."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self._memo: dict[str, Any] = {}

    def memo(self, key: str, compute: Callable[[], T]) -> T:
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]  # type: ignore[no-any-return]


def shared(ctx: AnalysisContext | None, tl: Timeline, key: str, compute: Callable[[], T]) -> T:
    """``compute()`` memoised in ``ctx`` when it belongs to ``tl``; computed afresh otherwise."""
    if ctx is None or ctx.timeline is not tl:
        return compute()
    return ctx.memo(key, compute)
