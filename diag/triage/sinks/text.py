"""Ticket text as a small document -- paragraphs, bullet lists, plain, bold, code and link spans -- and the
markups the trackers take: Markdown (GitHub, GitLab), Jira wiki markup (Jira Data Center, REST v2), Atlassian
Document Format (Jira Cloud, REST v3), and plain text (the webhook, the terminal).

Why a document and not a string: Jira Cloud's v3 API takes descriptions and comments only as ADF JSON (a
plain string is a 400), and the other markups each escape differently. Building the text once, as structure,
gives every tracker the same content and puts each markup's escaping in one place. Every label value and
annotation in a ticket came from an alert, so all of them go through that escaping; links are made only from
http(s) URLs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Span:
    text: str
    kind: str = "text"  # text | strong | code | link
    href: str = ""


@dataclass(frozen=True)
class Paragraph:
    spans: tuple[Span, ...]


@dataclass(frozen=True)
class Item:
    spans: tuple[Span, ...]
    children: tuple[Item, ...] = ()


@dataclass(frozen=True)
class Bullets:
    items: tuple[Item, ...]


Block = Paragraph | Bullets
Doc = tuple[Block, ...]


def text(value: object) -> Span:
    return Span(str(value))


def strong(value: object) -> Span:
    return Span(str(value), "strong")


def code(value: object) -> Span:
    return Span(str(value), "code")


def link(label: str, href: str) -> Span:
    """A link when ``href`` is http(s); otherwise the label as text (a ``javascript:`` URL stays inert)."""
    if href.lower().startswith(("http://", "https://")) and not any(c.isspace() for c in href):
        return Span(label or href, "link", href)
    return Span(label or href)


def para(*spans: Span) -> Paragraph:
    return Paragraph(tuple(s for s in spans if s.text))


def from_plain(value: str) -> Doc:
    """Free text (a person's note, a lifecycle message): one paragraph per line."""
    return tuple(para(text(line)) for line in value.splitlines() if line.strip())


# ---------------------------------------------------------------- plain text


def _plain_spans(spans: tuple[Span, ...]) -> str:
    return "".join(f"{s.text} ({s.href})" if s.kind == "link" and s.text != s.href else s.text for s in spans)


def plain(doc: Doc) -> str:
    out: list[str] = []

    def items(entries: tuple[Item, ...], depth: int) -> None:
        for it in entries:
            out.append("  " * depth + "- " + _plain_spans(it.spans))
            items(it.children, depth + 1)

    for i, block in enumerate(doc):
        if i:
            out.append("")
        if isinstance(block, Paragraph):
            out.append(_plain_spans(block.spans))
        else:
            items(block.items, 0)
    return "\n".join(out)


# ---------------------------------------------------------------- Markdown (GitHub, GitLab)

_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>|~#!])")


def _md_escape(value: str) -> str:
    return _MD_SPECIAL.sub(r"\\\1", " ".join(value.splitlines()))


def _md_code(value: str) -> str:
    """A code span whose fence is longer than any backtick run inside (CommonMark), padded if it touches one."""
    flat = " ".join(value.splitlines())
    longest = max((len(m) for m in re.findall(r"`+", flat)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if flat.startswith("`") or flat.endswith("`") else ""
    return f"{fence}{pad}{flat}{pad}{fence}"


def _md_span(s: Span) -> str:
    if s.kind == "code":
        return _md_code(s.text)
    if s.kind == "strong":
        return f"**{_md_escape(s.text)}**"
    if s.kind == "link":
        href = s.href.replace("<", "%3C").replace(">", "%3E")
        return f"[{_md_escape(s.text)}](<{href}>)"
    return _md_escape(s.text)


def markdown(doc: Doc) -> str:
    out: list[str] = []

    def items(entries: tuple[Item, ...], depth: int) -> None:
        for it in entries:
            out.append("  " * depth + "- " + "".join(_md_span(s) for s in it.spans))
            items(it.children, depth + 1)

    for i, block in enumerate(doc):
        if i:
            out.append("")
        if isinstance(block, Paragraph):
            out.append("".join(_md_span(s) for s in block.spans))
        else:
            items(block.items, 0)
    return "\n".join(out)


# ---------------------------------------------------------------- Jira wiki markup (Data Center, REST v2)

_WIKI_SPECIAL = re.compile(r"([\\{}\[\]|*_+^~?!#\-])")


def _wiki_escape(value: str) -> str:
    return _WIKI_SPECIAL.sub(r"\\\1", " ".join(value.splitlines()))


def _wiki_span(s: Span) -> str:
    if s.kind == "code":
        return "{{" + _wiki_escape(s.text) + "}}"
    if s.kind == "strong":
        return f"*{_wiki_escape(s.text)}*"
    if s.kind == "link":
        href = s.href.replace("|", "%7C").replace("]", "%5D").replace("[", "%5B")
        return f"[{_wiki_escape(s.text)}|{href}]"
    return _wiki_escape(s.text)


def jira_wiki(doc: Doc) -> str:
    out: list[str] = []

    def items(entries: tuple[Item, ...], depth: int) -> None:
        for it in entries:
            out.append("*" * (depth + 1) + " " + "".join(_wiki_span(s) for s in it.spans))
            items(it.children, depth + 1)

    for i, block in enumerate(doc):
        if i:
            out.append("")
        if isinstance(block, Paragraph):
            out.append("".join(_wiki_span(s) for s in block.spans))
        else:
            items(block.items, 0)
    return "\n".join(out)


# ---------------------------------------------------------------- Atlassian Document Format (Jira Cloud, REST v3)


def _adf_inline(spans: tuple[Span, ...]) -> list[dict[str, Any]]:
    nodes: list[dict[str, Any]] = []
    for s in spans:
        value = " ".join(s.text.splitlines())
        if not value:
            continue  # ADF forbids empty text nodes
        node: dict[str, Any] = {"type": "text", "text": value}
        if s.kind == "code":
            node["marks"] = [{"type": "code"}]
        elif s.kind == "strong":
            node["marks"] = [{"type": "strong"}]
        elif s.kind == "link":
            node["marks"] = [{"type": "link", "attrs": {"href": s.href}}]
        nodes.append(node)
    return nodes


def _adf_paragraph(spans: tuple[Span, ...]) -> dict[str, Any]:
    content = _adf_inline(spans)
    return {"type": "paragraph", "content": content} if content else {"type": "paragraph"}


def _adf_list(entries: tuple[Item, ...]) -> dict[str, Any]:
    items = []
    for it in entries:
        content = [_adf_paragraph(it.spans)]  # a listItem starts with a paragraph, never with a nested list
        if it.children:
            content.append(_adf_list(it.children))
        items.append({"type": "listItem", "content": content})
    return {"type": "bulletList", "content": items}


def adf(doc: Doc) -> dict[str, Any]:
    content = [_adf_paragraph(b.spans) if isinstance(b, Paragraph) else _adf_list(b.items) for b in doc if _nonempty(b)]
    return {"type": "doc", "version": 1, "content": content or [{"type": "paragraph"}]}


def _nonempty(block: Block) -> bool:
    return bool(block.spans) if isinstance(block, Paragraph) else bool(block.items)
