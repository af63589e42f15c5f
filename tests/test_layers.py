"""The house's layer order, enforced: a module imports only its own component and the layers below it.

Records flow one way -- observed, shaped into a Timeline, judged, then shown, bundled, ticketed or
exported -- and the imports follow the flow, so a change in a lower layer never needs one above it and
each layer can be read (and tested) without what sits on top of it. Bottom to top:

    collectors -> units -> timeline -> sources -> rules -> generators -> views -> bundle | triage | demo | live -> cli

Components that share a layer (``bundle``, ``triage``, ``demo``, ``live``) are peers: each is one consumer of
the pipeline and none imports another. ``alerts`` and ``dashboards`` are one component (the generators:
alert links point at dashboard panels, dashboard panels read the SLO rules' names); they sit above the rules
(cause alerts share the rules' levels) and below the views (the preview draws the dashboards' panels). Every
import counts, lazy ones and those under ``TYPE_CHECKING`` included; a subprocess (``python -m diag.cli``
started by the triage worker or the scenario harness) is a process boundary, not an import.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from tests.importgraph import imports, modules

# Bottom to top; each layer maps its components to the packages (or single modules) they hold.
LAYERS: tuple[dict[str, tuple[str, ...]], ...] = (
    {"collectors": ("collectors",)},
    {"units": ("diag", "diag.units")},  # ``diag`` is only its empty __init__: every other module sits in a component
    {"timeline": ("diag.timeline",)},
    {"sources": ("diag.sources",)},
    {"rules": ("diag.rules",)},
    {"generators": ("alerts", "dashboards")},
    {"views": ("diag.views",)},
    {
        "bundle": ("diag.bundle",),
        "triage": ("diag.triage",),
        "demo": ("diag.demo",),
        "live": ("diag.live",),
        "gate": ("diag.gate",),
    },
    {"cli": ("diag.cli",)},
)
ORDER = " -> ".join(" | ".join(layer) for layer in LAYERS)


def _entries() -> list[tuple[str, int, str]]:
    return [(entry, rank, comp) for rank, layer in enumerate(LAYERS) for comp, entries in layer.items() for entry in entries]


def component(module: str) -> tuple[str, int] | None:
    """(component, layer index) of a module: the longest entry that is the module or a package holding it. A package
    split across components (``diag``) is an entry for itself only, so a new module loose in it has no layer."""
    entries = _entries()
    split = {e for e, _, _ in entries if any(o.startswith(f"{e}.") for o, _, _ in entries)}
    holding = [(len(e), c, rank) for e, rank, c in entries if module == e or (module.startswith(f"{e}.") and e not in split)]
    return max(holding)[1:] if holding else None


def unplaced(mods: Mapping[str, Path]) -> list[str]:
    return sorted(m for m in mods if component(m) is None)


def violations(mods: Mapping[str, Path], root: Path) -> list[str]:
    """One line per import against the order, naming the file and line, both modules and both layers."""
    found = []
    for name, path in sorted(mods.items()):
        mine = component(name)
        if mine is None:
            continue
        for imp in sorted(set(imports(name, path, mods)), key=lambda i: (i.line, i.module)):
            theirs = component(imp.module)
            if theirs is None or theirs[0] == mine[0] or theirs[1] < mine[1]:
                continue
            why = "its peer" if theirs[1] == mine[1] else "a layer above it"
            found.append(f"{path.relative_to(root)}:{imp.line}: {name} ({mine[0]}) imports {imp.module} ({theirs[0]}), {why}")
    return found


def test_every_module_sits_in_a_layer() -> None:
    """A new module at ``diag/`` top level, or a new package, has to be placed in the order before it lands."""
    from tests.paths import REPO

    mods = modules()
    assert {"diag.cli.main", "diag.views.analysis", "diag.live.diagnosis", "diag.timeline.signals"} <= set(mods)
    assert unplaced(mods) == [], f"in no layer (add them to LAYERS in {Path(__file__).relative_to(REPO)}): {unplaced(mods)}"


def test_no_module_imports_against_the_layer_order() -> None:
    from tests.paths import REPO

    mods = modules()
    found = violations(mods, REPO)
    assert found == [], "\n".join([*found, f"the order, bottom to top: {ORDER} (peers share a layer)"])
    # the check reads real imports (not vacuous): the CLI reaches every layer below it
    reached = {component(i.module)[0] for m, p in mods.items() if m.startswith("diag.cli.") for i in imports(m, p, mods)}
    assert reached >= {"collectors", "units", "sources", "rules", "generators", "views", "bundle", "triage", "demo", "live"}


def _tree(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return modules(root, ("collectors", "diag"))


def test_the_check_names_both_modules_of_a_seeded_upward_import(tmp_path: Path) -> None:
    """Each spelling of an import against the order is caught, and the allowed ones are not."""
    mods = _tree(tmp_path, {
        "collectors/__init__.py": "",
        "collectors/records.py": "",
        "diag/__init__.py": "",
        "diag/timeline/__init__.py": "",
        "diag/timeline/model.py": "from collectors import records\n",  # down: allowed
        "diag/sources/__init__.py": "",
        "diag/sources/recorder.py": "from diag.timeline import model\n",  # down: allowed
        "diag/sources/lazy.py": "def load():\n    from diag.bundle.core import take\n",  # up, lazily
        "diag/sources/relative.py": "from ..rules import engine\n",  # up, relative
        "diag/rules/__init__.py": "",
        "diag/rules/engine.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import diag.cli.main\n",  # up
        "diag/bundle/__init__.py": "",
        "diag/bundle/core.py": "from diag.sources import recorder\nfrom diag.rules import engine\n",  # down: allowed
        "diag/demo/__init__.py": "",
        "diag/demo/harness.py": "from diag.triage import store\n",  # a peer
        "diag/triage/__init__.py": "",
        "diag/triage/store.py": "",
        "diag/cli/__init__.py": "",
        "diag/cli/main.py": "from diag.bundle import core\nfrom diag.demo import harness\n",  # the top: allowed
    })  # fmt: skip
    found = violations(mods, tmp_path)
    pairs = sorted(line.split(": ", 1)[1].split(", ")[0] for line in found)
    assert pairs == [
        "diag.demo.harness (demo) imports diag.triage.store (triage)",
        "diag.rules.engine (rules) imports diag.cli.main (cli)",
        "diag.sources.lazy (sources) imports diag.bundle.core (bundle)",
        "diag.sources.relative (sources) imports diag.rules.engine (rules)",
    ], found
    assert any(line.startswith("diag/sources/lazy.py:2: ") and "a layer above it" in line for line in found), found
    assert any(line.startswith("diag/demo/harness.py:1: ") and "its peer" in line for line in found), found


def test_a_module_loose_in_diag_has_no_layer(tmp_path: Path) -> None:
    mods = _tree(tmp_path, {"diag/__init__.py": "", "diag/units.py": "", "diag/loose.py": "", "diag/views/__init__.py": "",
                            "diag/views/new.py": "", "collectors/__init__.py": ""})  # fmt: skip
    assert unplaced(mods) == ["diag.loose"]
    assert component("diag.views.new") == ("views", 6) and component("diag") == ("units", 1)
