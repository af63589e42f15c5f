"""A bundle on a host where sources cannot be read: every missing part is named with its reason, exit 0.

The bundle runs as root *without* the capabilities that let root read anything (setpriv drops
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_SYS_PTRACE, CAP_SYSLOG), as an unprivileged operator or a
hardened service would: /dev/kmsg is refused (kernel.dmesg_restrict) and the flight recorder belongs to
another user. This host has no NVIDIA driver, so NVML and nvidia-smi are missing for real. A damaged
recorder file is the second test.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bundle.helpers import bundle_argv, parse_run, run_bundle, verify_sums

NO_PRIVILEGE = ("setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search,-sys_ptrace,-syslog")
NOBODY = 65534


def _as_nobody() -> None:
    os.setgid(NOBODY)
    os.setuid(NOBODY)


@pytest.mark.live
@pytest.mark.host_quiet(
    reason="root only to drop capabilities: a bundle of what it could not read, no fault made, no verdict asserted"
)
def test_every_unreadable_source_is_named_with_its_reason(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv (util-linux) to drop the capabilities that let root read anything")
    if Path("/proc/sys/kernel/dmesg_restrict").read_text().strip() != "1":
        pytest.skip("kernel.dmesg_restrict is 0: /dev/kmsg is readable without CAP_SYSLOG here")
    other = subprocess.Popen(["sleep", "120"], preexec_fn=_as_nobody)
    secret = tmp_path / "service.conf"
    secret.write_text("api_key = not-for-the-bundle\n")
    os.chown(secret, NOBODY, NOBODY)
    secret.chmod(0o600)
    recorder = tmp_path / "recorder.db"
    recorder.write_bytes(b"\x00" * 4096)
    os.chown(recorder, NOBODY, NOBODY)
    recorder.chmod(0o600)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": "/usr/bin:/bin"}  # no nvidia-smi on this host's PATH either way
    try:
        proc = subprocess.run(
            [*NO_PRIVILEGE, *bundle_argv("--out", str(out), "--pid", str(other.pid), "--recorder", str(recorder),
                                         "--since", "5m", "--deadline", "30s", "--no-tar", "-q")],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
    finally:
        other.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            other.wait(10)
    assert proc.returncode == 0, proc.stderr  # documented: 0 = written, parts missing are named
    run = parse_run(proc)
    by_name = {c["name"]: c for c in run.manifest["collectors"]}
    missing = {line.split(":", 2)[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("Missing: ")}
    partial = {line.split(":", 2)[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("Partial: ")}
    # /dev/kmsg refused without CAP_SYSLOG
    assert by_name["kmsg"]["status"] == "skipped" and "Operation not permitted" in by_name["kmsg"]["reason"]
    assert "cannot open /dev/kmsg" in missing["kmsg"]
    # no NVML, no nvidia-smi
    assert by_name["gpu"]["status"] == "skipped" and by_name["gpu"]["reason"]
    assert "not on PATH" in missing["nvidia-smi"]
    # the recorder of another user: named, and why
    assert by_name["history"]["status"] == "error"
    assert f"cannot read {recorder}: Permission denied" in missing["history"]
    # another user's process: what this kernel lets us read of it is kept; any part refused would be named
    files = {f["path"] for f in by_name["process.files"]["files"]}
    assert f"raw/proc/{other.pid}/status" in files
    assert by_name["process.files"]["reason"] is None or "process.files" in partial
    # everything else still collected, analysed and reported
    assert by_name["snapshot"]["status"] == "ok" and by_name["analysis"]["status"] == "ok"
    report = (run.root / "report.md").read_text()
    for name in ("kmsg", "history", "nvidia-smi"):
        assert name in report
    verify_sums(run.root)
    # an --include this user cannot read is refused before anything is collected (one line, exit 2)
    refused = subprocess.run([*NO_PRIVILEGE, *bundle_argv("--out", str(out), "--include", str(secret))], capture_output=True,
                             text=True, timeout=60)  # fmt: skip
    assert refused.returncode == 2 and "not readable by this user" in refused.stderr and len(refused.stderr.splitlines()) == 1


@pytest.mark.process
def test_a_damaged_recorder_costs_the_bundle_its_history_only(tmp_path: Path) -> None:
    recorder = tmp_path / "recorder.db"
    recorder.write_bytes(os.urandom(8192))
    run = run_bundle("--recorder", str(recorder), "--since", "5m", "--no-gpu", "--no-tar", "-q", out=tmp_path / "out")
    history = run.collector("history")
    assert history["status"] == "error" and f"{recorder} is not a readable flight recorder" in history["reason"]
    assert f"Missing: history: history missing: {recorder} is not a readable flight recorder" in run.proc.stdout
    assert run.collector("snapshot")["status"] == "ok" and run.collector("analysis")["status"] == "ok"
    assert recorder.read_bytes() and not list(tmp_path.glob("recorder.db.corrupt-*"))  # a reader never moves it
    verify_sums(run.root)


@pytest.mark.process
def test_bundle_help_documents_the_exit_status() -> None:
    proc = subprocess.run([sys.executable, "-m", "diag.cli", "bundle", "--help"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "200"})  # fmt: skip
    text = " ".join(proc.stdout.split())
    assert "Exit status: 0 the bundle was written (possibly with parts missing, each named with its reason)" in text
    assert "2 an option is invalid" in text
