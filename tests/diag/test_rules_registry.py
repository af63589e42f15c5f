"""The rule registry's shape: ids say where a rule lives.

Why: rule ids are what users see (``diag analyze --json``, tickets, the README); when an id names one
module and the rule lives in another, the reader of a finding looks for it in the wrong file.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from diag.rules.base import RULES
from diag.rules.engine import load_rules


def test_every_rule_id_starts_with_the_name_of_its_module() -> None:
    load_rules()
    assert len(RULES) >= 17
    wrong = {
        rule_id: Path(inspect.getfile(r.fn)).stem
        for rule_id, r in RULES.items()
        if rule_id.split(".", 1)[0] != Path(inspect.getfile(r.fn)).stem
    }
    assert not wrong, f"rule id -> module it lives in: {wrong}"


def test_every_rule_id_is_module_dot_name() -> None:
    load_rules()
    assert all(rule_id.count(".") == 1 and all(rule_id.split(".")) for rule_id in RULES), sorted(RULES)


def _rule_modules() -> dict[str, Path]:
    load_rules()
    return {Path(inspect.getfile(r.fn)).stem: Path(inspect.getfile(r.fn)) for r in RULES.values()}


def _imported_rules_modules(path: Path) -> set[str]:
    """The ``diag.rules`` modules a source file imports, however it spells the import."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "diag.rules":
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("diag.rules."):
            names.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            names.update(a.name.split(".")[2] for a in node.names if a.name.startswith("diag.rules."))
    return names


def test_no_rule_module_imports_another_rule_module() -> None:
    """Rules judge their own evidence: what several rules share lives in modules without rules
    (stats, requestload, stall_signals ...), and precedence between rules in the engine's table."""
    modules = _rule_modules()
    assert {"memory", "oom", "stalls", "requests"} <= set(modules)
    crossing = {
        name: sorted(imported & set(modules) - {name})
        for name, path in modules.items()
        if (imported := _imported_rules_modules(path)) & set(modules) - {name}
    }
    assert not crossing, f"rule modules importing other rule modules: {crossing}"


def test_the_import_check_sees_each_spelling(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("from diag.rules.oom import host_oom\nfrom diag.rules import stalls\nimport diag.rules.memory\n")
    assert _imported_rules_modules(src) == {"oom", "stalls", "memory"}
