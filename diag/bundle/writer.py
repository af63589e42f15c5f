"""Writing the bundle: every file through the redactor, then hashed; SHA256SUMS; the .tar.gz and its sidecar.

Why this order (redact -> write -> hash): the checksums must describe what is actually shared, and
sos learned the hard way that a checksum taken before cleaning describes a file nobody receives.
``SHA256SUMS`` is in ``sha256sum -c`` format so the receiver needs no tool of ours to verify it;
the archive gets a ``.sha256`` sidecar next to it (inside the archive it could not hash itself).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collectors.redact import REDACTED
from diag.bundle.redactor import Mask, Redactor

SUMS = "SHA256SUMS"
_HTML_MASK = "&lt;redacted&gt;"  # the mask as an autoescaping template writes it


@dataclass
class FileEntry:
    path: str  # relative to the bundle root, "/"-separated
    bytes: int = 0
    sha256: str = ""
    truncated: bool = False
    source: str | None = None
    collector: str | None = None


def _safe_rel(rel: str) -> str:
    """A relative path that stays inside the bundle (no absolute parts, no '..')."""
    parts = [p for p in rel.replace("\\", "/").split("/") if p not in ("", ".", "..")]
    if not parts:
        raise ValueError(f"empty bundle path {rel!r}")
    return "/".join(parts)


class BundleWriter:
    def __init__(self, root: Path, redactor: Redactor) -> None:
        self.root = root
        self.redactor = redactor
        self.files: dict[str, FileEntry] = {}
        root.mkdir(parents=True, exist_ok=False)

    def _target(self, rel: str) -> tuple[str, Path]:
        # A path can carry a cgroup or file name from the host: it goes through the redactor too.
        rel = _safe_rel(self.redactor.text(_safe_rel(rel), "(file names)"))
        target = self.root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        return rel, target

    def write_text(self, rel: str, text: str, *, truncated: bool = False, source: str | None = None,
                   collector: str | None = None, html: bool = False, masks: Sequence[Mask] = ()) -> FileEntry:  # fmt: skip
        """Free text through the plugin's own ``masks``, then every text rule. ``html``: a mask the pass inserts
        is escaped (``<redacted>`` would otherwise be read as a tag and vanish from the page)."""
        rel, target = self._target(rel)
        if html:  # the rules know their own mask only unescaped ("--api-key &lt;redacted&gt;" would be masked again)
            text = text.replace(_HTML_MASK, REDACTED)
        clean = self.redactor.text(text, rel, masks)
        if html:
            clean = clean.replace(REDACTED, _HTML_MASK)
        data = clean.encode("utf-8")
        target.write_bytes(data)
        digest = hashlib.sha256(data).hexdigest()
        entry = FileEntry(rel, len(data), digest, truncated, self.redactor.text(source, rel) if source else None, collector)
        self.files[rel] = entry
        return entry

    def write_json(self, rel: str, doc: Any, *, collector: str | None = None) -> FileEntry:
        rel, target = self._target(rel)
        # Field by field (every string value and key through every text rule, secret-named fields masked,
        # prompt fields dropped). No text pass over the JSON on top: a rule reading '"key_value": 1' as a
        # secret setting would corrupt the document, and every string in it has already been through the rules.
        clean = self.redactor.value(doc, rel)
        data = (json.dumps(clean, indent=2, allow_nan=False, default=str, ensure_ascii=False) + "\n").encode("utf-8")
        target.write_bytes(data)
        entry = FileEntry(rel, len(data), hashlib.sha256(data).hexdigest(), False, None, collector)
        self.files[rel] = entry
        return entry

    def append_lines(self, rel: str, lines: list[str], *, collector: str | None = None) -> FileEntry:
        """Append already-redacted JSONL lines (timeline records, redacted per field by the caller)."""
        rel, target = self._target(rel)
        with open(target, "a", encoding="utf-8") as fh:
            for line in lines:
                fh.write(line)
                fh.write("\n")
        entry = self.files.get(rel) or FileEntry(rel, collector=collector)
        entry.sha256 = ""  # changed: hash again
        self.files[rel] = entry
        return entry

    def adopt(self, rel: str, staged: Path, *, truncated: bool = False, collector: str | None = None) -> FileEntry:
        """Move a file a collector staged (already redacted per record) into the bundle."""
        rel, target = self._target(rel)
        if target.exists():  # something appended first: keep both, staged (older) lines first
            with open(staged, "a", encoding="utf-8") as out, open(target, encoding="utf-8") as extra:
                shutil.copyfileobj(extra, out)
        os.replace(staged, target)
        entry = FileEntry(rel, truncated=truncated, collector=collector)
        self.files[rel] = entry
        return entry

    def hash_all(self) -> None:
        """Hash what was streamed or appended (text files were hashed as they were written)."""
        for entry in self.files.values():
            if not entry.sha256:
                entry.sha256, entry.bytes = sha256_file(self.root / entry.path)

    def write_sums(self) -> Path:
        """``SHA256SUMS`` over every file in the folder except itself (sha256sum -c format, sorted)."""
        self.hash_all()
        lines = []
        for path in sorted(p for p in self.root.rglob("*") if p.is_file() and p.name != SUMS):
            rel = path.relative_to(self.root).as_posix()
            entry = self.files.get(rel)
            digest = entry.sha256 if entry is not None else sha256_file(path)[0]
            lines.append(f"{digest}  {rel}\n")
        target = self.root / SUMS
        target.write_text("".join(lines), encoding="utf-8")
        return target


def sha256_file(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _scrub(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _sidecar(archive: Path) -> Path:
    digest, _ = sha256_file(archive)
    sidecar = archive.with_name(archive.name + ".sha256")
    sidecar.write_text(f"{digest}  {archive.name}\n", encoding="utf-8")
    return sidecar


class EarlyArchive:
    """``<root>.tar.gz`` begun early: files that are final already (the timeline: most of the bytes) are hashed
    and compressed in a background thread while the analysis and the report run -- hashlib and zlib let go of
    the GIL, so on a host with a core to spare that time is hidden -- and everything else is added at the end,
    in ``tar.add``'s order (sorted, depth first), owner names stripped, a ``.sha256`` sidecar beside it.
    It is written as ``<name>.tar.gz.partial`` and renamed when complete: an archive under its final name is whole.
    """

    def __init__(self, writer: BundleWriter, compresslevel: int) -> None:
        self.writer = writer
        self.root = writer.root
        self.path = self.root.with_name(self.root.name + ".tar.gz")
        self._partial = self.path.with_name(self.path.name + ".partial")
        self._tar = tarfile.open(self._partial, "w:gz", compresslevel=compresslevel)  # noqa: SIM115 - closed in finish
        self._added: set[str] = set()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def begin(self, prefix: str) -> None:
        """Hash and archive, in the background, the files written so far under ``prefix`` (final from now on)."""
        entries = sorted((e for e in self.writer.files.values() if e.path.startswith(prefix)), key=lambda e: e.path)
        self._thread = threading.Thread(target=self._early, args=(entries,), name="bundle-archive", daemon=True)
        self._thread.start()

    def _early(self, entries: list[FileEntry]) -> None:
        try:
            self._add_dir(self.root, recursive=False)
            for entry in entries:
                path = self.root / entry.path
                for parent in reversed(path.relative_to(self.root).parents[:-1]):
                    self._add_dir(self.root / parent, recursive=False)
                if not entry.sha256:
                    entry.sha256, entry.bytes = sha256_file(path)
                self._add_file(path)
        except BaseException as exc:  # reported by finish()
            self._error = exc

    def wait(self) -> None:
        """Until the background part is done (its files are hashed then)."""
        if self._thread is not None:
            self._thread.join()

    def _arcname(self, path: Path) -> str:
        return self.root.name if path == self.root else f"{self.root.name}/{path.relative_to(self.root).as_posix()}"

    def _add_dir(self, path: Path, recursive: bool) -> None:
        name = self._arcname(path)
        if name not in self._added:
            self._added.add(name)
            self._tar.add(path, arcname=name, recursive=False, filter=_scrub)
        if recursive:
            for child in sorted(os.listdir(path)):
                full = path / child
                if full.is_dir() and not full.is_symlink():
                    self._add_dir(full, recursive=True)
                else:
                    self._add_file(full)

    def _add_file(self, path: Path) -> None:
        name = self._arcname(path)
        if name not in self._added:
            self._added.add(name)
            self._tar.add(path, arcname=name, recursive=False, filter=_scrub)

    def finish(self) -> tuple[Path, Path]:
        """Everything not archived yet, then the archive closed, in place, with its ``.sha256`` sidecar."""
        self.wait()
        try:
            if self._error is not None:
                raise self._error
            self._add_dir(self.root, recursive=True)
        finally:
            self._tar.close()
        os.replace(self._partial, self.path)
        return self.path, _sidecar(self.path)
