"""docs/BACKENDS.md's table of backend families is ``collectors.backends`` as it is.

The table between its markers is generated here; when the declarations change, regenerate it with
``.venv/bin/python -m tests.collectors.test_backend_docs`` and paste it over the old one.
"""

from __future__ import annotations

from pathlib import Path

from collectors import backends as bk

DOC = Path(__file__).resolve().parents[2] / "docs" / "BACKENDS.md"
BEGIN, END = "<!-- families:begin -->", "<!-- families:end -->"
HOW = {"gauge": "value", "rate": "per-second rate", "histogram": "p50, p95, mean", "ratio": "rate over rate of",
       "sum_rate": "rate of `_sum`"}  # fmt: skip


def _signals(fam: bk.Family) -> str:
    parts = []
    for feed in bk.FEEDS:
        if fam not in feed.families:
            continue
        if feed.per is fam:
            parts.append(f"`{feed.signal}` (denominator)")
            continue
        name = f"`{feed.signal}_*_s`" if feed.how == "histogram" else f"`{feed.signal}`"
        how = HOW[feed.how] + (f" `{feed.per.name}`" if feed.per is not None else "")
        if feed.combine == "max":
            how += ", max over series"
        sel = "".join(f", {label} in {'/'.join(values)}" for label, values in feed.select)
        parts.append(f"{name} ({how}{sel})")
    return "; ".join(parts) or "—"


def table() -> str:
    rows = ["| dialect | family | type | labels (**kept**) | signal (how) | version |", "|---|---|---|---|---|---|"]
    for dialect in bk.DIALECTS:
        for fam in bk.families_of(dialect):
            labels = ", ".join(f"**{lb}**" if lb in fam.keep else lb for lb in fam.labels) or "—"
            cells = (bk.DIALECT_NAMES[dialect], f"`{fam.name}`", fam.type, labels, _signals(fam), fam.versions)
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def test_the_docs_table_is_the_declarations() -> None:
    text = DOC.read_text()
    assert BEGIN in text and END in text
    current = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert current == table(), "docs/BACKENDS.md is stale: regenerate the table (see this module's docstring)"


if __name__ == "__main__":
    print(table())
