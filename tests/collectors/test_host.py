"""HostSampler against node_exporter's own expected output, procfs's fixture, and the live kernel.

The oracle for the fixtures is what node_exporter reports for the same files
(``expected_metrics.prom``, lines of its golden e2e output); the oracle for the MemAvailable
estimate is the live kernel's own MemAvailable, hidden from the sampler.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from pathlib import Path

import pytest

from collectors.catalog import MEMINFO_FIELDS, PSI_RESOURCES, VMSTAT_FIELDS
from collectors.host import HostSampler, parse_zoneinfo
from collectors.procfs import parse_flat_keyed, parse_meminfo
from collectors.records import HostSnapshot, record_from_json
from tests.paths import EXTERNAL

NODE_PROC = EXTERNAL / "node_exporter" / "proc"
NODE_EXPECTED = EXTERNAL / "node_exporter" / "expected_metrics.prom"
PROCFS_PROC = EXTERNAL / "procfs" / "proc"


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def load_prom(path: Path) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text exposition file (labelled ones are per-NUMA-node: not ours)."""
    values: dict[str, float] = {}
    for line in path.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        assert match, f"unparseable exposition line: {line!r}"
        name, labels, value = match.groups()
        if labels is None:
            values[name] = float(value)
    return values


def node_memory_name(key: str) -> str:
    """node_exporter's meminfo naming: ``Active(file)`` -> ``node_memory_Active_file_bytes``."""
    return "node_memory_" + re.sub(r"\((.*)\)", r"_\1", key) + "_bytes"


def test_node_exporter_fixture_matches_node_exporter_output() -> None:
    expected = load_prom(NODE_EXPECTED)
    snap = HostSampler(str(NODE_PROC)).sample(now=1000.0)
    assert snap.ts == 1000.0

    pressure = {k: v for k, v in expected.items() if k.startswith("node_pressure_")}
    assert len(pressure) == 6  # cpu/io/memory waiting, io/memory/irq stalled
    for name, value in pressure.items():
        match = re.fullmatch(r"node_pressure_(\w+?)_(waiting|stalled)_seconds_total", name)
        assert match, name
        resource, kind = match.groups()
        line = snap.psi[resource].some if kind == "waiting" else snap.psi[resource].full
        assert line is not None, name
        assert math.isclose(line.total_us / 1e6, value, rel_tol=1e-12, abs_tol=1e-12), name
    assert snap.psi["irq"].some is None  # irq has only a full line

    assert snap.memory["total"] == expected["node_memory_MemTotal_bytes"]
    for key, snake in MEMINFO_FIELDS.items():
        name = node_memory_name(key)
        if name in expected:
            assert snap.memory[snake] == expected[name], key
    assert "node_memory_MemAvailable_bytes" not in expected  # the fixture predates MemAvailable

    vmstat = {k.removeprefix("node_vmstat_"): v for k, v in expected.items() if k.startswith("node_vmstat_")}
    assert vmstat, "no node_vmstat_* lines in the expected output"
    for field, value in vmstat.items():
        assert field in VMSTAT_FIELDS, f"node_exporter exports {field}, which the catalog does not declare"
        assert snap.vmstat[field] == value, field
    assert snap.missing == {}


@pytest.mark.parametrize("proc", [NODE_PROC, PROCFS_PROC], ids=["node_exporter", "procfs"])
def test_memavailable_fallback_is_plausible_and_flagged(proc: Path) -> None:
    sampler = HostSampler(str(proc))
    snap = sampler.sample()
    assert "MemAvailable" not in (proc / "meminfo").read_text()
    assert snap.memory_available_estimated is True
    assert sampler.available_method == "default_min_free"  # neither fixture has zoneinfo or sys/vm
    assert snap.memory["free"] <= snap.memory["available"] <= snap.memory["total"]
    assert "memory.available" not in snap.missing


