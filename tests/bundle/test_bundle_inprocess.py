"""take_bundle in-process on recorded history: the bundle's own words trip no redaction rule, the
command line is scrubbed, the folder reads back to the same verdict, and the manifest is complete."""

from __future__ import annotations

import json
import os
import tarfile
import time
from pathlib import Path

import pytest

from diag.bundle import BundleOptions, take_bundle
from diag.rules.engine import analyze
from diag.sources import load_bundle
from tests.bundle.helpers import all_files, verify_sums, write_history

pytestmark = pytest.mark.process

AUTHORED = ("report.md", "report.html", "findings.json", "log.txt", "redaction.json")


def test_bundle_of_recorded_history(tmp_path: Path) -> None:
    rec = tmp_path / "recorder.db"
    write_history(rec, end=time.time(), seconds=240)
    argv = ("diag", "bundle", "--recorder", str(rec), "--api-key", "clisecretvalue", "--token=clitoken123")
    blob = tmp_path / "core.bin"
    blob.write_bytes(b"ELF\x00\x01binsecret\x00" * 100)
    options = BundleOptions(out_dir=tmp_path, since_s=600, recorder=rec, deadline_s=60, tar=True, gpu=False,
                            cgroups=("/system.slice/llm.service",), argv=argv, includes=(str(blob),))  # fmt: skip
    lines: list[str] = []
    result = take_bundle(options, lines.append)
    root = result.root
    manifest = json.loads((root / "manifest.json").read_text())

    # the command line is in the manifest, scrubbed; no copy of the secret anywhere (log included)
    assert manifest["command"].startswith("diag bundle --recorder ")
    assert "<redacted>" in manifest["command"]
    for f in all_files(root):
        data = f.read_bytes()
        assert b"clisecretvalue" not in data and b"clitoken123" not in data and b"binsecret" not in data, f
    # what the bundle writes itself trips no rule (a report saying 'key_value: 1' would be masked, and JSON broken)
    redaction = json.loads((root / "redaction.json").read_text())
    assert not set(AUTHORED) & set(redaction["per_file"]), redaction["per_file"]
    # a binary file is listed as dropped, not copied (the text rules cannot vouch for it)
    assert [d["what"] for d in redaction["dropped"]["files"]] == ["raw/include/1-core.bin"]
    assert not (root / "raw" / "include").exists()
    for name in ("findings.json", "redaction.json", "manifest.json"):
        json.loads((root / name).read_text())

    # the history arrived whole, and the folder alone gives the verdict findings.json holds
    counts = manifest["timeline"]
    assert counts["request"] > 300 and counts["host"] >= 240 and counts["config"] == 1
    findings = json.loads((root / "findings.json").read_text())
    assert findings["verdict"]["primary"] == result.verdict == "queue_backlog"
    assert analyze(load_bundle(root)).to_dict()["verdict"] == findings["verdict"]
    assert verify_sums(root) == len(manifest["files"]) + 1  # every file but SHA256SUMS and manifest.json, + manifest
    assert result.archive is not None and result.archive.with_name(result.archive.name + ".sha256").is_file()
    # the archive (begun with the timeline while the analysis ran) holds the folder exactly, byte for byte
    with tarfile.open(result.archive) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert set(members) == {root.name} | {f"{root.name}/{p.relative_to(root).as_posix()}" for p in root.rglob("*")}
        for name, member in members.items():
            if member.isfile():
                assert tar.extractfile(member).read() == (root.parent / name).read_bytes(), name
            assert member.uname == member.gname == "" and member.uid == member.gid == 0
    assert not list(tmp_path.glob("*.partial"))
    # the manifest accounts for every file, per collector
    listed = {f["path"] for c in manifest["collectors"] for f in c["files"]}
    assert {"raw/proc/meminfo", "raw/proc/vmstat", "raw/proc/pressure/memory", "timeline/request.jsonl"} <= listed
    history = next(c for c in manifest["collectors"] if c["name"] == "history")
    assert history["status"] == "ok" and history["records"] == 0 and history["notes"]["rows"] > 1000
    assert any("history: ok" in line for line in lines)


def test_history_over_its_cap_keeps_the_newest_records(tmp_path: Path) -> None:
    rec = tmp_path / "recorder.db"
    end = time.time()
    write_history(rec, end=end, seconds=300, queue=False)
    options = BundleOptions(out_dir=tmp_path, since_s=600, recorder=rec, deadline_s=60, tar=False, gpu=False,
                            cgroups=("/system.slice/llm.service",), history_cap=200_000)  # fmt: skip
    root = take_bundle(options, None).root
    history = next(c for c in json.loads((root / "manifest.json").read_text())["collectors"] if c["name"] == "history")
    assert history["truncated"] and history["notes"]["rows_left_out"] > 0
    assert "oldest" in history["reason"]
    hosts = [json.loads(line)["ts"] for line in (root / "timeline" / "host.jsonl").read_text().splitlines()]
    assert max(hosts) >= end - 2  # the newest samples are there (plus the live one taken now)
    assert min(hosts) > end - 300 + 30  # the oldest were left out
    assert sum(f.stat().st_size for f in (root / "timeline").glob("*.jsonl")) < 400_000


def test_journal_lines_are_copied_through_the_redactor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No systemd runs here, so journalctl is a stand-in on PATH that prints what a unit's journal would hold
    # (and its argv, to check what we asked for). The collector also needs a journal directory to exist.
    if not any(os.path.isdir(p) for p in ("/run/systemd/system", "/run/log/journal", "/var/log/journal")):
        pytest.skip("no journal directory on this host: the collector skips the journal (tested by its reason)")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "journalctl").write_text(
        "#!/bin/sh\n"
        'echo "argv: $*"\n'
        'echo "2026-11-30T12:00:01+0000 host vllm[42]: connecting to postgres://svc:jsecret99@db/main"\n'
        'echo "2026-11-30T12:00:02+0000 host vllm[42]: request headers Authorization: Bearer jbearertoken99"\n'
    )
    (bin_dir / "journalctl").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    options = BundleOptions(out_dir=tmp_path, since_s=600, recorder=tmp_path / "none.db", deadline_s=60, tar=False,
                            gpu=False, unit="vllm.service")  # fmt: skip
    root = take_bundle(options, None).root
    text = (root / "raw" / "journal.txt").read_text()
    assert "-u vllm.service" in text and "--since=@" in text and "--no-pager" in text
    assert "jsecret99" not in text and "jbearertoken99" not in text and text.count("<redacted>") == 2
    counts = json.loads((root / "redaction.json").read_text())["per_file"]["raw/journal.txt"]
    assert counts == {"url_credentials": 1, "bearer": 1}
