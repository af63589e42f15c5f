"""The infrastructure gate, on fake /proc and /sys trees written per test (v2, v1 on a hybrid host, none), on
``systemctl show``'s own text, on a fake ``systemctl`` first on PATH, and once on a real v1 memory group.

``systemctl`` cannot run here for real (systemd is not PID 1 on this host), so --unit is tested with a fake
``systemctl`` executable -- a mock of what cannot run, at its interface: the command line in, ``systemctl show``'s
``Key=Value`` text out. The real one, where it exists and fails, is checked to give the same clear exit 2.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from diag.cli.main import app
from diag.gate.infra import check_infrastructure
from diag.gate.spec import InfraSpec, SpecError, parse_spec
from diag.gate.unit import Completed, OomdState, UnitError, oomd_state, parse_show, show_unit

GiB = 1 << 30
PSI = "some avg10=1.50 avg60=0.80 avg300=0.20 total=12345\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
UNLIMITED_V1 = "9223372036854771712"
STEP = {"rate": 1, "duration": 1, "prompt_tokens": 4, "output_tokens": 4}


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def _proc(tmp: Path, *, swap_kib: int = 0, psi: bool = True, memory_enabled: str = "1") -> str:
    root = tmp / "proc"
    files = {
        "meminfo": f"MemTotal: 16000000 kB\nMemFree: 8000000 kB\nSwapTotal: {swap_kib} kB\nSwapFree: {swap_kib} kB\n",
        "cgroups": f"#subsys_name\thierarchy\tnum_cgroups\tenabled\ncpu\t1\t1\t1\nmemory\t4\t9\t{memory_enabled}\n",
        "sys/vm/swappiness": "60\n",
    }
    if psi:
        files["pressure/memory"] = PSI
    _write(root, files)
    return str(root)


def _v2_tree(tmp: Path, *, swap_max: str = "0", group_controllers: str = "cpu memory") -> str:
    """A unified host: /system.slice limited to 4 GiB, the service under it with its own high/low/min."""
    base = tmp / "sys" / "fs" / "cgroup"
    svc = "system.slice/llm.service/"
    _write(base, {
        "cgroup.controllers": "cpu io memory pids\n",
        "system.slice/cgroup.controllers": "cpu memory\n", "system.slice/memory.max": f"{4 * GiB}\n",
        "system.slice/memory.high": "max\n", "system.slice/memory.low": f"{2 * GiB}\n", "system.slice/memory.min": "0\n",
        svc + "cgroup.controllers": group_controllers + "\n", svc + "memory.max": "max\n",
        svc + "memory.high": f"{3 * GiB}\n", svc + "memory.low": f"{GiB}\n", svc + "memory.min": "0\n",
        svc + "memory.swap.max": swap_max + "\n", svc + "memory.pressure": PSI,
    })  # fmt: skip
    return str(tmp / "sys")


def _by_name(gate) -> dict:  # type: ignore[no-untyped-def]
    return {c.name: c for c in gate.checks}


def test_v2_group_with_every_requirement_met(tmp_path: Path) -> None:
    req = InfraSpec(require_cgroup_v2=True, require_psi=True, require_memory_max=True, require_memory_accounting=True,
                    forbid_swap=True)  # fmt: skip
    gate = check_infrastructure(req, cgroups=["/system.slice/llm.service"], proc_root=_proc(tmp_path, swap_kib=2 << 20),
                                sys_root=_v2_tree(tmp_path))  # fmt: skip
    c = _by_name(gate)
    assert gate.passed, gate.checks
    assert c["cgroup"].state == "PASS" and c["cgroup"].value == "v2, memory controller on /system.slice/llm.service"
    assert c["psi"].state == "PASS" and c["psi"].value.startswith("per-group: ") and "1.5 %" in c["psi"].detail
    # the group's own memory.max is "max": the effective limit is its parent's
    assert c["memory_max"].state == "PASS" and c["memory_max"].value == "4.0 GiB", c["memory_max"]
    assert "set at /system.slice" in c["memory_max"].detail
    assert c["memory_protection"].value == "high 3.0 GiB, low 1.0 GiB, min 0 B"
    # protection is handed down: a parent that protects nothing leaves its child none, whatever the child asks
    (tmp_path / "sys/fs/cgroup/system.slice/memory.low").write_text("0\n")
    again = check_infrastructure(
        req, cgroups=["/system.slice/llm.service"], proc_root=_proc(tmp_path), sys_root=str(tmp_path / "sys")
    )
    assert _by_name(again)["memory_protection"].value == "high 3.0 GiB, low 0 B (at /system.slice), min 0 B"
    assert c["swap"].state == "PASS" and "memory.swap.max 0" in c["swap"].value and "swap 2.0 GiB" in c["swap"].value
    assert c["memory_accounting"].state == "PASS"


def test_swap_the_group_may_use_warns_and_fails_only_when_forbidden(tmp_path: Path) -> None:
    proc, sys_root = _proc(tmp_path, swap_kib=1 << 20), _v2_tree(tmp_path, swap_max="max")
    reported = check_infrastructure(InfraSpec(), cgroups=["/system.slice/llm.service"], proc_root=proc, sys_root=sys_root)
    assert _by_name(reported)["swap"].state == "WARN" and reported.passed  # by default only reported
    forbidden = check_infrastructure(InfraSpec(forbid_swap=True), cgroups=["/system.slice/llm.service"], proc_root=proc,
                                     sys_root=sys_root)  # fmt: skip
    swap = _by_name(forbidden)["swap"]
    assert swap.state == "FAIL" and "memory.swap.max max" in swap.value and "required: forbid_swap" in swap.detail
    assert not forbidden.passed


def test_a_v2_group_without_the_memory_controller(tmp_path: Path) -> None:
    sys_root = _v2_tree(tmp_path, group_controllers="cpu")
    gate = check_infrastructure(InfraSpec(), cgroups=["/system.slice/llm.service"], proc_root=_proc(tmp_path),
                                sys_root=sys_root)  # fmt: skip
    assert _by_name(gate)["cgroup"].state == "WARN" and "no memory controller" in _by_name(gate)["cgroup"].value
    strict = check_infrastructure(InfraSpec(require_memory_accounting=True), cgroups=["/system.slice/llm.service"],
                                  proc_root=_proc(tmp_path), sys_root=sys_root)  # fmt: skip
    assert _by_name(strict)["cgroup"].state == "FAIL"


def _hybrid(tmp: Path, pid: int, *, memsw: str | None) -> tuple[str, str]:
    """A hybrid host: memory on v1 (the group unlimited itself, 2 GiB from its parent), cgroup2 beside it with the
    process's own group; the process is found through /proc/<pid>/cgroup."""
    base = tmp / "sys" / "fs" / "cgroup"
    grp = "memory/apps/llm/"
    files = {
        "memory/memory.usage_in_bytes": "1\n", "memory/apps/memory.limit_in_bytes": f"{2 * GiB}\n",
        grp + "memory.limit_in_bytes": UNLIMITED_V1 + "\n", grp + "memory.soft_limit_in_bytes": f"{GiB}\n",
        grp + "memory.stat": f"cache 0\nrss 0\nhierarchical_memory_limit {2 * GiB}\n", grp + "memory.swappiness": "10\n",
        "unified/cgroup.controllers": "\n", "unified/other/llm/memory.pressure": PSI, grp + "cgroup.procs": f"{pid}\n",
    }  # fmt: skip
    if memsw is not None:
        files[grp + "memory.memsw.limit_in_bytes"] = memsw + "\n"
    _write(base, files)
    proc = _proc(tmp, swap_kib=1 << 20)
    _write(Path(proc), {f"{pid}/cgroup": "4:memory:/apps/llm\n1:cpu:/\n0::/other/llm\n"})
    return proc, str(tmp / "sys")


