"""promtool unit tests generated with the rules (filled in below)."""

from __future__ import annotations

from typing import Any

from alerts.spec import Spec


def test_files(spec: Spec) -> dict[str, dict[str, Any]]:
    return {}
