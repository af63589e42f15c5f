"""Headless Chromium for the report tests: one run over a local page, its stdout and its console messages.

Chromium prints console messages to stderr with ``--enable-logging=stderr``; the tests treat any message as a
fault (the report has no script and a ``default-src 'none'`` CSP), so the detector is shared with the probe
that proves it sees them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CONSOLE_RE = re.compile(r":CONSOLE[:(]\d*\)?\]? ?(?P<message>.*)")


def chromium(page: Path, *extra: str, profile: Path) -> tuple[str, list[str]]:
    """(stdout, console messages) of one headless run over ``page``."""
    assert CHROMIUM is not None
    argv = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
        "--enable-logging=stderr", "--v=0", *extra, page.as_uri(),
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = [m.group("message") for line in proc.stderr.splitlines() if (m := CONSOLE_RE.search(line))]
    return proc.stdout, console
