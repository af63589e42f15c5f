"""What an operator installs (collectors/deploy/): checked by the tools that will read it, and run for real.

- the systemd units (the agent and the triage receiver): ``systemd-analyze verify`` (no warnings),
  ``systemd-analyze security --offline`` (exposure stays low), the hardening each promises, the state
  directory and dynamic user they share, their exact command lines run by the real CLI (the receiver on
  the recorder the agent's command line wrote), and -- where systemd is PID 1 -- started and stopped for real;
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
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from collectors.recorder import FlightRecorder
from tests import procs
from tests.deploy.shipped import (
    CONTAINERFILE,
    DAEMONSET,
    DIAG_BIN,
    SCRAPE,
    TRIAGE_UNIT,
    UNIT,
    UNITS,
    containerfile_argv,
    set_flag,
    unit_settings,
)
from tests.paths import REPO
from tests.promserver import prometheus, require_prometheus

CAPS = {"CAP_SYSLOG", "CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH"}


def render_unit(tmp: Path, *, state: str = "llm-diag", listen: str | None = None, unit: Path = UNIT,
                name: str | None = None, user: str = "llm-diag") -> Path:  # fmt: skip
    """A shipped unit with ExecStart pointing at this checkout's ``diag`` (optionally its own state dir, user, port)."""
    text = unit.read_text().replace("/opt/llm-diag/bin/diag", str(DIAG_BIN))
    text = text.replace("StateDirectory=llm-diag", f"StateDirectory={state}").replace("%S/llm-diag/", f"%S/{state}/")
    text = text.replace("User=llm-diag", f"User={user}").replace("Group=llm-diag", f"Group={user}")
    if listen is not None:
        text = re.sub(r"--listen \S+", f"--listen {listen}", text)
    path = tmp / ((name or state) + ".service")
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


# --------------------------------------------------------------------------- systemd unit


@pytest.mark.process
@pytest.mark.parametrize("which", sorted(UNITS))
def test_unit_passes_systemd_analyze_verify(tmp_path: Path, which: str) -> None:
    tool = _analyze()
    unit = render_unit(tmp_path, unit=UNITS[which], name=f"llm-diag-{which}")
    out = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    ours = [line for line in (out.stdout + out.stderr).splitlines() if unit.name in line]
    assert out.returncode == 0 and ours == [], out.stdout + out.stderr


@pytest.mark.process
@pytest.mark.parametrize("which", sorted(UNITS))
def test_verify_is_a_real_check_a_broken_unit_fails(tmp_path: Path, which: str) -> None:
    tool = _analyze()
    broken = render_unit(tmp_path, unit=UNITS[which])
    broken.write_text(broken.read_text().replace("ProtectSystem=strict", "ProtectSystm=strict"))
    out = subprocess.run([tool, "verify", str(broken)], capture_output=True, text=True, timeout=60)
    assert "Unknown key" in out.stderr and "ProtectSystm" in out.stderr


# systemd's own scoring of the sandbox (0 = locked down, 10 = exposed): the agent's capabilities cost a little;
# the receiver needs none, nor devices, nor other processes.
EXPOSURE_CEILING = {"agent": 3.5, "triage": 2.5}


