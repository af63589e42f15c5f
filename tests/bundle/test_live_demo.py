"""A bundle taken on a live service: the right verdict, checksums that verify, and no canary anywhere.

The service is the real reference backend (``diag demo serve``) with ONE inference slot, inside a
memory cgroup, its tracker writing RequestTiming/ServiceConfig records into a temp flight recorder;
a real agent (``diag collect``) samples host, cgroup and processes into the same recorder. Load:
one request at a time, then 16 clients at once on the single slot -- a queue backlog (waits of
seconds, inference flat). While the service is still up, ``diag bundle`` runs as its own process
from outside the service's cgroup, over this test's own window (``--since`` = its age): the kernel
log is host-wide, and an earlier test's memcg OOM kill is not part of this incident.

"Inference flat" is the premise, and on a shared 2-core host it is made true rather than hoped
for: the service runs at nice -15, so another process's CPU burst during the load phase cannot
slow its one inference thread (measured: two CPU hogs started with the burst inflated inference
3.9x at nice 0, 1.3x at nice -10), which the rules would rightly read as "the queue is partly a
symptom" and downgrade the verdict.

Canaries, one random hex shared by all so one byte search finds any of them:
- in a tracked process's *environment* (``OPENAI_API_KEY``, ``HF_TOKEN``: values shaped so that no
  text rule would catch them -- only never reading /proc/<pid>/environ keeps them out);
- in its *command line*: a bearer token, an ``--api-key=`` value, credentials in a URL;
- in a *prompt* sent to the service;
- in an ``--include``d config file (``api_key: ...``).
Then every byte of every file of the extracted archive is searched.

The verdict must be ``queue_backlog``, on a quiet host or a shared one: the agent watches the
service's own group (``--cgroup``) as well as its worker, so the rules judge the service's own stall
signals, and a neighbour's host-wide stall (reported in the failure message if the verdict is wrong)
is not the service's. Any other verdict fails the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from collectors.recorder_queries import RecorderReader
from diag.demo.harness import post_all, start_demo
from diag.rules.engine import analyze
from diag.rules.stall_signals import FAULTS_UP, REFAULTS_UP
from diag.sources import load_bundle
from diag.timeline import Timeline
from tests.bundle.helpers import ROOT, all_files, extract, run_bundle, verify_sums
from tests.livecg import memory_cgroup, require_live

pytestmark = pytest.mark.live
MiB = 1 << 20


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _host_disturbance(tl: Timeline) -> str | None:
    """Host-wide memory stall that is not the service's (the thresholds the request rules call a stall)."""
    found = []
    psi = tl.host.get("psi.memory.some.avg10")
    if psi is not None and np.nanmax(psi.values) >= 5.0:
        found.append(f"memory PSI some {np.nanmax(psi.values):.1f} %")
    for prefix, limit in (("vmstat.workingset_refault", REFAULTS_UP), ("vmstat.pgmajfault", FAULTS_UP)):
        # the kernel splits refaults into _anon and _file; the rules add them up
        peak = sum(
            float(np.nanmax(r))
            for name, series in tl.host.items()
            if name.startswith(prefix) and (r := series.rate().values).size
        )
        if peak >= limit:
            found.append(f"{prefix} up to {peak:.0f}/s")
    return ", ".join(found) or None


def _rows(rec: Path, kind: str, since: float | None = None) -> int:
    try:
        with RecorderReader.open(rec, timeout_s=5.0) as reader:
            return reader.count(since=since, kind=kind)
    except sqlite3.Error:  # not created yet, or its schema not written yet
        return 0


def _until(done: Callable[[], bool], what: str, within_s: float = 60.0) -> None:
    """Poll ``done`` until it holds; fail naming ``what`` after ``within_s``."""
    end = time.monotonic() + within_s
    while not done():
        assert time.monotonic() < end, f"not within {within_s:g} s: {what}"
        time.sleep(0.1)