def test_old_kernel_per_zone_reclaim_counters_are_summed() -> None:
    raw = parse_flat_keyed((NODE_PROC / "vmstat").read_text())
    snap = HostSampler(str(NODE_PROC)).sample()
    for name in ("pgscan_kswapd", "pgscan_direct", "pgsteal_kswapd", "pgsteal_direct"):
        assert name not in raw  # a pre-4.8 kernel: per-zone lines only
        zones = [v for k, v in raw.items() if re.fullmatch(rf"{name}_(dma|dma32|normal|movable)", k)]
        assert len(zones) == 4
        assert snap.vmstat[name] == sum(zones)
    assert "pgscan_direct_throttle" in raw  # not a zone: must not be summed in
    assert snap.vmstat["pgscan_direct"] == raw["pgscan_direct_dma32"] + raw["pgscan_direct_normal"]
    # Counters this kernel does not have are absent, not zero and not "missing".
    assert "pgscan_anon" not in snap.vmstat and "workingset_refault_file" not in snap.vmstat


def test_procfs_fixture_meminfo_and_pressure() -> None:
    snap = HostSampler(str(PROCFS_PROC)).sample()
    assert snap.memory["total"] == 15666184 * 1024
    assert snap.memory["inactive_file"] == 6532440 * 1024
    assert snap.memory["swap_total"] == 0
    assert snap.memory["slab_reclaimable"] == 1738124 * 1024
    cpu = snap.psi["cpu"]
    assert cpu.full is None and cpu.some is not None
    assert (cpu.some.avg10, cpu.some.avg60, cpu.some.avg300, cpu.some.total_us) == (0.10, 2.00, 3.85, 15)
    assert snap.psi["memory"].full is not None and snap.psi["memory"].full.total_us == 25
    assert snap.psi["io"].full is not None and snap.psi["io"].full.avg300 == 4.95
    # procfs ships no vmstat: reported, not invented.
    assert snap.vmstat == {}
    assert set(snap.missing) == {"vmstat"}
    assert "No such file" in snap.missing["vmstat"]


def test_live_host_has_every_field() -> None:
    if not Path("/proc/pressure/memory").exists():
        pytest.skip("kernel without PSI (CONFIG_PSI / psi=1)")
    snap = HostSampler().sample()
    assert snap.missing == {}
    assert set(PSI_RESOURCES) <= set(snap.psi)
    for resource in PSI_RESOURCES:
        assert snap.psi[resource].some is not None
    assert set(snap.memory) == set(MEMINFO_FIELDS.values())
    assert snap.memory_available_estimated is False
    assert 0 < snap.memory["available"] <= snap.memory["total"]
    # workingset_refault was split into _anon/_file in 5.9; every other catalog counter exists on this kernel.
    assert set(VMSTAT_FIELDS) - {"workingset_refault"} <= set(snap.vmstat)
    # Counters only grow: a later direct read is never below what the sampler saw.
    later = parse_flat_keyed(Path("/proc/vmstat").read_text())
    for name, value in snap.vmstat.items():
        assert 0 <= value <= later[name], name
    assert record_from_json(snap.to_json()) == snap


def _hidden_memavailable_root(tmp_path: Path) -> tuple[Path, int]:
    """A proc root holding one consistent read of live meminfo, minus its MemAvailable line."""
    text = Path("/proc/meminfo").read_text()
    kernel_value = parse_meminfo(text)["MemAvailable"]
    root = tmp_path / "proc"
    root.mkdir()
    (root / "meminfo").write_text("".join(line + "\n" for line in text.splitlines() if not line.startswith("MemAvailable:")))
    return root, kernel_value


def test_fallback_reproduces_the_live_kernels_memavailable(tmp_path: Path) -> None:
    if not Path("/proc/zoneinfo").exists():
        pytest.skip("no /proc/zoneinfo")
    root, kernel_value = _hidden_memavailable_root(tmp_path)
    shutil.copy("/proc/zoneinfo", root / "zoneinfo")
    sampler = HostSampler(str(root))
    snap = sampler.sample()
    assert sampler.available_method == "zoneinfo"
    assert snap.memory_available_estimated is True
    # Same formula, same inputs: equal up to the kernel's page rounding of kB values.
    assert abs(snap.memory["available"] - kernel_value) <= 2 * sampler.page_size, (snap.memory["available"], kernel_value)


