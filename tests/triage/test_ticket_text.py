"""Ticket text from alert values that try to be markup: the Markdown is read back with a real CommonMark parser
(markdown-it-py) and must hold exactly the text, code and links that were meant -- no element made from an alert's
value, no link from a non-http URL; the ADF carries the same content under the schema's rules; wiki markup
escapes what Jira would interpret."""

from __future__ import annotations

import pytest
from markdown_it import MarkdownIt

from diag.triage.sinks.text import Bullets, Item, adf, code, jira_wiki, link, markdown, para, plain, strong, text
from tests.triage.wire_jira import adf_problems, adf_text

HOSTILE = ["a`b", "``", "*x* _y_ [z](http://evil.test)", "<img src=x onerror=alert(1)>", "# heading", "| a | b |", "@team ~~x~~"]


def inline_tokens(source: str) -> list:
    tokens = MarkdownIt("commonmark").enable("table").enable("strikethrough").parse(source)
    return [child for t in tokens if t.type == "inline" for child in t.children or []]


@pytest.mark.parametrize("value", HOSTILE)
def test_markdown_keeps_hostile_values_as_text_and_code(value):
    doc = (para(text("plain: "), text(value)), para(text("label: "), code(f"k={value}")))
    children = inline_tokens(markdown(doc))
    kinds = {c.type for c in children}
    assert kinds <= {"text", "code_inline", "softbreak"}, kinds  # no emphasis, link, html or heading from the value
    assert [c.content for c in children if c.type == "code_inline"] == [f"k={value}"]
    assert "".join(c.content for c in children if c.type == "text") == f"plain: {value}label: "


def test_links_only_from_http_urls_and_with_their_href():
    doc = (
        para(link("page", "https://t.test/a b)c<d>")),
        para(link("javascript:alert(1)", "javascript:alert(1)")),
        para(link("y", "http://t.test/(x)")),
    )
    children = inline_tokens(markdown(doc))
    hrefs = [c.attrGet("href") for c in children if c.type == "link_open"]
    assert hrefs == ["http://t.test/(x)"]  # a URL with spaces or a javascript: one is shown as text, not linked
    assert "javascript:alert(1)" in "".join(c.content for c in children if c.type == "text")


def test_adf_and_plain_carry_the_same_content():
    doc = (
        para(text("Diagnosis: "), strong("queue_backlog")),
        Bullets((Item((strong("queue_backlog"), text(" (80%): waits")), (Item((text("wait: 1155 ms"),)),)),)),
        para(text("Labels: "), code("job=llm"), text(", "), code("instance=")),
        para(text("")),
    )
    document = adf(doc)
    assert adf_problems(document) == []
    assert adf_text(document).split() == plain(doc).replace("- ", "").split()


@pytest.mark.parametrize(
    "value", ["{code}x{code}", "[link|http://evil.test]", "*bold* _it_ -strike- +u+ ^sup^ ~sub~", "!image.png!"]
)
def test_wiki_markup_escapes_what_jira_would_interpret(value):
    rendered = jira_wiki((para(text(value)),))
    unescaped = [ch for i, ch in enumerate(rendered) if ch in "{}[]|*_-+^~!" and (i == 0 or rendered[i - 1] != "\\")]
    assert unescaped == []
    assert rendered.replace("\\", "") == value