@pytest.mark.slow
def test_bundle_of_a_live_queue_backlog(tmp_path: Path) -> None:
    require_live()
    began = time.monotonic()
    canary = uuid.uuid4().hex
    rec = tmp_path / "recorder.db"
    out = tmp_path / "out"
    out.mkdir()
    include = tmp_path / "service.yaml"
    include.write_text(f"model: demo\nmax_concurrency: 1\napi_key: file{canary}\n")
    prompt = f"prompt{canary} please summarise everything you know"
    with memory_cgroup(1536 * MiB, name="llmdiag-bundle-svc") as group:
        srv = start_demo(
            ["--max-concurrency", "1", "--queue-size", "64", "--queue-timeout", "120", "--request-timeout", "60"],
            weights_mb=16, weights_dir=tmp_path / "weights", log_dir=tmp_path, recorder=rec, cgroup=group, nice=-15,
        )  # fmt: skip
        agent = subprocess.Popen(
            [sys.executable, "-m", "diag.cli", "collect", "--interval", "1s", "--listen", "off", "--recorder", str(rec),
             "--pid", str(srv.worker_pids[0]), "--cgroup", group.path, "--no-gpu"],
            cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        secret = group.spawn(  # in the service's group too: the bundle must see it, and stays outside of it
            [sys.executable, "-c", "import time; time.sleep(600)", "--header", f"Authorization: Bearer bearer{canary}",
             f"--api-key=flag{canary}", f"https://svc:url{canary}@db.example.invalid/x"],
            env={**os.environ, "OPENAI_API_KEY": f"env{canary}", "HF_TOKEN": f"hfenv{canary}"},
        )  # fmt: skip
        try:
            _until(lambda: _rows(rec, "host") >= 3, "three agent samples before the load")
            # Long enough generations (~0.1 s) that inference, not the HTTP round trip, is what a slot holds.
            body = lambda tag, i: {"prompt": f"{tag} {i}: " + "the quick brown fox jumps over the lazy dog " * 6,  # noqa: E731
                                   "max_tokens": 96}  # fmt: skip
            calm = post_all(srv.url, [body("one at a time", i) for i in range(20)], concurrency=1)
            canary_reply = post_all(srv.url, [{"prompt": prompt, "max_tokens": 8}])
            # 16 clients on one slot: waits climb to ~15x the inference time, inference stays flat.
            burst = post_all(srv.url, [body("all at once", i) for i in range(140)], concurrency=16)
            assert {r.status_code for r in calm + canary_reply + burst} == {200}
            # every request written by the tracker's buffered writer, and an agent sample taken after the last one
            done = time.time()
            _until(lambda: _rows(rec, "request") >= 161, "the tracker's 161 request records in the recorder")
            _until(lambda: _rows(rec, "host", since=done) >= 1, "an agent sample after the load")
            age = f"{time.monotonic() - began + 5:.0f}s"
            run = run_bundle(
                "--since", age, "--recorder", str(rec), "--pid", str(srv.worker_pids[0]), "--pid", str(secret.pid),
                "--include", str(include), "--deadline", "60s", out=out,
            )  # fmt: skip
        finally:
            _stop(secret, signal.SIGKILL)
            _stop(agent)
            srv.stop()

    # ---- the verdict, and the same verdict from the bundle alone (what `diag analyze --bundle` does elsewhere)
    findings = run.findings()
    unpacked = extract(run.archive, tmp_path / "unpacked")
    timeline = load_bundle(unpacked)
    queue = next((f for f in findings["findings"] if f["class"] == "queue_backlog"), None)
    assert queue is not None, json.dumps(findings["verdict"])  # the backlog is seen, whatever else happens
    waits = {e["what"]: e["value"] for e in queue["evidence"]}
    assert waits["median queue wait, high-load quartile"] > 10 * max(waits["median queue wait, low-load quartile"], 0.01)
    # The verdict is the backlog, on any host: the service's own group is watched (its PSI, faults and
    # memory are sampled), so another tenant's host-wide stall is not the service's and cannot outweigh it.
    why = f"{json.dumps(findings['verdict'])}; host-wide stall meanwhile: {_host_disturbance(timeline) or 'none'}"
    assert findings["verdict"]["primary"] == "queue_backlog", why
    assert "Verdict: queue_backlog" in run.proc.stdout
    again = analyze(timeline).to_dict()
    assert again["verdict"] == findings["verdict"]
    assert [(f["rule"], round(f["confidence"], 6)) for f in again["findings"]] == [
        (f["rule"], round(f["confidence"], 6)) for f in findings["findings"]
    ]
    cli = subprocess.run([sys.executable, "-m", "diag.cli", "analyze", "--bundle", str(unpacked), "--json"],
                         capture_output=True, text=True, cwd=str(ROOT), timeout=120)  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["verdict"] == findings["verdict"]

    # ---- integrity: SHA256SUMS (our check and sha256sum's), the archive's sidecar
    assert verify_sums(unpacked) > 20
    if shutil.which("sha256sum"):
        check = subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=unpacked, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        side = subprocess.run(["sha256sum", "-c", run.archive.name + ".sha256"], cwd=run.archive.parent, capture_output=True)
        assert side.returncode == 0

    # ---- the manifest says what each collector did
    manifest = run.manifest
    names = {c["name"] for c in manifest["collectors"]}
    assert {"proc.pressure", "proc.meminfo", "proc.vmstat", "snapshot", "cgroup.files", "process.files", "gpu", "kmsg",
            "nvidia-smi", "journal", "history", "include.1", "analysis", "report"} <= names  # fmt: skip
    for c in manifest["collectors"]:
        for key in ("start", "end", "duration_s", "timeout_s", "timeout_hit", "return_code", "bytes", "truncated", "files"):
            assert key in c, (c["name"], key)
        assert all(len(f["sha256"]) == 64 for f in c["files"])
    assert manifest["watched"]["pids"] == [srv.worker_pids[0], secret.pid]
    assert (unpacked / "raw" / "cgroup" / "memory" / group.path.lstrip("/") / "memory.limit_in_bytes").read_text().strip() == str(
        1536 * MiB
    )
    assert not manifest["self_cgroup"]["inside"]  # we ran from outside the service's group
    for kind in ("host", "cgroup", "process", "request", "config"):
        assert (unpacked / "timeline" / f"{kind}.jsonl").stat().st_size > 0, kind

    # ---- the canaries had every chance to leak: the process and the request are in the bundle ...
    procs = [json.loads(line) for line in (unpacked / "timeline" / "process.jsonl").read_text().splitlines()]
    mine = [p for p in procs if p["pid"] == secret.pid]
    assert mine and all("<redacted>" in p["cmdline"] for p in mine)
    assert (unpacked / "raw" / "proc" / str(secret.pid) / "status").is_file()
    requests = [json.loads(line) for line in (unpacked / "timeline" / "request.jsonl").read_text().splitlines()]
    assert len(requests) >= 161
    assert any(r["prompt_tokens"] == len(prompt.encode()) + 1 for r in requests)  # the canary request, as a count
    assert "<redacted>" in next((unpacked / "raw" / "include").iterdir()).read_text()
    assert json.loads((unpacked / "redaction.json").read_text())["rules"].get("key_value", 0) >= 1
    # ... and appear in no byte of any file (nor in the folder left on disk)
    needle = canary.encode()
    files = all_files(unpacked)
    assert len(files) > 20
    leaks = [str(p.relative_to(unpacked)) for p in files if needle in p.read_bytes()]
    leaks += [str(p) for p in all_files(run.root) if needle in p.read_bytes()]
    assert not leaks, f"canary found in {leaks}"