def test_v1_on_a_hybrid_host_found_by_pid(tmp_path: Path) -> None:
    proc, sys_root = _hybrid(tmp_path, 4242, memsw=UNLIMITED_V1)
    gate = check_infrastructure(InfraSpec(require_cgroup_v2=True), pids=[4242], proc_root=proc, sys_root=sys_root)
    c = _by_name(gate)
    assert c["cgroup"].state == "FAIL" and c["cgroup"].value == "v1 memory controller on /apps/llm"
    assert "hybrid" in c["cgroup"].detail and "--pid 4242" in c["cgroup"].detail
    assert c["psi"].state == "PASS" and "unified/other/llm/memory.pressure" in c["psi"].value  # its cgroup2 group's
    assert c["memory_max"].value == "2.0 GiB" and "hierarchical_memory_limit" in c["memory_max"].detail
    assert c["memory_protection"].value == "soft limit 1.0 GiB"
    assert c["swap"].state == "WARN" and "swappiness 10 (the group's)" in c["swap"].value
    assert [x.name for x in gate.checks if x.state == "FAIL"] == ["cgroup"]
    # named by path, the group's cgroup2 twin is its first process's
    by_path = check_infrastructure(InfraSpec(), cgroups=["/apps/llm"], proc_root=proc, sys_root=sys_root)
    assert "unified/other/llm/memory.pressure" in _by_name(by_path)["psi"].value


