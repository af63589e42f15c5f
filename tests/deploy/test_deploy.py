"""What an operator installs (collectors/deploy/): checked by the tools that will read it, and run for real.

- the systemd unit: ``systemd-analyze verify`` (no warnings), ``systemd-analyze security --offline``
  (exposure stays low), the hardening it promises, its exact command line run by the real CLI, and --
  where systemd is PID 1 -- the unit started and stopped for real;
- the Prometheus scrape config: ``promtool check config``, then a real Prometheus scraping a real
  agent through the shipped host job (its relabelling included);
- the DaemonSet and the Containerfile: the host mounts and flags they promise, and their agent
  arguments run by the real CLI (host paths for the mount points).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from collectors.recorder import FlightRecorder
from tests.paths import REPO
from tests.promserver import prometheus, require_prometheus

DEPLOY = REPO / "collectors" / "deploy"
UNIT = DEPLOY / "llm-diag-agent.service"
SCRAPE = DEPLOY / "prometheus-scrape.yaml"
DAEMONSET = DEPLOY / "daemonset.yaml"
CONTAINERFILE = DEPLOY / "Containerfile"
DIAG_BIN = Path(sys.executable).with_name("diag")
CAPS = {"CAP_SYSLOG", "CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH"}


def unit_settings(text: str) -> dict[str, list[str]]:
    """[Service] key -> every value it is given (systemd allows repeated keys)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}{key.strip()}", []).append(value.strip())
    return out


def render_unit(tmp: Path, *, state: str = "llm-diag", listen: str = "127.0.0.1:9464") -> Path:
    """The shipped unit with ExecStart pointing at this checkout's ``diag`` (and optionally its own state dir/port)."""
    text = UNIT.read_text().replace("/opt/llm-diag/bin/diag", str(DIAG_BIN))
    text = text.replace("StateDirectory=llm-diag", f"StateDirectory={state}").replace("%S/llm-diag/", f"%S/{state}/")
    text = text.replace("--listen 127.0.0.1:9464", f"--listen {listen}")
    path = tmp / (state + ".service")
    path.write_text(text)
    return path