@pytest.mark.process
@pytest.mark.parametrize("which", sorted(UNITS))
def test_unit_exposure_stays_low(tmp_path: Path, which: str) -> None:
    tool = _analyze()
    unit = render_unit(tmp_path, unit=UNITS[which])
    out = subprocess.run([tool, "security", "--offline=yes", str(unit)], capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", out.stdout + out.stderr)
    if m is None and "offline" in out.stderr.lower():
        pytest.skip(f"this systemd-analyze has no offline security scoring: {out.stderr.strip()[:200]}")
    assert m is not None, out.stdout[-2000:] + out.stderr
    assert float(m.group(1)) <= EXPOSURE_CEILING[which], out.stdout[-3000:]


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


def _service(path: Path) -> dict[str, list[str]]:
    return {k.removeprefix("[Service]"): v for k, v in unit_settings(path.read_text()).items() if k.startswith("[Service]")}


def _exec_flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_triage_unit_is_hardened_and_shares_the_agents_user_and_state() -> None:
    agent, triage = _service(UNIT), _service(TRIAGE_UNIT)
    for key in ("DynamicUser", "User", "Group", "StateDirectory", "StateDirectoryMode"):
        assert triage[key] == agent[key] and len(triage[key]) == 1, key  # one dynamic user, one state directory
    assert agent["DynamicUser"] == ["yes"] and agent["User"] == ["llm-diag"]
    argv = shlex.split(triage["ExecStart"][0])
    assert argv[:3] == ["/opt/llm-diag/bin/diag", "triage", "serve"]
    agent_argv = shlex.split(agent["ExecStart"][0])
    assert _exec_flag(argv, "--recorder") == _exec_flag(agent_argv, "--recorder") == "%S/llm-diag/recorder.db"
    assert _exec_flag(argv, "--db") == "%S/llm-diag/triage.db"
    host, _, port = _exec_flag(argv, "--listen").rpartition(":")
    assert host == "127.0.0.1" and int(port) == 9095  # the receiver the generated Alertmanager routes post to
    assert triage["CapabilityBoundingSet"] == [""] and triage["AmbientCapabilities"] == [""]  # no privileges at all
    for key, value in (("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"), ("ProtectHome", "yes"),
                       ("PrivateDevices", "yes"), ("ProtectProc", "invisible"), ("PrivateTmp", "yes")):  # fmt: skip
        assert triage[key] == [value], key
    assert not any("TOKEN" in line for line in triage["ExecStart"])  # secrets come from the environment file
    assert triage["EnvironmentFile"] == ["-/etc/llm-diag/triage.env"]


@pytest.mark.slow
@pytest.mark.process
def test_the_triage_units_command_line_runs_on_the_agents_recorder(tmp_path: Path) -> None:
    """Both ExecStart lines as shipped, %S mapped to one temp dir: the agent writes the recorder, the receiver
    starts on it, takes a delivery on the page route the generated Alertmanager config uses, and stops on SIGTERM."""
    from alerts.receiver_routes import receiver_url
    from tests.promserver import free_port

    state = tmp_path / "state"
    (state / "llm-diag").mkdir(parents=True)
    agent_argv = [str(DIAG_BIN), *shlex.split(_service(UNIT)["ExecStart"][0].replace("%S", str(state)))[1:]]
    agent_argv = set_flag(agent_argv, "--listen", "127.0.0.1:0")
    done = subprocess.run([*agent_argv, "--samples", "2", "--no-gpu"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    port = free_port()
    argv = [str(DIAG_BIN), *shlex.split(_service(TRIAGE_UNIT)["ExecStart"][0].replace("%S", str(state)))[1:]]
    argv = set_flag(argv, "--listen", f"127.0.0.1:{port}")
    log = tmp_path / "triage.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=fh)
    try:
        procs.wait_http(f"http://127.0.0.1:{port}/api/incidents", proc, 60, log)
        body = json.loads((REPO / "tests" / "fixtures" / "external" / "alertmanager-0.25-webhook.json").read_text())
        for alert in body["alerts"]:
            alert["labels"].pop("severity", None)  # the route's path alone must make it a page
        url = receiver_url(f"http://127.0.0.1:{port}", "page")
        answer = httpx.post(url, json=body, timeout=30, trust_env=False)
        assert answer.status_code == 200, answer.text
        incidents = httpx.get(f"http://127.0.0.1:{port}/api/incidents", timeout=30, trust_env=False).json()
        assert [i["severity"] for i in incidents] == ["page"], incidents
        assert (state / "llm-diag" / "triage.db").is_file()

        def state_of() -> str:
            return str(httpx.get(f"http://127.0.0.1:{port}/api/incidents", timeout=30, trust_env=False).json()[0]["diag_state"])

        _wait_for(lambda: state_of() in ("done", "failed"), 120)
        assert state_of() == "done", log.read_text(errors="replace")[-2000:]  # diagnosed from the agent's recorder
    finally:
        procs.stop(proc)
    assert proc.returncode == 0, log.read_text(errors="replace")[-2000:]


@pytest.mark.process
def test_the_units_command_line_runs(tmp_path: Path) -> None:
    """ExecStart as shipped (binary and %S mapped to this checkout and a temp dir, a free port)."""
    argv = shlex.split(unit_settings(UNIT.read_text())["[Service]ExecStart"][0])
    argv = [str(DIAG_BIN), *argv[1:]]
    argv = set_flag(argv, "--listen", "127.0.0.1:0")
    kinds = agent_runs(argv, tmp_path)
    assert {"host", "process"} <= set(kinds), kinds


def _require_systemd() -> None:
    if not Path("/run/systemd/system").is_dir():
        pytest.skip("systemd is not PID 1 here (no /run/systemd/system): the units cannot be started for real")
    if os.geteuid() != 0:
        pytest.skip("installing a system unit needs root")


def _journal(unit: str) -> str:
    return subprocess.run(["journalctl", "-u", unit, "--no-pager", "-n", "50"], capture_output=True, text=True).stdout


@contextlib.contextmanager
def _installed(units: list[Path], state: str) -> Iterator[None]:
    """Units copied to /run/systemd/system and started in order; stopped, removed and their state dropped after."""
    targets = [Path("/run/systemd/system") / u.name for u in units]
    for unit, target in zip(units, targets, strict=True):
        shutil.copyfile(unit, target)
    try:
        subprocess.run(["systemctl", "daemon-reload"], check=True, timeout=60)
        for unit in units:
            subprocess.run(["systemctl", "start", unit.name], check=True, timeout=60)
        yield
    finally:
        for unit in reversed(units):
            subprocess.run(["systemctl", "stop", unit.name], timeout=60)
        for target in targets:
            target.unlink(missing_ok=True)
        subprocess.run(["systemctl", "daemon-reload"], timeout=60)
        shutil.rmtree(Path("/var/lib/private") / state, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            (Path("/var/lib") / state).unlink()


def _wait_for(check, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.5)
    return False


@pytest.mark.live
@pytest.mark.host_quiet(reason="a unit started, seen recording and stopped: no fault, no verdict asserted")
def test_unit_starts_and_stops_under_systemd(tmp_path: Path) -> None:
    """Installed in /run/systemd/system under a throw-away name, started, seen recording, stopped, removed."""
    _require_systemd()
    name = f"llm-diag-agent-test-{uuid.uuid4().hex[:8]}"
    unit = render_unit(tmp_path, state=name, listen="127.0.0.1:0", user=name)
    recorder = Path("/var/lib") / name / "recorder.db"
    with _installed([unit], name):
        _wait_for(recorder.exists, 30)
        state = subprocess.run(["systemctl", "is-active", unit.name], capture_output=True, text=True).stdout.strip()
        assert state == "active" and recorder.exists(), _journal(unit.name)


@pytest.mark.live
@pytest.mark.host_quiet(
    reason="the units' shared user and recorder: the diagnosis must be read (no permission error), whatever its class"
)
def test_both_units_share_one_user_and_the_receiver_reads_the_agents_recorder(tmp_path: Path) -> None:
    """The agent and the receiver under throw-away names sharing one throw-away User= and state directory: one
    uid runs both, and a page delivered to the receiver is diagnosed from the agent's recorder (not 'no flight
    recorder', not a permission error on the WAL index)."""
    from alerts.receiver_routes import receiver_url
    from tests.promserver import free_port

    _require_systemd()
    name = f"llm-diag-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    agent = render_unit(tmp_path, state=name, listen="127.0.0.1:0", user=name, name=f"{name}-agent")
    triage = render_unit(tmp_path, state=name, listen=f"127.0.0.1:{port}", unit=TRIAGE_UNIT, user=name,
                         name=f"{name}-triage")  # fmt: skip
    triage.write_text(triage.read_text().replace("llm-diag-agent.service", agent.name))
    recorder = Path("/var/lib") / name / "recorder.db"
    base = f"http://127.0.0.1:{port}"
    with _installed([agent, triage], name):
        assert _wait_for(recorder.exists, 30), _journal(agent.name)
        # the receiver exits "no flight recorder" until the agent created it, and is restarted 5 s later
        assert _wait_for(lambda: _answers(f"{base}/api/incidents"), 60), _journal(triage.name)
        pids = [subprocess.run(["systemctl", "show", "-p", "MainPID", "--value", u.name], capture_output=True,
                               text=True).stdout.strip() for u in (agent, triage)]  # fmt: skip
        assert all(p not in ("", "0") for p in pids), pids
        uids = {Path(f"/proc/{p}/status").read_text().split("Uid:")[1].split()[0] for p in pids}
        assert len(uids) == 1, (uids, _journal(triage.name))
        body = json.loads((REPO / "tests" / "fixtures" / "external" / "alertmanager-0.25-webhook.json").read_text())
        assert httpx.post(receiver_url(base, "page"), json=body, timeout=30, trust_env=False).status_code == 200
        diagnosed = lambda: [i for i in httpx.get(f"{base}/api/incidents", timeout=10, trust_env=False).json()  # noqa: E731
                             if i["diag_state"] == "done"]  # fmt: skip
        assert _wait_for(diagnosed, 120), _journal(triage.name)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


# --------------------------------------------------------------------------- Prometheus


@pytest.mark.process
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


@pytest.mark.process
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


@pytest.mark.slow
@pytest.mark.process
def test_the_shipped_jobs_feed_the_rules_and_tie_agent_and_backend_by_host(tmp_path: Path) -> None:
    """The shipped host and backend jobs in a real Prometheus with the committed rules loaded: targets pointed at a
    real agent, the real reference backend (our tracker's families) and a vLLM /metrics at the wire (tests/vllm_wire.py);
    only targets and intervals rewritten. Both backends' series arrive with ``model``, the agent's and the backends'
    with one ``host``, the backends' runtime families are dropped, and the SLO rules record from the backend job."""
    from diag.demo.harness import demo_server
    from tests.vllm_wire import VllmMetrics, serve

    require_prometheus()
    config = yaml.safe_load(SCRAPE.read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    host, backend = jobs["llm-diag-host"], jobs["llm-backend"]
    rules = sorted(str(p) for p in (REPO / "alerts" / "generated").glob("*.rules.yaml"))
    with (
        running_agent(tmp_path) as agent_port,
        serve(VllmMetrics("vllm-model")) as vllm_port,
        demo_server([], weights_mb=16, weights_dir=tmp_path / "weights", log_dir=tmp_path, ready_timeout=120) as demo,
    ):
        host["static_configs"][0]["targets"] = [f"127.0.0.1:{agent_port}"]
        backend["static_configs"][0]["targets"] = [f"127.0.0.1:{demo.port}", f"127.0.0.1:{vllm_port}"]
        for job in (host, backend):
            job["scrape_interval"], job["scrape_timeout"] = "1s", "1s"
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        config["scrape_configs"], config["rule_files"] = [host, backend], rules
        for _ in range(5):
            httpx.post(f"{demo.url}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=60, trust_env=False)
        with prometheus([], config=yaml.safe_dump(config)) as prom:
            assert prom.wait_for("count(up == 1)", lambda r: bool(r) and r[0]["value"][1] == "3", 40), prom.log_tail()
            requests = 'llmdiag:slo_requests:increase5m{slo="availability", job="llm-backend"}'
            assert prom.wait_for(requests, bool, 60), prom.log_tail()  # the committed SLO rules read the backend job
            vllm = prom.query('vllm:num_requests_running{job="llm-backend"}')
            assert [(s["metric"]["model"], s["metric"]["model_name"]) for s in vllm] == [("vllm-model", "vllm-model")]
            ours = prom.query('llmdiag_requests_total{job="llm-backend"}')
            assert ours and all(s["metric"].get("model") for s in ours)
            hosts = {job: {s["metric"].get("host") for s in prom.query(f'{{job="{job}", __name__=~"llmdiag_.*|vllm:.*"}}')}
                     for job in ("llm-diag-host", "llm-backend")}  # fmt: skip
            assert hosts == {"llm-diag-host": {"127.0.0.1"}, "llm-backend": {"127.0.0.1"}}, hosts
            dropped = prom.query('count({job="llm-backend", __name__=~"http_.*|python_.*|process_.*"})')
            assert dropped == [], dropped  # the backends' HTTP and runtime families are not kept


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


@pytest.mark.process
def test_daemonset_agent_arguments_run(tmp_path: Path) -> None:
    """The pod's args, with the mount points mapped back to the host paths they mount."""
    ds, _ = _daemonset()
    args = ds["spec"]["template"]["spec"]["containers"][0]["args"]
    args = [a.replace("/host/proc", "/proc").replace("/host/sys", "/sys") for a in args]
    argv = set_flag([str(DIAG_BIN), "collect", *args], "--listen", "127.0.0.1:0")
    assert {"host", "process"} <= set(agent_runs(argv, tmp_path))


@pytest.mark.process
def test_containerfile_runs_the_agent_on_the_hosts_proc_and_sys(tmp_path: Path) -> None:
    argv = containerfile_argv()
    assert argv[:2] == ["/opt/llm-diag/bin/diag", "collect"]
    assert argv[argv.index("--proc-root") + 1] == "/host/proc" and argv[argv.index("--sys-root") + 1] == "/host/sys"
    assert "USER 10001" in CONTAINERFILE.read_text()  # never root inside the image
    ds, _ = _daemonset()
    assert ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]["runAsUser"] == 10001
    run = [str(DIAG_BIN), *argv[1:]]
    run = set_flag(set_flag(set_flag(run, "--proc-root", "/proc"), "--sys-root", "/sys"), "--listen", "127.0.0.1:0")
    assert {"host", "process"} <= set(agent_runs(run, tmp_path))


@pytest.mark.process
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
