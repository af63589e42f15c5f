"""The dependency contract: ranges in pyproject.toml, the tested set and the lowest set pinned beside them.

Why: ``collectors.tracking`` is imported into the user's own FastAPI service, so pyproject.toml declares
compatible ranges, not pins; what this repository tests is one exact set (``constraints.txt``, installed by
``make install`` and CI) and, for the tracking path, the bottom of every range (``constraints-lowest.txt``,
a second venv in ``make test``). These tests keep the three in step: a range edited without re-locking, a
dependency added without a pin, a pin outside its range, or a lower bound that is not the one tested, fails
here. ``LLMDIAG_CONSTRAINTS`` names the file the running environment was installed from (``make
test-lowest`` sets it to the lowest set); the last test proves the environment really is that set.
"""

from __future__ import annotations

import os
import tomllib
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.paths import REPO

TESTED = REPO / "constraints.txt"
LOWEST = REPO / "constraints-lowest.txt"
# Runtime dependencies allowed an exact pin instead of a range, each for the reason pyproject.toml states.
EXACT = {"grafana-foundation-sdk"}
# What the lowest venv holds beside the package: the test tools, at their tested pins.
LOWEST_TOOLS = ("pytest", "hypothesis")


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def runtime() -> list[Requirement]:
    return [Requirement(r) for r in _pyproject()["project"]["dependencies"]]


def dev() -> list[Requirement]:
    """The extras this repository installs and tests: the test tools, and the real engine (``make test``)."""
    extras = _pyproject()["project"]["optional-dependencies"]
    return [Requirement(r) for name in ("dev", "engines") for r in extras[name]]


def _engines_installed() -> bool:
    """The ``engines`` extra is in this environment (``make test`` installs it; ``make check`` does not need it)."""
    try:
        metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return False
    return True


def read_pins(text: str) -> dict[str, Version]:
    """``name==version`` lines (comments and blank lines skipped); anything else in a pin file is an error."""
    pins: dict[str, Version] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==" and not req.marker, f"line {n}: {raw!r} is not a name==version pin"
        name = canonicalize_name(req.name)
        assert name not in pins, f"line {n}: {req.name} is pinned twice"
        pins[name] = Version(specs[0].version)
    return pins


def lower_bound(spec: SpecifierSet) -> Version | None:
    bounds = [Version(s.version) for s in spec if s.operator in (">=", "==")]
    return max(bounds) if bounds else None


def outside_their_ranges(requirements: list[Requirement], pins: dict[str, Version]) -> list[str]:
    problems = []
    for req in requirements:
        pin = pins.get(canonicalize_name(req.name))
        if pin is None:
            problems.append(f"{req.name} is not pinned")
        elif not req.specifier.contains(pin, prereleases=True):
            problems.append(f"{req.name}=={pin} is outside {req.specifier}")
    return problems


def test_the_tested_set_pins_every_runtime_and_dev_dependency_inside_its_range() -> None:
    problems = outside_their_ranges(runtime() + dev(), read_pins(TESTED.read_text()))
    assert not problems, "\n".join(problems) + "\n(make lock, or make lock KEEP=1, re-resolves constraints.txt)"


def test_each_runtime_dependency_is_a_bounded_range_and_only_the_named_exceptions_are_exact() -> None:
    """A range with no lower bound cannot be tested at its bottom, one with no upper bound admits the next
    breaking release untested; an exact pin forces the user's environment onto ours."""
    problems = []
    for req in runtime():
        ops = {s.operator for s in req.specifier}
        if canonicalize_name(req.name) in EXACT:
            if ops != {"=="}:
                problems.append(f"{req.name} must stay an exact pin, not {req.specifier}")
        elif not ({">=", "<"} <= ops and "==" not in ops):
            problems.append(f"{req.name}{req.specifier} is not a >=lower,<upper range")
    assert not problems, "\n".join(problems)


def test_the_lowest_set_is_every_range_at_its_lower_bound() -> None:
    """So the tracking tests in ``make test`` run on the bottom of each range, and a raised (or lowered)
    bound cannot land without the lowest set being re-resolved and re-tested."""
    lowest = read_pins(LOWEST.read_text())
    tested = read_pins(TESTED.read_text())
    problems = outside_their_ranges(runtime(), lowest)
    for req in runtime():
        pin = lowest.get(canonicalize_name(req.name))
        if pin is not None and pin != lower_bound(req.specifier):
            problems.append(f"{req.name}=={pin} in {LOWEST.name}, but the range starts at {lower_bound(req.specifier)}")
    for tool in LOWEST_TOOLS:
        if lowest.get(tool) != tested.get(tool):
            problems.append(f"{tool}: {lowest.get(tool)} in {LOWEST.name}, {tested.get(tool)} in {TESTED.name}")
    assert not problems, "\n".join(problems) + "\n(make lock-lowest re-resolves the lowest set)"


def test_the_checks_catch_a_missing_pin_a_pin_outside_its_range_and_a_malformed_line() -> None:
    reqs = [Requirement("fastapi>=0.100.0,<1"), Requirement("numpy>=1.26.4,<3")]
    assert outside_their_ranges(reqs, {"fastapi": Version("0.100.0"), "numpy": Version("1.26.4")}) == []
    assert outside_their_ranges(reqs, {"fastapi": Version("1.0.0")}) == [
        "fastapi==1.0.0 is outside <1,>=0.100.0",
        "numpy is not pinned",
    ]
    assert read_pins("# a comment\nPrometheus_Client==0.20.0  # why\n") == {"prometheus-client": Version("0.20.0")}
    for bad in ("fastapi>=0.100", "numpy==1.26.4\nNumPy==2.0.0"):
        with pytest.raises(AssertionError):
            read_pins(bad)


def required_distributions(roots: list[str]) -> set[str]:
    """Every installed distribution the roots need, transitively, with their extras and this platform's
    markers applied (the same closure pip installed). A root or requirement that is not installed raises."""
    seen: dict[str, set[str]] = {}
    stack = [Requirement(r) for r in roots]
    while stack:
        req = stack.pop()
        name = canonicalize_name(req.name)
        extras = set(req.extras)
        if name in seen and extras <= seen[name]:
            continue
        seen.setdefault(name, set()).update(extras)
        for line in metadata.requires(req.name) or []:
            child = Requirement(line)
            if child.marker is None or any(child.marker.evaluate({"extra": e}) for e in {"", *extras}):
                stack.append(child)
    return set(seen)


def test_this_environment_is_installed_exactly_as_its_constraints_pin() -> None:
    """The suite runs on the set it claims to: every distribution the package (and, for the lowest set, the
    test tools) needs is pinned and installed at that pin -- none resolved freely, none left at another version."""
    path = REPO / os.environ.get("LLMDIAG_CONSTRAINTS", TESTED.name)
    tested = "llm-diag[dev,engines]" if _engines_installed() else "llm-diag[dev]"
    roots = ["llm-diag", *LOWEST_TOOLS] if path.name == LOWEST.name else [tested]
    pins = read_pins(path.read_text())
    problems = []
    for name in sorted(required_distributions(roots) - {"llm-diag"}):
        installed = Version(metadata.version(name))
        if name not in pins:
            problems.append(f"{name} {installed} is installed but not pinned")
        elif installed != pins[name]:
            problems.append(f"{name} {installed} is installed, {pins[name]} pinned")
    target = "install-lowest" if path.name == LOWEST.name else "install"
    assert not problems, f"this environment is not the set in {path.name} (make {target} installs it):\n" + "\n".join(problems)
