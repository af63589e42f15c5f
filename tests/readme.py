"""The README's command blocks, found under their headings (the tests that run them verbatim share this).

Why extracted, not copied: a copy in a test stays green while the README drifts.
"""

from __future__ import annotations

import re

from tests.paths import REPO

README = REPO / "README.md"


def block_under(heading: str, index: int = 0) -> list[str]:
    """The command lines (comments and blank lines dropped) of the ``index``-th ```sh block under a ## heading."""
    text = README.read_text()
    m = re.search(rf"^## {re.escape(heading)}.*?$(.*?)(?=^## )", text, re.M | re.S)
    assert m, f"README has no section '## {heading}'"
    blocks = re.findall(r"^```sh\n(.*?)^```", m.group(1), re.M | re.S)
    assert len(blocks) > index, f"README section '{heading}' has {len(blocks)} sh blocks"
    lines = [line.split("  #", 1)[0].strip() for line in blocks[index].splitlines()]
    return [line for line in lines if line and not line.startswith("#")]
