"""The scenario registry: what a scenario is (name, expected class, parameters, the function that runs it).

Why its own module: scenario functions live in more than one module (``library``,
``config_scenarios``); each registers itself here, and ``library`` imports them all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from diag.demo.scenarios.context import ScenarioContext

ScenarioFn = Callable[[ScenarioContext, dict[str, Any]], None]


@dataclass(frozen=True)
class Scenario:
    name: str
    expected: str  # the incident class the analysis should conclude
    summary: str
    needs_cgroups: bool
    run: ScenarioFn
    defaults: dict[str, Any] = field(default_factory=dict)
    # Refuses (ValueError) merged parameters, or a host, the scenario cannot run with -- before anything starts.
    check: Callable[[str, dict[str, Any]], None] | None = None
    # False for a scenario whose server is not the reference backend (llama.cpp's own): its /metrics is the
    # engine's own, so another engine's dialect cannot be served and ``--dialect`` is refused, not ignored.
    speaks_dialects: bool = True

    def check_dialect(self, dialect: str | None) -> None:
        """Refuse (ValueError, one line) a dialect this scenario cannot serve -- before anything starts."""
        if dialect is not None and not self.speaks_dialects:
            raise ValueError(
                f"scenario {self.name} runs an engine that serves its own /metrics: --dialect {dialect} cannot apply "
                "(the dialects are the reference backend's)"
            )

    def params(self, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        merged = dict(self.defaults)
        for key, value in (overrides or {}).items():
            if key not in merged:
                raise ValueError(f"scenario {self.name} has no parameter {key!r} (known: {', '.join(sorted(merged))})")
            merged[key] = type(merged[key])(value) if merged[key] is not None else value
        if self.check is not None:
            self.check(self.name, merged)
        return merged


SCENARIOS: dict[str, Scenario] = {}


def scenario(
    name: str,
    expected: str,
    summary: str,
    *,
    needs_cgroups: bool,
    check: Callable[[str, dict[str, Any]], None] | None = None,
    speaks_dialects: bool = True,
    **defaults: Any,
) -> Callable[[ScenarioFn], ScenarioFn]:
    def register(fn: ScenarioFn) -> ScenarioFn:
        SCENARIOS[name] = Scenario(name, expected, summary, needs_cgroups, fn, defaults, check, speaks_dialects)
        return fn

    return register