def test_fallback_from_min_free_kbytes_is_close(tmp_path: Path) -> None:
    root, kernel_value = _hidden_memavailable_root(tmp_path)
    (root / "sys" / "vm").mkdir(parents=True)
    shutil.copy("/proc/sys/vm/min_free_kbytes", root / "sys" / "vm" / "min_free_kbytes")
    sampler = HostSampler(str(root))
    snap = sampler.sample()
    assert sampler.available_method == "min_free_kbytes"
    total = snap.memory["total"]
    # An approximation (no lowmem_reserve term): within 1% of RAM of the kernel's figure.
    assert abs(snap.memory["available"] - kernel_value) <= total // 100, (snap.memory["available"], kernel_value)


def test_parse_zoneinfo_sums_low_and_totalreserve() -> None:
    text = """Node 0, zone      DMA
  per-node stats
      nr_inactive_anon 1
  pages free     3840
        boost    0
        min      66
        low      82
        high     98
        spanned  4095
        present  3998
        managed  3840
        protection: (0, 3019, 3787, 3787, 3787)
  pagesets
    cpu: 0
              count: 0
              high:  0
              batch: 1
Node 0, zone    DMA32
  pages free     772915
        min      13416
        low      16770
        high     20124
        managed  772915
        protection: (0, 0, 768, 768, 768)
    cpu: 0
              high:  378
Node 0, zone  Movable
  pages free     0
        min      32
        low      32
        high     32
        managed  0
        protection: (0, 0, 0, 0, 0)
"""
    marks = parse_zoneinfo(text)
    assert marks is not None
    assert marks.low == 82 + 16770 + 32
    # DMA: high + max protection capped at managed; DMA32: 20124 + 768; Movable: capped at 0.
    assert marks.totalreserve == 3840 + (20124 + 768) + 0
    assert parse_zoneinfo("") is None
    assert parse_zoneinfo("Node 0, zone DMA\n  pages free 1\n") is None


def test_optional_irq_absent_is_not_missing_but_broken_required_files_are(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    (root / "pressure").mkdir(parents=True)
    (root / "pressure" / "cpu").write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=5\n")
    (root / "pressure" / "memory").mkdir()  # EISDIR when read: PSI "present" but unreadable
    (root / "pressure" / "io").write_text("some avg10=nan avg60=0.00 avg300=0.00 total=5\n")
    (root / "meminfo").write_text("MemFree: 10 kB\n")
    snap = HostSampler(str(root)).sample()
    assert set(snap.psi) == {"cpu"}
    assert "psi.irq" not in snap.missing
    assert "Is a directory" in snap.missing["psi.memory"]
    assert snap.missing["psi.io"] == "no parseable some/full line"
    assert snap.missing["memory.total"] == "MemTotal not in meminfo"
    assert "memory.available" in snap.missing and "available" not in snap.memory
    assert "No such file" in snap.missing["vmstat"]
    (root / "pressure" / "irq").write_text("garbage\n")
    assert HostSampler(str(root)).sample().missing["psi.irq"] == "no parseable some/full line"


def test_missing_proc_root_never_raises(tmp_path: Path) -> None:
    snap = HostSampler(str(tmp_path / "nope")).sample(now=5.0)
    assert isinstance(snap, HostSnapshot) and snap.ts == 5.0
    assert snap.psi == {} and snap.memory == {} and snap.vmstat == {}
    assert {"psi.cpu", "psi.memory", "psi.io", "memory", "memory.total", "memory.available", "vmstat"} == set(snap.missing)


def test_page_size_is_the_systems() -> None:
    assert HostSampler().page_size == os.sysconf("SC_PAGE_SIZE")