def test_v1_swap_is_off_when_memsw_equals_the_limit(tmp_path: Path) -> None:
    proc, sys_root = _hybrid(tmp_path, 4242, memsw=str(2 * GiB))
    base = Path(sys_root) / "fs/cgroup/memory/apps/llm"
    (base / "memory.limit_in_bytes").write_text(f"{2 * GiB}\n")
    swap = _by_name(check_infrastructure(InfraSpec(forbid_swap=True), pids=[4242], proc_root=proc, sys_root=sys_root))["swap"]
    assert swap.state == "PASS" and "may not swap" in swap.detail


def test_no_target_no_psi_no_hierarchy(tmp_path: Path) -> None:
    req = InfraSpec(require_psi=True, require_memory_max=True)
    gate = check_infrastructure(req, proc_root=_proc(tmp_path, psi=False, memory_enabled="0"), sys_root=str(tmp_path / "sys"))
    c = _by_name(gate)
    assert c["psi"].state == "FAIL" and c["psi"].value == "not available" and "CONFIG_PSI" in c["psi"].detail
    assert c["memory_max"].state == "FAIL" and "no --pid, --cgroup or --unit" in c["memory_max"].detail
    assert c["cgroup"].state == "NOT AVAILABLE" and c["memory_accounting"].state == "WARN"
    assert c["memory_protection"].state == "NOT AVAILABLE"
    relaxed = check_infrastructure(InfraSpec(), proc_root=_proc(tmp_path, psi=False), sys_root=str(tmp_path / "sys"))
    assert relaxed.passed and _by_name(relaxed)["psi"].state == "NOT AVAILABLE"


def test_a_named_group_that_does_not_exist_fails(tmp_path: Path) -> None:
    gate = check_infrastructure(InfraSpec(), cgroups=["/nope"], proc_root=_proc(tmp_path), sys_root=_v2_tree(tmp_path))
    assert _by_name(gate)["cgroup"].state == "FAIL" and "group /nope not found" in _by_name(gate)["cgroup"].detail
    assert not gate.passed


# --------------------------------------------------------------------------- systemd


SHOW = """LoadState=loaded
ActiveState=active
ControlGroup=/system.slice/llm.service
MainPID=4242
MemoryAccounting=yes
MemoryHigh=3221225472
MemoryMax=infinity
MemoryLow=0
MemoryMin=0
"""


def _runner(answers: dict[str, Completed]) -> Callable[[Sequence[str]], Completed]:
    def run(argv: Sequence[str]) -> Completed:
        key = " ".join(argv[:2])
        if key not in answers:
            raise UnitError(f"{argv[0]}: not found on PATH")
        return answers[key]

    return run


def test_systemctl_show_is_read_and_its_failures_are_one_line() -> None:
    info = show_unit("llm.service", _runner({"systemctl show": Completed(0, SHOW, "")}))
    assert info.cgroup == "/system.slice/llm.service" and info.main_pid == 4242
    assert info.memory("MemoryHigh") == 3 * GiB and info.memory("MemoryMax") is None
    assert parse_show("A=b=c\nnoise\n") == {"A": "b=c"}
    cases = [
        ({"systemctl show": Completed(0, "LoadState=not-found\nMainPID=0\n", "")}, "systemd has no such unit"),
        ({"systemctl show": Completed(1, "", "System has not been booted with systemd as init system (PID 1).\n")},
         "systemctl show failed: System has not been booted with systemd"),
        ({}, "--unit llm.service: systemctl: not found on PATH"),
        ({"systemctl show": Completed(0, "MainPID=x\n", "")}, "MainPID='x' is not a process id"),
    ]  # fmt: skip
    for answers, says in cases:
        with pytest.raises(UnitError, match=None) as err:
            show_unit("llm.service", _runner(answers))
        assert says in str(err.value)
    with pytest.raises(UnitError, match="not a systemd unit name"):
        show_unit("--all", _runner({}))


