"""Bundle archives given to ``diag analyze --bundle``: read in place, never extracted; hostile ones refused clearly.

Archives are built by the test with ``tarfile`` (what an attacker or a broken copy would hand over): ``..`` and
absolute member names, symlinks, hardlinks, device nodes and FIFOs, decompression bombs (a huge declared size,
many members), truncated and garbled streams. Wanted every time: one ``ValueError`` naming the archive and
the reason (``diag analyze`` prints it as one line and exits 2), or the records; never a traceback, a hang, or a
file written anywhere.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collectors.records import HostSnapshot
from diag.sources import load_bundle
from diag.sources.archive import BundleArchiveError, read_timeline

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _host_lines(n: int, t0: float = 1_764_590_400.0) -> list[str]:
    return [HostSnapshot(ts=t0 + i, memory={"total": 8 << 30, "available": (4 << 30) - i}).to_json() for i in range(n)]


def _bundle_folder(root: Path, n: int = 30) -> Path:
    folder = root / "llm-diag-bundle-x"
    (folder / "timeline").mkdir(parents=True)
    (folder / "timeline" / "host.jsonl").write_text("\n".join(_host_lines(n)) + "\n", encoding="utf-8")
    (folder / "report.md").write_text("# report\n", encoding="utf-8")
    return folder


def _add(tar: tarfile.TarFile, name: str, data: bytes = b"", **kw: object) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for key, value in kw.items():
        setattr(info, key, value)
    tar.addfile(info, io.BytesIO(data) if info.isfile() else None)


def _archive(path: Path, members: list[tuple[str, bytes, dict]], mode: str = "w:gz") -> Path:
    with tarfile.open(path, mode) as tar:
        for name, data, kw in members:
            _add(tar, name, data, **kw)
    return path


def _snapshot(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


GOOD = ("b/timeline/host.jsonl", ("\n".join(_host_lines(5)) + "\n").encode(), {})


def test_archive_reads_as_the_folder_does(tmp_path: Path) -> None:
    folder = _bundle_folder(tmp_path)
    with tarfile.open(tmp_path / "b.tar.gz", "w:gz") as tar:
        tar.add(folder, arcname=folder.name)
    before = _snapshot(tmp_path)
    from_folder, from_archive = load_bundle(folder), load_bundle(tmp_path / "b.tar.gz")
    assert _snapshot(tmp_path) == before  # nothing extracted
    assert from_archive.counts == from_folder.counts == {"host": 30}
    for key in ("memory.total", "memory.available"):
        assert np.array_equal(from_archive.host[key].values, from_folder.host[key].values)
        assert np.array_equal(from_archive.host[key].ts, from_folder.host[key].ts)


def test_plain_tar_and_long_lines_across_chunks(tmp_path: Path) -> None:
    long = HostSnapshot(ts=1.0, memory={"total": 1}, missing={"vmstat": "x" * (3 << 20)}).to_json()
    body = ("\n".join([*_host_lines(3), long, *_host_lines(2, t0=10.0)])).encode()  # no final newline
    archive = _archive(tmp_path / "b.tar", [("timeline/host.jsonl", body, {})], mode="w")
    tl = load_bundle(archive)
    assert tl.counts == {"host": 6}


HOSTILE = [
    ("../timeline/host.jsonl", {}, "escapes the bundle"),
    ("b/../../etc/timeline/host.jsonl", {}, "escapes the bundle"),
    ("/etc/timeline/host.jsonl", {}, "absolute path"),
    ("b/timeline/link.jsonl", {"type": tarfile.SYMTYPE, "linkname": "/etc/passwd"}, "symbolic link"),
    ("b/timeline/hard.jsonl", {"type": tarfile.LNKTYPE, "linkname": "/etc/shadow"}, "hard link"),
    ("b/dev/sda", {"type": tarfile.BLKTYPE, "devmajor": 8, "devminor": 0}, "device or FIFO"),
    ("b/dev/null", {"type": tarfile.CHRTYPE, "devmajor": 1, "devminor": 3}, "device or FIFO"),
    ("b/fifo", {"type": tarfile.FIFOTYPE}, "device or FIFO"),
]


@pytest.mark.parametrize(("name", "kw", "reason"), HOSTILE)
@pytest.mark.parametrize("first", [True, False])
def test_hostile_members_are_refused_by_name(tmp_path: Path, name: str, kw: dict, reason: str, first: bool) -> None:
    bad = (name, b"{}\n" if not kw else b"", kw)
    archive = _archive(tmp_path / "b.tar.gz", [bad, GOOD] if first else [GOOD, bad])
    before = _snapshot(tmp_path)
    with pytest.raises(BundleArchiveError, match=reason) as err:
        load_bundle(archive)
    assert name in str(err.value) and str(archive) in str(err.value)
    assert _snapshot(tmp_path) == before
    assert not Path("/etc/timeline").exists()


def test_a_declared_size_bomb_is_refused_before_its_data_is_read(tmp_path: Path) -> None:
    # A header claiming 64 GiB with no data behind it: refused from the header alone, at once.
    info = tarfile.TarInfo("b/timeline/host.jsonl")
    info.size = 64 << 30
    archive = tmp_path / "bomb.tar.gz"
    archive.write_bytes(gzip.compress(info.tobuf(format=tarfile.GNU_FORMAT)))
    with pytest.raises(BundleArchiveError, match="decompression bomb"):
        load_bundle(archive)


def test_an_inflating_bomb_is_refused_at_the_bound(tmp_path: Path) -> None:
    # 64 MiB of newlines compresses to ~64 KiB; with a 16 MiB bound it is refused, not read to the end.
    archive = _archive(tmp_path / "bomb.tar.gz", [("b/timeline/host.jsonl", b"\n" * (64 << 20), {})])
    assert archive.stat().st_size < 1 << 20
    with pytest.raises(BundleArchiveError, match="decompression bomb"):
        list(read_timeline(archive, max_bytes=16 << 20))


def test_too_many_members_is_refused(tmp_path: Path) -> None:
    archive = _archive(tmp_path / "many.tar.gz", [GOOD, *((f"b/empty/{i}", b"", {}) for i in range(300))])
    with pytest.raises(BundleArchiveError, match="more than 100 members"):
        list(read_timeline(archive, max_members=100))


def test_an_archive_without_records_is_not_a_bundle(tmp_path: Path) -> None:
    archive = _archive(tmp_path / "x.tar.gz", [("b/report.md", b"# hi\n", {}), ("b/timeline/", b"", {"type": tarfile.DIRTYPE})])
    with pytest.raises(BundleArchiveError, match="not an llm-diag bundle"):
        load_bundle(archive)


@pytest.mark.parametrize("extra", [b"", b"\x05", b"\x05\x00ab"])
def test_an_archive_cut_inside_its_gzip_extra_field_is_a_clear_error(tmp_path: Path, extra: bytes) -> None:
    """The gzip header's FEXTRA flag set and the file ending before (or inside) the field: Python's tarfile raised
    TypeError from ``ord(b"")`` there (found by the property test below)."""
    path = tmp_path / "cut.tar.gz"
    path.write_bytes(b"\x1f\x8b\x08\x04" + b"\x00" * 6 + extra)
    with pytest.raises(BundleArchiveError) as caught:
        load_bundle(path)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


@SETTINGS
@given(data=st.binary(max_size=4096), cut=st.integers(0, 100_000), flips=st.lists(st.integers(0, 100_000), max_size=6))
def test_garbled_or_truncated_archives_give_a_clear_error_or_records(
    tmp_path_factory, data: bytes, cut: int, flips: list[int]
) -> None:
    tmp = tmp_path_factory.mktemp("garbled")
    good = _archive(tmp / "good.tar.gz", [GOOD, ("b/report.md", data, {})]).read_bytes()
    raw = bytearray(good[: cut % (len(good) + 1)])
    for pos in flips:
        if raw:
            raw[pos % len(raw)] ^= 0xFF
    for blob in (bytes(raw), data):
        path = tmp / "in.tar.gz"
        path.write_bytes(blob)
        before = _snapshot(tmp)
        try:
            tl = load_bundle(path)
        except BundleArchiveError as exc:
            assert str(path) in str(exc) and "\n" not in str(exc)
        else:
            assert tl.counts.get("host", 0) <= 5
        assert _snapshot(tmp) == before


@SETTINGS
@given(
    rows=st.lists(
        st.one_of(
            st.binary(max_size=200),
            st.recursive(st.none() | st.integers() | st.text(max_size=20), lambda c: st.lists(c, max_size=3), max_leaves=8).map(
                lambda v: json.dumps(v).encode()
            ),
            st.integers(1, 400).map(lambda depth: b"[" * depth + b"]" * depth),
            st.just(b'{"kind": "host", "ts": 1e400, "memory": {"total": 99999999999999999999999999}}'),
            st.just(b"\x00\x00\x00"),
        ),
        max_size=20,
    ),
    kind=st.sampled_from(["host", "cgroup", "process", "request", "gpu", "oom", "unknown_kind"]),
)
def test_bad_record_rows_are_counted_never_fatal(tmp_path_factory, rows: list[bytes], kind: str) -> None:
    tmp = tmp_path_factory.mktemp("rows")
    body = b"\n".join([*(line.encode() for line in _host_lines(3)), *rows]) if kind == "host" else b"\n".join(rows)
    archive = _archive(tmp / "b.tar.gz", [GOOD, (f"b/timeline/{kind}.jsonl", body, {})])
    tl = load_bundle(archive)
    assert tl.counts.get("host", 0) >= 5


@pytest.mark.process
def test_diag_analyze_refuses_a_hostile_archive_in_one_line(tmp_path: Path) -> None:
    archive = _archive(tmp_path / "b.tar.gz", [GOOD, ("../../evil", b"x", {})])
    diag = Path(sys.executable).with_name("diag")
    proc = subprocess.run([str(diag), "analyze", "--bundle", str(archive)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, "NO_COLOR": "1"})  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "escapes the bundle" in proc.stderr and "../../evil" in proc.stderr
    assert not (tmp_path.parent / "evil").exists()


@pytest.mark.process
def test_diag_analyze_reads_a_real_archive(tmp_path: Path) -> None:
    folder = _bundle_folder(tmp_path, n=120)
    with tarfile.open(tmp_path / "b.tar.gz", "w:gz") as tar:
        tar.add(folder, arcname=folder.name)
    diag = Path(sys.executable).with_name("diag")
    out = subprocess.run([str(diag), "analyze", "--bundle", str(tmp_path / "b.tar.gz"), "--json"], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "verdict" in json.loads(out.stdout)


@pytest.mark.parametrize("kind", ["host", "cgroup", "process", "request", "oom", "unknown_kind"])
def test_rows_nested_thousands_deep_are_skipped_not_fatal(tmp_path: Path, kind: str) -> None:
    deep = [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000]
    archive = _archive(tmp_path / "b.tar.gz", [GOOD, (f"b/timeline/{kind}.jsonl", b"\n".join(deep), {})])
    tl = load_bundle(archive)
    assert tl.counts.get("host") == 5
    assert sum(tl.skipped.values()) == 2
