"""The shipped deployment files and how to read them, shared by the deploy tests.

Paths, the unit-file reader (repeated keys kept), flag rewriting on a command line, and the image's
command line: read from the files as shipped, never copied.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

from tests.paths import REPO

DEPLOY = REPO / "collectors" / "deploy"
UNIT = DEPLOY / "llm-diag-agent.service"
TRIAGE_UNIT = DEPLOY / "llm-diag-triage.service"
UNITS = {"agent": UNIT, "triage": TRIAGE_UNIT}
SCRAPE = DEPLOY / "prometheus-scrape.yaml"
DAEMONSET = DEPLOY / "daemonset.yaml"
CONTAINERFILE = DEPLOY / "Containerfile"
DIAG_BIN = Path(sys.executable).with_name("diag")


def unit_settings(text: str) -> dict[str, list[str]]:
    """[Section]key -> every value it is given (systemd allows repeated keys; continuation lines are joined)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in re.sub(r"\\\n", " ", text).splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}{key.strip()}", []).append(value.strip())
    return out


def exec_start(unit: Path) -> list[str]:
    """The unit's one ExecStart command line, split as systemd splits it (prefix characters removed)."""
    (line,) = unit_settings(unit.read_text())["[Service]ExecStart"]
    return shlex.split(line.lstrip("-@:+!"))


def set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """Replace ``--flag value`` or ``--flag=value`` in argv."""
    out: list[str] = []
    skip = False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == flag and i + 1 < len(argv):
            out += [flag, value]
            skip = True
        elif a.startswith(flag + "="):
            out.append(f"{flag}={value}")
        else:
            out.append(a)
    return out


def containerfile_argv() -> list[str]:
    text = CONTAINERFILE.read_text().replace("\\\n", " ")
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))  # type: ignore[union-attr]
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))  # type: ignore[union-attr]
    return [*entry, *cmd]