def test_the_units_group_settings_and_oomd_in_the_gate(tmp_path: Path) -> None:
    info = show_unit("llm.service", _runner({"systemctl show": Completed(0, SHOW.replace("=yes", "=no"), "")}))
    oomd = oomd_state(_runner({"systemctl is-active": Completed(0, "active\n", ""),
                               "oomctl": Completed(0, "Dry Run: no\n-> Path: /system.slice\n", "")}))  # fmt: skip
    gate = check_infrastructure(InfraSpec(require_memory_accounting=True), unit=info, oomd=oomd,
                                proc_root=_proc(tmp_path), sys_root=_v2_tree(tmp_path))  # fmt: skip
    c = _by_name(gate)
    assert c["cgroup"].value == "v2, memory controller on /system.slice/llm.service" and "unit llm.service" in c["cgroup"].detail
    assert c["memory_accounting"].state == "FAIL" and c["memory_accounting"].value == "MemoryAccounting=no"
    assert c["unit"].state == "PASS" and "MainPID=4242" in c["unit"].value and "MemoryMax=infinity" in c["unit"].value
    assert "MemoryMax=infinity" in c["memory_max"].detail
    assert c["systemd_oomd"].state == "PASS" and "lists /system.slice/llm.service" in c["systemd_oomd"].detail
    idle = oomd_state(_runner({"systemctl is-active": Completed(3, "inactive\n", "")}))
    assert idle == OomdState("inactive")
    gone = oomd_state(_runner({}))
    assert gone.active is None and "not found" in gone.why


def test_spec_sections_are_validated() -> None:
    spec = parse_spec({"steps": [STEP], "infrastructure": {"require_psi": True}})
    assert spec.infrastructure.required() == ["require_psi"] and spec.application is None
    assert parse_spec({"steps": [STEP]}).infrastructure == InfraSpec()
    for doc, says in [
        ({"infrastructure": {"require_gpu": True}}, "infrastructure.require_gpu: unknown key"),
        ({"infrastructure": {"forbid_swap": "yes"}}, "infrastructure.forbid_swap: got 'yes'; expected true or false"),
    ]:
        with pytest.raises(SpecError) as err:
            parse_spec({"steps": [STEP], **doc})
        assert says in str(err.value)


@pytest.mark.process
def test_unit_on_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--unit with --pid is refused; a fake systemctl that fails, or none on PATH, is exit 2 in one line."""
    spec = tmp_path / "gate.yaml"
    spec.write_text(yaml.safe_dump({"steps": [STEP]}))
    base = ["gate", "--spec", str(spec), "--target", "http://127.0.0.1:9"]
    out = CliRunner().invoke(app, [*base, "--unit", "llm.service", "--pid", str(os.getpid())])
    assert out.exit_code == 2 and "--unit: give the unit, or --pid/--cgroup, not both" in out.output
    fake = tmp_path / "bin" / "systemctl"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'System has not been booted with systemd as init system (PID 1).' >&2\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(fake.parent))
    out = CliRunner().invoke(app, [*base, "--unit", "llm.service"])
    assert out.exit_code == 2 and "Traceback" not in out.output
    assert "--unit llm.service: systemctl show failed: System has not been booted with systemd" in out.output
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    out = CliRunner().invoke(app, [*base, "--unit", "llm.service"])
    assert out.exit_code == 2 and "--unit llm.service: systemctl: not found on PATH" in out.output
    real = shutil.which("systemctl", path=os.defpath + ":/usr/bin:/bin")
    if real and Path("/proc/1/comm").read_text().strip() != "systemd":  # the real one, where it cannot work
        monkeypatch.setenv("PATH", str(Path(real).parent))
        out = CliRunner().invoke(app, [*base, "--unit", "llm.service"])
        assert out.exit_code == 2 and "--unit llm.service: systemctl show failed" in out.output, out.output


@pytest.mark.live
@pytest.mark.host_quiet(reason="an empty 256 MiB group whose limit is read: nothing runs in it")
def test_a_real_v1_group_limit_is_read() -> None:
    from tests.livecg import memory_cgroup

    with memory_cgroup(256 << 20, name="llmdiag-gateinfra") as group:
        gate = check_infrastructure(InfraSpec(require_memory_max=True), cgroups=[group.path])
        c = _by_name(gate)
        assert c["memory_max"].state == "PASS" and c["memory_max"].value == "256.0 MiB", c["memory_max"]
        assert c["cgroup"].value.endswith(group.path) and c["memory_accounting"].state == "PASS"
