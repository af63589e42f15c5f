"""The README's quick-start and "run as a service" blocks, extracted from the README and executed.

Why extracted, not copied: a copy in a test stays green while the README drifts. The blocks are found under their
headings; each command line is run as written, with only paths rewritten where a test host must (``/opt/llm-diag``
and ``/etc/systemd/system`` become temporary folders). What this host cannot do is said, not skipped silently:
``systemctl`` needs systemd as PID 1, so the installed units are checked with ``systemd-analyze verify`` instead
(tests/deploy/test_deploy.py starts them for real where systemd runs).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO
from tests.readme import block_under


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a person at a shell: no make variables of the `make test` this may run under."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS"))}
    return {**env, **extra}


def test_the_quickstart_is_make_run_and_make_test_and_ci_runs_make_test() -> None:
    assert block_under("Quickstart") == ["make run", "make test"]
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M), "CI must run the README's `make test`"


@pytest.mark.process
@pytest.mark.slow
def test_make_run_takes_a_bundle_of_this_host(tmp_path: Path) -> None:
    """`make run` as the README gives it: the install is up to date (this suite runs after `make install`), then the
    main job, `diag bundle`, writes a bundle into the current folder."""
    (command,) = [c for c in block_under("Quickstart") if c == "make run"]
    before = set(REPO.glob("llm-diag-bundle-*"))
    result = subprocess.run(shlex.split(command), cwd=REPO, capture_output=True, text=True, timeout=600, env=clean_env())
    made = sorted(set(REPO.glob("llm-diag-bundle-*")) - before)
    try:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        folders = [p for p in made if p.is_dir()]
        assert len(folders) == 1 and (folders[0] / "report.html").is_file() and (folders[0] / "findings.json").is_file()
        assert "Bundle: " in result.stdout
    finally:
        for path in made:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


@pytest.mark.process
@pytest.mark.slow
def test_install_and_run_as_a_service_blocks(tmp_path: Path) -> None:
    """The install block into a fresh venv (at a temporary /opt/llm-diag), the unit-install block into a temporary
    /etc/systemd/system; the installed `diag` takes a snapshot, and both installed units verify."""
    install, units = (
        block_under("Install, run as a service, upgrade, uninstall", 0),
        block_under("Install, run as a service, upgrade, uninstall", 1),
    )
    opt, etc = tmp_path / "opt" / "llm-diag", tmp_path / "etc" / "systemd" / "system"
    etc.mkdir(parents=True)
    rewrite = {"/opt/llm-diag": str(opt), "/etc/systemd/system/": f"{etc}/", "python3 ": f"{sys.executable} "}

    def run(line: str) -> None:
        for old, new in rewrite.items():
            line = line.replace(old, new)
        result = subprocess.run(line, shell=True, cwd=REPO, capture_output=True, text=True, timeout=900, env=clean_env())
        assert result.returncode == 0, f"{line}\n{result.stdout[-2000:]}{result.stderr[-2000:]}"

    (venv_line,) = install
    run(venv_line)
    snap = subprocess.run([str(opt / "bin" / "diag"), "snapshot", "--json"], capture_output=True, text=True, timeout=120,
                          env=clean_env())  # fmt: skip
    assert snap.returncode == 0 and '"host"' in snap.stdout, snap.stderr[-2000:]
    installs = [u for u in units if not u.startswith("systemctl")]
    controls = [u for u in units if u.startswith("systemctl")]
    assert installs and controls, units
    for line in installs:
        run(line)
    installed = sorted(p.name for p in etc.iterdir())
    assert installed == ["llm-diag-agent.service", "llm-diag-triage.service"]
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("systemd-analyze is missing (Debian package systemd; `make test` installs it)")
    # What `systemctl daemon-reload && systemctl enable --now` would load, checked as systemd parses it. The ExecStart
    # path is the installed venv's (verify checks that the binary exists), the only rewrite.
    for name in installed:
        unit = etc / name
        unit.write_text(unit.read_text().replace("/opt/llm-diag", str(opt)))
        out = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=120)
        ours = [line for line in (out.stdout + out.stderr).splitlines() if name in line]
        assert out.returncode == 0 and ours == [], out.stdout + out.stderr
