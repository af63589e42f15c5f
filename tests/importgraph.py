"""The project's modules and the project modules each one imports, read from the source with ``ast``.

Nothing is imported, so modules that need root or a GPU to import usefully are read too. Every import counts:
module level, lazy (inside a function), under ``TYPE_CHECKING``, relative. Shared by the import-cycle test
and the layer test (``tests/test_import_cycles.py``, ``tests/test_layers.py``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from tests.paths import REPO

PACKAGES = ("collectors", "diag", "dashboards", "alerts")


def modules(root: Path = REPO, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the packages under ``root``."""
    found: dict[str, Path] = {}
    for pkg in packages:
        for path in (root / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


@dataclass(frozen=True)
class Import:
    module: str  # the project module imported
    line: int


def _absolute(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The module an ``ImportFrom`` names, relative ones resolved against the importing module ``name``."""
    if node.level == 0:
        return node.module or ""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports(name: str, path: Path, mods: Mapping[str, Path]) -> list[Import]:
    """The project modules ``name`` (at ``path``) imports; ``from pkg import sub`` counts as importing ``pkg.sub``
    when that is a module, else ``pkg``."""
    found: list[Import] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            module = _absolute(name, path, node)
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                found.append(Import(sub if sub in mods else module, node.lineno))
        elif isinstance(node, ast.Import):
            found += [Import(alias.name, node.lineno) for alias in node.names]
    return [i for i in found if i.module in mods and i.module != name]


def import_graph(mods: Mapping[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports."""
    return {name: {i.module for i in imports(name, path, mods)} for name, path in mods.items()}