def _analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze not installed (Debian package systemd, listed in the Makefile's DEB_PACKAGES)")
    return tool


def agent_runs(argv: list[str], tmp: Path) -> list[str]:
    """Run the agent with ``argv`` (plus two samples and a temp recorder) and return the record kinds it wrote."""
    recorder = tmp / "recorder.db"
    argv = [a for a in argv if not a.startswith("--recorder=")]
    if "--recorder" in argv:
        i = argv.index("--recorder")
        del argv[i : i + 2]
    out = subprocess.run(
        [*argv, "--recorder", str(recorder), "--samples", "2", "--no-gpu"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    with FlightRecorder(recorder, readonly=True) as rec:
        return sorted({r.KIND for r in rec.read()})


def _set_flag(argv: list[str], flag: str, value: str) -> list[str]:
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


# --------------------------------------------------------------------------- systemd unit


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    tool = _analyze()
    unit = render_unit(tmp_path)
    out = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    ours = [line for line in (out.stdout + out.stderr).splitlines() if unit.name in line]
    assert out.returncode == 0 and ours == [], out.stdout + out.stderr


def test_verify_is_a_real_check_a_broken_unit_fails(tmp_path: Path) -> None:
    tool = _analyze()
    broken = render_unit(tmp_path)
    broken.write_text(broken.read_text().replace("ProtectSystem=strict", "ProtectSystm=strict"))
    out = subprocess.run([tool, "verify", str(broken)], capture_output=True, text=True, timeout=60)
    assert "Unknown key" in out.stderr and "ProtectSystm" in out.stderr


def test_unit_exposure_stays_low(tmp_path: Path) -> None:
    """systemd's own scoring of the sandbox (0 = locked down, 10 = exposed); capabilities the job needs cost a little."""
    tool = _analyze()
    unit = render_unit(tmp_path)
    out = subprocess.run([tool, "security", "--offline=yes", str(unit)], capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", out.stdout + out.stderr)
    if m is None and "offline" in out.stderr.lower():
        pytest.skip(f"this systemd-analyze has no offline security scoring: {out.stderr.strip()[:200]}")
    assert m is not None, out.stdout[-2000:] + out.stderr
    assert float(m.group(1)) <= 3.5, out.stdout[-3000:]


def test_unit_is_hardened_and_grants_only_what_kmsg_and_proc_need() -> None:
    s = unit_settings(UNIT.read_text())
    svc = lambda key: s.get(f"[Service]{key}", [])  # noqa: E731
    assert svc("DynamicUser") == ["yes"] and svc("NoNewPrivileges") == ["yes"] and svc("ProtectSystem") == ["strict"]
    assert svc("StateDirectory") == ["llm-diag"]
    assert set(" ".join(svc("AmbientCapabilities")).split()) == CAPS
    assert set(" ".join(svc("CapabilityBoundingSet")).split()) == CAPS
    for needed_open in ("ProtectKernelLogs", "ProtectProc", "PrivateDevices", "PrivateNetwork"):
        assert svc(needed_open) == [], f"{needed_open} would blind the agent"
    argv = shlex.split(svc("ExecStart")[0])
    assert argv[:2] == ["/opt/llm-diag/bin/diag", "collect"]
    assert argv[argv.index("--recorder") + 1] == "%S/llm-diag/recorder.db"  # inside StateDirectory, the only writable place


def test_the_units_command_line_runs(tmp_path: Path) -> None:
    """ExecStart as shipped (binary and %S mapped to this checkout and a temp dir, a free port)."""
    argv = shlex.split(unit_settings(UNIT.read_text())["[Service]ExecStart"][0])
    argv = [str(DIAG_BIN), *argv[1:]]
    argv = _set_flag(argv, "--listen", "127.0.0.1:0")
    kinds = agent_runs(argv, tmp_path)
    assert {"host", "process"} <= set(kinds), kinds


@pytest.mark.live
def test_unit_starts_and_stops_under_systemd(tmp_path: Path) -> None:
    """Installed in /run/systemd/system under a throw-away name, started, seen recording, stopped, removed."""
    if not Path("/run/systemd/system").is_dir():
        pytest.skip("systemd is not PID 1 here (no /run/systemd/system): the unit cannot be started for real")
    if os.geteuid() != 0:
        pytest.skip("installing a system unit needs root")
    name = f"llm-diag-agent-test-{uuid.uuid4().hex[:8]}"
    unit = render_unit(tmp_path, state=name, listen="127.0.0.1:0")
    target = Path("/run/systemd/system") / unit.name
    shutil.copyfile(unit, target)
    try:
        subprocess.run(["systemctl", "daemon-reload"], check=True, timeout=60)
        subprocess.run(["systemctl", "start", unit.name], check=True, timeout=60)
        recorder = Path("/var/lib") / name / "recorder.db"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not recorder.exists():
            time.sleep(0.5)
        state = subprocess.run(["systemctl", "is-active", unit.name], capture_output=True, text=True).stdout.strip()
        assert state == "active" and recorder.exists(), subprocess.run(
            ["journalctl", "-u", unit.name, "--no-pager", "-n", "50"], capture_output=True, text=True
        ).stdout
    finally:
        subprocess.run(["systemctl", "stop", unit.name], timeout=60)
        target.unlink(missing_ok=True)
        subprocess.run(["systemctl", "daemon-reload"], timeout=60)
        shutil.rmtree(Path("/var/lib/private") / name, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            (Path("/var/lib") / name).unlink()


# --------------------------------------------------------------------------- Prometheus


def test_scrape_config_passes_promtool() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    out = subprocess.run([promtool, "check", "config", str(SCRAPE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "SUCCESS" in out.stdout + out.stderr, out.stdout + out.stderr


@contextlib.contextmanager
def running_agent(tmp: Path) -> Iterator[int]:
    log = tmp / "agent.log"
    argv = [str(DIAG_BIN), "collect", "--interval", "1s", "--listen", "127.0.0.1:0", "--recorder", str(tmp / "a.db"),
            "--no-gpu", "--no-kmsg"]  # fmt: skip
    with log.open("wb") as fh:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=fh)
    try:
        deadline = time.monotonic() + 30
        port = None
        while port is None and time.monotonic() < deadline and proc.poll() is None:
            m = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", log.read_text(errors="replace"))
            port = int(m.group(1)) if m else None
            time.sleep(0.1)
        assert port is not None, log.read_text(errors="replace")[-2000:]
        yield port
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def test_the_shipped_host_job_scrapes_a_real_agent(tmp_path: Path) -> None:
    """The example's host job, targets pointed at a live agent, in a real Prometheus: up, and only our families kept."""
    require_prometheus()
    config = yaml.safe_load(SCRAPE.read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "llm-diag-host")
    with running_agent(tmp_path) as port:
        job["static_configs"][0]["targets"] = [f"127.0.0.1:{port}"]
        job["scrape_interval"], job["scrape_timeout"] = "1s", "1s"
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        config["scrape_configs"] = [job]
        with prometheus([], config=yaml.safe_dump(config)) as prom:
            ok = prom.wait_for('up{job="llm-diag-host"}', lambda r: bool(r) and r[0]["value"][1] == "1", 40)
            assert ok, prom.log_tail()
            assert prom.wait_for('count({job="llm-diag-host", __name__=~"llmdiag_.*"})', bool, 20), prom.log_tail()
            foreign = prom.query('count({job="llm-diag-host", __name__!~"llmdiag_.*|process_.*|python_.*|up|scrape_.*"})')
            assert foreign == [], foreign  # metric_relabel_configs kept only the agent's families
            labels = prom.query('up{job="llm-diag-host"}')[0]["metric"]
            assert labels.get("cluster") == "inference-eu1"


# --------------------------------------------------------------------------- Kubernetes and containers


def _daemonset() -> tuple[dict, dict]:
    docs = [d for d in yaml.safe_load_all(DAEMONSET.read_text()) if d]
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    svc = next(d for d in docs if d["kind"] == "Service")
    return ds, svc


def test_daemonset_mounts_host_proc_and_sys_read_only_and_points_the_agent_at_them() -> None:
    ds, svc = _daemonset()
    pod = ds["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in agent["volumeMounts"]}
    host_path = {volumes[n]["hostPath"]["path"]: mounts[n] for n in mounts if "hostPath" in volumes[n]}
    assert host_path["/proc"]["readOnly"] is True and host_path["/sys"]["readOnly"] is True
    assert host_path["/dev/kmsg"]["readOnly"] is True
    args = dict(a.removeprefix("--").split("=", 1) for a in agent["args"])
    assert args["proc-root"] == host_path["/proc"]["mountPath"] and args["sys-root"] == host_path["/sys"]["mountPath"]
    sc = agent["securityContext"]
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert {f"CAP_{c}" for c in sc["capabilities"]["add"]} == CAPS  # the same three as the systemd unit
    assert sc["allowPrivilegeEscalation"] is False and sc["runAsNonRoot"] is True and sc["readOnlyRootFilesystem"] is True
    assert pod["hostPID"] is True
    # Prometheus' DaemonSet job resolves the headless Service that selects these pods.
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    scrape = yaml.safe_load(SCRAPE.read_text())
    dns = next(j for j in scrape["scrape_configs"] if j["job_name"] == "llm-diag-daemonset")["dns_sd_configs"][0]
    assert dns["names"] == [f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local"]
    assert dns["port"] == agent["ports"][0]["containerPort"] == int(args["listen"].rsplit(":", 1)[1])


def test_daemonset_agent_arguments_run(tmp_path: Path) -> None:
    """The pod's args, with the mount points mapped back to the host paths they mount."""
    ds, _ = _daemonset()
    args = ds["spec"]["template"]["spec"]["containers"][0]["args"]
    args = [a.replace("/host/proc", "/proc").replace("/host/sys", "/sys") for a in args]
    argv = _set_flag([str(DIAG_BIN), "collect", *args], "--listen", "127.0.0.1:0")
    assert {"host", "process"} <= set(agent_runs(argv, tmp_path))


def _containerfile_argv() -> list[str]:
    text = CONTAINERFILE.read_text().replace("\\\n", " ")
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))  # type: ignore[union-attr]
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))  # type: ignore[union-attr]
    return [*entry, *cmd]


def test_containerfile_runs_the_agent_on_the_hosts_proc_and_sys(tmp_path: Path) -> None:
    argv = _containerfile_argv()
    assert argv[:2] == ["/opt/llm-diag/bin/diag", "collect"]
    assert argv[argv.index("--proc-root") + 1] == "/host/proc" and argv[argv.index("--sys-root") + 1] == "/host/sys"
    assert "USER 10001" in CONTAINERFILE.read_text()  # never root inside the image
    ds, _ = _daemonset()
    assert ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]["runAsUser"] == 10001
    run = [str(DIAG_BIN), *argv[1:]]
    run = _set_flag(_set_flag(_set_flag(run, "--proc-root", "/proc"), "--sys-root", "/sys"), "--listen", "127.0.0.1:0")
    assert {"host", "process"} <= set(agent_runs(run, tmp_path))


def test_container_image_builds_where_an_engine_runs(tmp_path: Path) -> None:
    engine = next((e for e in ("podman", "docker") if shutil.which(e)), None)
    if engine is None:
        pytest.skip("no container engine (podman or docker) installed")
    info = subprocess.run([engine, "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        pytest.skip(f"{engine} cannot reach a running engine here: {info.stderr.strip().splitlines()[-1:]}")
    tag = f"llm-diag-agent-test:{uuid.uuid4().hex[:8]}"
    build = subprocess.run([engine, "build", "-t", tag, "-f", str(CONTAINERFILE), str(REPO)],
                           capture_output=True, text=True, timeout=1800)  # fmt: skip
    try:
        assert build.returncode == 0, build.stderr[-3000:]
        out = subprocess.run([engine, "run", "--rm", "--entrypoint", "/opt/llm-diag/bin/diag", tag, "collect", "--help"],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert out.returncode == 0 and "--proc-root" in out.stdout
    finally:
        subprocess.run([engine, "rmi", "-f", tag], capture_output=True, timeout=120)
