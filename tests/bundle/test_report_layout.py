"""report.html laid out by a real headless Chromium: every evidence table stays inside its finding's card.

Evidence values are often one long word -- a cgroup path, a model file's path, a list of pids and sizes -- and
with an automatic table layout such a word widened the table past its card (at 1400 px the "when" column ran
off the card's right edge). Measured, not guessed: a copy of the real report gets a script that records, with
``getBoundingClientRect``, each evidence table's edges against its card's content box, whether any cell's
content is wider than the cell, and whether the page scrolls sideways; ``--dump-dom`` returns the page with the
measurements written into it. The report's own Content-Security-Policy forbids scripts, so the copy allows
inline scripts and nothing else.

The reports are rendered from real analyses of committed scenario recordings whose evidence carries the
longest words (the duplicate-model copies' paths and per-holder sizes, the OOM-killed group's path), at a
desktop width (1400 px), a mid width where the table keeps its columns (800 px), and the narrowest window
headless Chromium opens (500 px), where each evidence row is stacked.
"""

from __future__ import annotations

import html as html_lib
import json
import re
import time
from pathlib import Path

import pytest

from diag.bundle.report import ReportData, render_html
from diag.demo.scenarios.recording import read_jsonl_gz
from diag.rules.engine import analyze
from diag.timeline import timeline_from_records
from tests.bundle.chromium import CHROMIUM, chromium
from tests.paths import FIXTURES

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian chromium (apt-get install chromium)")

MEASURE = """<script>
const card_of = (t) => t.closest('article.finding');
const out = {width: window.innerWidth, page: document.documentElement.scrollWidth, tables: []};
document.querySelectorAll('table.evidence, article.finding table').forEach((table) => {
  const card = card_of(table);
  const c = card.getBoundingClientRect();
  const s = getComputedStyle(card);
  const inner_left = c.left + parseFloat(s.borderLeftWidth) + parseFloat(s.paddingLeft);
  const inner_right = c.right - parseFloat(s.borderRightWidth) - parseFloat(s.paddingRight);
  const r = table.getBoundingClientRect();
  const spilling = [];
  table.querySelectorAll('td').forEach((td) => {
    if (td.scrollWidth > td.clientWidth + 1) spilling.push(td.textContent.slice(0, 80));
  });
  out.tables.push({card_left: inner_left, card_right: inner_right, left: r.left, right: r.right,
                   rows: table.querySelectorAll('tbody tr').length, spilling: spilling});
});
const pre = document.createElement('pre');
pre.id = 'llmdiag-layout';
pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
</script>"""


def _report(name: str) -> str:
    records = read_jsonl_gz(FIXTURES / "scenarios" / f"{name}.jsonl.gz")
    analysis = analyze(timeline_from_records(records, source=f"replay:{name}"))
    data = ReportData(
        bundle_name=name, host="h", created=time.time(), window=analysis.window, since_s=1800, version="test",
        command="diag bundle", analysis=json.loads(json.dumps(analysis.to_dict(), default=str)), analysis_error=None,
        runs=[], redaction={"total": 0, "rules": {}}, self_cgroup={"inside": None, "before": "/"}, record_counts={},
    )  # fmt: skip
    page, _ = render_html(data, None)
    return page


def _measured(page: str, width: int, folder: Path) -> dict:
    csp = "default-src 'none';"
    assert page.count(csp) == 1 and page.count("</body>") == 1
    probe = folder / "report-measured.html"
    probe.write_text(page.replace(csp, csp + " script-src 'unsafe-inline';").replace("</body>", MEASURE + "</body>"))
    dom, console = chromium(probe, "--dump-dom", f"--window-size={width},1000", profile=folder / "profile")
    assert console == [], console
    found = re.search(r'<pre id="llmdiag-layout">(.*?)</pre>', dom, re.DOTALL)
    assert found, "the measuring script did not run"
    return json.loads(html_lib.unescape(found.group(1)))


@pytest.mark.process
@pytest.mark.parametrize("width", [1400, 800, 500])
@pytest.mark.parametrize("name", ["duplicate-models", "host-oom"])
def test_every_evidence_table_stays_inside_its_card(tmp_path: Path, name: str, width: int) -> None:
    measured = _measured(_report(name), width, tmp_path)
    assert measured["width"] == width  # the window we asked for (headless Chromium opens none narrower than 500)
    tables = measured["tables"]
    assert len(tables) >= 2 and sum(t["rows"] for t in tables) >= 10  # real evidence was laid out
    for t in tables:
        assert t["right"] <= t["card_right"] + 0.5, f"table ends at {t['right']:.1f}, its card at {t['card_right']:.1f}"
        assert t["left"] >= t["card_left"] - 0.5, t
        assert t["spilling"] == [], f"cells whose content is wider than the cell: {t['spilling']}"
    assert measured["page"] <= width, f"the page scrolls sideways: {measured['page']} px wide at {width} px"
