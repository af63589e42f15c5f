"""A real ``diag collect`` watching more model-holding processes than its cap: its /metrics stays bounded.

Eight real processes each hold the same model file open and hold a different amount of memory; the
agent runs with ``--max-processes 3``. Scraped over HTTP, /metrics must carry the three largest by
pid, one ``pid="other"`` series with the rest, the same three on every scrape, and no more series
than the README's "Series per host" bound.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from collectors.series_cap import OVERFLOW
from tests import procs

DIAG = [sys.executable, "-m", "diag.cli"]
HOLDER = (  # holds the model file open and N MiB of touched memory, says so, then waits to be stopped
    "import sys, time\nf = open(sys.argv[1], 'rb')\nb = b'x' * (int(sys.argv[2]) << 20)\n"
    "print('ready', flush=True)\ntime.sleep(600)"
)
# The agent watches every model-holding process on the host, other tests' servers too (~150-250 MiB each): the three
# that must be kept are larger than any of those, so which three are kept does not depend on what else runs.
SIZES_MIB = (8, 12, 16, 20, 40, 500, 600, 700)
CAP = 3
PER_PROCESS = 5  # rss, pss, uss, swap, major faults
PER_CGROUP = 32  # the README's bound: 6 memory gauges, 6 stat gauges, 3 stat counters, 2 x 7 events, under_oom, 2 PSI


@pytest.fixture
def holders(tmp_path: Path) -> Iterator[dict[int, int]]:
    """pid -> MiB held, for eight processes holding tmp_path/m.gguf open."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(4096))
    started: list[subprocess.Popen[str]] = []
    try:
        for mib in SIZES_MIB:
            started.append(subprocess.Popen([sys.executable, "-c", HOLDER, str(model), str(mib)],
                                            stdout=subprocess.PIPE, text=True))  # fmt: skip
        for p in started:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        yield {p.pid: mib for p, mib in zip(started, SIZES_MIB, strict=True)}
    finally:
        for p in started:
            procs.stop(p)


def _scrape(url: str) -> dict[str, list[dict[str, str]]]:
    text = httpx.get(url, timeout=5.0, trust_env=False).text
    out: dict[str, list[dict[str, str]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(dict(s.labels))
    return out


@pytest.mark.process
def test_agent_metrics_stay_under_the_cap_with_more_processes(tmp_path: Path, holders: dict[int, int]) -> None:
    log = tmp_path / "agent.log"
    with log.open("wb") as fh:
        agent = subprocess.Popen(
            [*DIAG, "collect", "--interval", "250ms", "--listen", "127.0.0.1:0", "--recorder", str(tmp_path / "r.db"),
             "--no-gpu", "--no-kmsg", "--top", "0", "--max-processes", str(CAP), "--max-cgroups", "1"],
            stdout=subprocess.DEVNULL, stderr=fh,
        )  # fmt: skip
    try:
        url = f"http://{procs.agent_address(log, agent, 60)}/metrics"
        mine = {str(pid) for pid in holders}
        largest = {str(pid) for pid, mib in sorted(holders.items(), key=lambda kv: -kv[1])[:CAP]}

        def all_seen() -> bool:
            folded = _scrape(url).get("llmdiag_series_folded", [])
            return {"kind": "process"} in folded and _folded(url) >= len(holders) - CAP

        assert procs.poll_until(all_seen, 30), _scrape(url).get("llmdiag_process_resident_memory_bytes")
        for _ in range(3):  # several samples apart: the same three every time
            first = _samples_seen(url)
            assert procs.poll_until(lambda first=first: _samples_seen(url) > first, 10)
            series = _scrape(url)
            rss_pids = {lbl["pid"] for lbl in series["llmdiag_process_resident_memory_bytes"]}
            assert rss_pids & mine == largest
            assert OVERFLOW in rss_pids and len(rss_pids) <= CAP + 1
            for name, labels in series.items():  # every pid-labelled family, the GPU's aside (--no-gpu), within the cap
                pids = {lbl["pid"] for lbl in labels if "pid" in lbl}
                assert len(pids - {OVERFLOW}) <= CAP, name
            model_counts = [lbl for lbl in series["llmdiag_model_processes"] if lbl["model"].endswith("m.gguf")]
            assert len(model_counts) == 1  # every holder counted there, folded ones too (value checked below)
            process_series = sum(len([lbl for lbl in labels if "pid" in lbl]) for labels in series.values())
            cgroups = {lbl["cgroup"] for labels in series.values() for lbl in labels if "cgroup" in lbl}
            assert len(cgroups) <= 2  # --max-cgroups 1: one group and at most the overflow
            cgroup_series = sum(len([lbl for lbl in labels if "cgroup" in lbl]) for labels in series.values())
            assert process_series <= PER_PROCESS * (CAP + 1) + CAP  # + one model-info series per kept holder
            assert cgroup_series <= PER_CGROUP * len(cgroups)
        text = httpx.get(url, timeout=5.0, trust_env=False).text
        count_line = [ln for ln in text.splitlines() if ln.startswith("llmdiag_model_processes{") and "m.gguf" in ln]
        assert float(count_line[0].rsplit(" ", 1)[1]) == len(holders)
    finally:
        procs.stop(agent)


def _folded(url: str) -> float:
    text = httpx.get(url, timeout=5.0, trust_env=False).text
    for line in text.splitlines():
        if line.startswith('llmdiag_series_folded{kind="process"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _samples_seen(url: str) -> float:
    """Samples taken while folding (llmdiag_series_overflow_total): one more per sample here, so it tells a new sample."""
    text = httpx.get(url, timeout=5.0, trust_env=False).text
    for line in text.splitlines():
        if line.startswith('llmdiag_series_overflow_total{kind="process"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
