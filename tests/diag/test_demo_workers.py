"""Four workers, four copies of the model -- or one: ``--preload per-worker`` vs ``--preload shared``, measured.

Measured from the kernel, per worker PID: ``/proc/<pid>/status`` (RssAnon) and ``/proc/<pid>/smaps``
(Rss/Pss of the checkpoint's own mapping), and with llm-diag's ``ProcessSampler``, which must see all
four workers holding the model file in both modes (per-worker copies keep the file mapped read-only
for its header -- a real mapping, visible in /proc/<pid>/maps).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from collectors.processes import ProcessSampler, model_process_counts
from diag.demo.harness import DemoServer, post_all, start_demo

pytestmark = pytest.mark.process

WEIGHTS_MB = 32
MB = 1024 * 1024


@pytest.fixture(scope="module")
def wdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("weights")


def _status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _file_mapping(pid: int, path: str) -> dict[str, int]:
    """Rss/Pss (bytes) summed over the mappings of ``path`` in /proc/<pid>/smaps."""
    out = {"Rss": 0, "Pss": 0}
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            inside = len(head) >= 6 and head[5] == path
        elif inside and head and head[0].rstrip(":") in out:
            out[head[0].rstrip(":")] += int(head[1]) * 1024
    return out


def _measure(srv: DemoServer) -> dict[str, object]:
    assert srv.weights_file is not None
    path = str(srv.weights_file)
    post_all(srv.url, [{"prompt": "warm up", "max_tokens": 2}] * 8, concurrency=4)
    sampler = ProcessSampler(watch_pids=srv.worker_pids, top_n=0)
    counts = model_process_counts(sampler.sample())
    return {
        "size": srv.weights_file.stat().st_size,
        "anon": {pid: _status_kb(pid, "RssAnon") for pid in srv.worker_pids},
        "rss": {pid: _status_kb(pid, "VmRSS") for pid in srv.worker_pids},
        "file": {pid: _file_mapping(pid, path) for pid in srv.worker_pids},
        "holders": counts.get(path, 0),
    }


def test_per_worker_preload_holds_a_copy_in_each_worker_and_shared_holds_one(tmp_path: Path, wdir: Path) -> None:
    figures = {}
    for mode in ("per-worker", "shared"):
        srv = start_demo(["--preload", mode], workers=4, weights_mb=WEIGHTS_MB, weights_dir=wdir, log_dir=tmp_path)
        try:
            figures[mode] = _measure(srv)
        finally:
            srv.stop()
    private, shared = figures["per-worker"], figures["shared"]
    size = private["size"]
    assert isinstance(size, int) and abs(size - WEIGHTS_MB * MB) < 0.02 * size

    for mode, f in figures.items():
        anon = {pid: round(v / MB, 1) for pid, v in f["anon"].items()}  # type: ignore[attr-defined]
        rss = {pid: round(v / MB, 1) for pid, v in f["rss"].items()}  # type: ignore[attr-defined]
        pss = sum(m["Pss"] for m in f["file"].values()) / MB  # type: ignore[attr-defined]
        print(f"{mode}: RSS {rss} MiB, RssAnon {anon} MiB, checkpoint-mapping PSS summed {pss:.1f} MiB")

    # Both modes: four processes hold the model file, as the process sampler reports it.
    assert private["holders"] == 4
    assert shared["holders"] == 4

    # per-worker: the weights are private anonymous memory in every worker (the mapping is only the header)...
    base_anon = min(shared["anon"].values())  # type: ignore[attr-defined]
    for pid, anon in private["anon"].items():  # type: ignore[attr-defined]
        assert anon - base_anon > 0.85 * size, f"worker {pid} has no private copy"
        assert private["rss"][pid] > size  # type: ignore[index]
        assert private["file"][pid]["Rss"] < 0.05 * size  # type: ignore[index]
    # ...shared: every worker maps all of it, the page cache holds it once: PSS sums to one copy.
    for pid, mapping in shared["file"].items():  # type: ignore[attr-defined]
        assert mapping["Rss"] > 0.95 * size, f"worker {pid} did not touch the shared weights"
        assert shared["anon"][pid] - base_anon < 0.15 * size  # type: ignore[index]
    pss_sum = sum(m["Pss"] for m in shared["file"].values())  # type: ignore[attr-defined]
    assert 0.9 * size < pss_sum < 1.1 * size
