"""The rule registry's shape: ids say where a rule lives.

Why: rule ids are what users see (``diag analyze --json``, tickets, the README); when an id names one
module and the rule lives in another, the reader of a finding looks for it in the wrong file.
"""

from __future__ import annotations

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
