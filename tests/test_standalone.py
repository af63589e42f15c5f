"""The repository stands alone: nothing tracked points outside it.

Why: a user clones only this repository. A comment that says "see the notes next door" or names
an issue number sends them to something they do not have; the comment must state its reason itself.
This test greps every tracked text file for such pointers, and checks that the fixtures the tests
read are inside the repository with their licences and provenance.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.paths import EXTERNAL, FIXTURES, REPO

# Assembled from parts so this file does not match itself.
_SIBLING = r"\.\./" + "shared" + r"|/work/" + "shared" + r"|\b" + "shared/" + "docs"
_NOTES = r"\bresearch/" + r"[a-z_]+\.md" + r"|\bresearch" + r" notes?\b|\bresearch" + r" note's\b"
# A section of a document cited by name (``notes.md`` and a section sign): the document must be in the repo.
_SECTION = r"\w\.md\s*" + "\u00a7"
_ISSUE = r"\b[Ii]" + r"ssue\s*#?\d+"
# A hash and digits as a reference, but not a CSS colour (after ":" or before ";"/"}") nor an HTML entity.
_HASH = r"(?<![\w&#:])#\d{1,5}\b(?![;}\w])"
# An upstream tracker reference: a project name glued to a hash and digits.
_UPSTREAM = r"[A-Za-z_]#\d+\b"
OUTSIDE = re.compile("|".join(f"(?:{p})" for p in (_SIBLING, _NOTES, _SECTION, _ISSUE, _HASH, _UPSTREAM)))


def tracked_files() -> list[Path]:
    """Every file git tracks (or, without git, every file under the repo outside build/venv dirs)."""
    if shutil.which("git") and (REPO / ".git").exists():
        out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True).stdout
        return [REPO / p for p in out.decode().split("\0") if p]
    skip = {".venv", ".git", "build", ".pytest_cache", ".ruff_cache", ".hypothesis", "__pycache__"}
    return [p for p in REPO.rglob("*") if p.is_file() and not skip.intersection(p.relative_to(REPO).parts)]


def text_of(path: Path) -> str | None:
    """The file as text, or None for binary data (compressed fixtures, images)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:  # deleted in the work tree, not yet committed
        return None
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def outside_references(text: str) -> list[tuple[int, str]]:
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if OUTSIDE.search(line)]


def test_the_pattern_catches_each_kind_of_outside_reference() -> None:
    """The grep is only a proof if it would catch what it forbids (and spares CSS colours)."""
    forbidden = [
        "see " + "../" + "sha" + "red/docs/ARCHITECTURE.md",
        "facts in research/" + "diagnosis" + ".md §3",
        "p < 0.01 (diagnosis" + ".md \u00a73)",
        "5 % of the limit per hour (the research" + " note's threshold)",
        "signature (research" + " notes: memory full avg10 > 5 %)",
        "Targets (" + "iss" + "ue 4)",
        "fixed in " + "#" + "13",
        "upstream sos" + "#" + "407 hangs",
    ]
    allowed = ["color: #555;", "a{color:#222}", 'colour "#555555"', "&#38; entity", "5 % of the limit", "x[#]"]
    assert all(outside_references(t) for t in forbidden)
    assert not any(outside_references(t) for t in allowed)


@pytest.mark.process
def test_no_tracked_file_refers_outside_the_repository() -> None:
    files = tracked_files()
    assert len(files) > 100, "found too few files: the walk is broken"
    hits = []
    for path in files:
        text = text_of(path)
        if text is None:
            continue
        hits += [f"{path.relative_to(REPO)}:{n}: {line}" for n, line in outside_references(text)]
    assert not hits, "references to things outside the repo:\n" + "\n".join(hits)


def test_external_fixtures_are_vendored_with_licences_and_provenance() -> None:
    provenance = (EXTERNAL / "PROVENANCE.md").read_text()
    projects = sorted(p for p in EXTERNAL.iterdir() if p.is_dir())
    assert projects, f"no vendored fixtures under {EXTERNAL}"
    for project in projects:
        assert (project / "LICENSE").is_file(), f"{project.name} lacks its licence file"
        assert f"`{project.name}/" in provenance, f"{project.name} has no line in PROVENANCE.md"
    assert FIXTURES.resolve().is_relative_to(REPO.resolve())


def test_test_sources_read_fixtures_only_from_inside_the_repository() -> None:
    """No test builds a path out of the checkout (a parent of the repo, an env var naming one)."""
    escape = re.compile(r"\b(?:REPO|ROOT)\.parent\b|parents\[[3-9]\]|LLMDIAG_" + "SHARED")
    offenders = [
        str(p.relative_to(REPO))
        for p in (REPO / "tests").rglob("*.py")
        if p.name != Path(__file__).name and escape.search(p.read_text())
    ]
    assert not offenders, offenders


@pytest.mark.parametrize("name", ["ARCHITECTURE.md"])
def test_the_architecture_map_is_in_the_repository(name: str) -> None:
    doc = REPO / "docs" / name
    assert doc.is_file()
    assert "docs/" + name in (REPO / "README.md").read_text(), "README does not link the map"
