"""Reading a bundle *archive* (``.tar.gz``, ``.tar``) given to ``diag analyze --bundle``, without extracting it.

Why a module of its own: an archive comes from someone else's machine (a ticket attachment, a vendor), so it is
untrusted input. Extracting it would let a member named ``../../etc/cron.d/x``, an absolute path, a symlink or
hardlink pointing elsewhere, or a device node write or read outside the target folder, and a decompression
bomb (a few KiB that inflate to many GiB, or millions of empty members) exhaust the disk or memory. So nothing
is extracted: members are read in one streaming pass, only the records we load are kept (``timeline/*.jsonl``
at the archive's top or one folder down), and the archive is refused, with one clear sentence naming the
member and the rule, when

* a member's name is absolute or has a ``..`` part (a path escaping the bundle),
* a member is a symlink, a hardlink, a device or a FIFO (a bundle only holds regular files and folders),
* it has more than ``max_members`` members, or its members inflate past ``max_bytes`` in total (checked
  against each header's declared size before its data is read, and again on the bytes actually read),
* it is not a tar archive, or it is truncated or corrupt.
"""

from __future__ import annotations

import tarfile
import zlib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

MAX_MEMBERS = 20_000
MAX_BYTES = 2 << 30  # 2 GiB of records: far beyond a real bundle (hours at 1 Hz are tens of MiB)
READ_CHUNK = 1 << 20


class BundleArchiveError(ValueError):
    """The archive cannot be read as a bundle; the message names the archive, the member and the reason."""


def is_archive(path: Path) -> bool:
    """True for a regular file (a bundle folder is read as it is)."""
    return path.is_file()


def _timeline_stem(name: str) -> str | None:
    """``timeline/<kind>.jsonl`` at the top or one folder down -> ``<kind>``; anything else -> None."""
    parts = PurePosixPath(name).parts
    if len(parts) in (2, 3) and parts[-2] == "timeline" and parts[-1].endswith(".jsonl") and len(parts[-1]) > 6:
        return parts[-1][: -len(".jsonl")]
    return None


def _check_member(archive: Path, member: tarfile.TarInfo) -> None:
    name = member.name
    if "\x00" in name:
        raise BundleArchiveError(f"{archive}: refused: member name holds a NUL byte ({name!r})")
    if name.startswith("/") or PurePosixPath(name).is_absolute():
        raise BundleArchiveError(f"{archive}: refused: member {name!r} has an absolute path")
    if ".." in PurePosixPath(name).parts:
        raise BundleArchiveError(f"{archive}: refused: member {name!r} escapes the bundle with '..'")
    if member.issym() or member.islnk():
        raise BundleArchiveError(
            f"{archive}: refused: member {name!r} is a {'symbolic' if member.issym() else 'hard'} link "
            f"(to {member.linkname!r}); a bundle holds regular files only"
        )
    if member.isdev():
        raise BundleArchiveError(f"{archive}: refused: member {name!r} is a device or FIFO; a bundle holds regular files only")
    if not (member.isfile() or member.isdir()):
        raise BundleArchiveError(f"{archive}: refused: member {name!r} is not a regular file or folder")


def _open_stream(archive: Path) -> tarfile.TarFile:
    """``tarfile.open(mode="r|*")``, with one more way a cut archive fails turned into ``tarfile.ReadError``.

    CPython's streaming gzip reader calls ``ord()`` on a byte it could not read when the file ends inside the gzip
    header's FEXTRA field, so a truncated archive raises ``TypeError`` there. Caught only around the open: inside the
    reading loop a TypeError would be a bug of ours, not the archive's.
    """
    try:
        return tarfile.open(archive, mode="r|*")
    except TypeError as exc:
        raise tarfile.ReadError(f"gzip header cut short ({exc})") from None


def read_timeline(
    archive: Path,
    *,
    max_members: int = MAX_MEMBERS,
    max_bytes: int = MAX_BYTES,
    batch_rows: int = 20_000,
    batch_bytes: int = 8 << 20,
) -> Iterator[tuple[str, list[str]]]:
    """Yield ``(kind, lines)`` batches of the records under ``timeline/`` in ``archive``, in member order.

    Raises ``BundleArchiveError`` (a ``ValueError``) on anything listed in the module docstring; batches already
    yielded stay valid (the caller builds nothing until the pass ends)."""
    archive = Path(archive)
    members = 0
    total = 0
    found = False
    try:
        with _open_stream(archive) as tar:
            for member in tar:
                members += 1
                if members > max_members:
                    raise BundleArchiveError(
                        f"{archive}: refused: more than {max_members} members (a bundle has a few dozen; "
                        "this looks like an archive bomb)"
                    )
                _check_member(archive, member)
                if member.isdir():
                    continue
                if total + member.size > max_bytes:
                    raise BundleArchiveError(
                        f"{archive}: refused: members inflate past {max_bytes} bytes (at {member.name!r}); "
                        "this looks like a decompression bomb"
                    )
                total += member.size
                stem = _timeline_stem(member.name)
                if stem is None:
                    continue  # reports, raw copies, SHA256SUMS: not records
                found = True
                fh = tar.extractfile(member)
                if fh is None:
                    continue
                yield from _lines(fh, stem, archive, member.name, member.size, batch_rows, batch_bytes)
    except BundleArchiveError:
        raise
    except (tarfile.TarError, EOFError, zlib.error, OSError, ValueError) as exc:
        what = "not a tar archive" if members == 0 else f"truncated or corrupt after {members} member(s)"
        raise BundleArchiveError(f"{archive}: cannot read as a bundle archive: {what} ({exc})") from None
    if not found:
        raise BundleArchiveError(f"{archive} is not an llm-diag bundle (no timeline/*.jsonl inside the archive)")


def _lines(
    fh: object, stem: str, archive: Path, name: str, declared: int, batch_rows: int, batch_bytes: int
) -> Iterator[tuple[str, list[str]]]:
    """Lines of one member, read in chunks; never more bytes than its header declared."""
    read = 0
    pending: list[bytes] = []  # the start of a line longer than a chunk (joined once, never re-copied)
    batch: list[str] = []
    size = 0
    while True:
        chunk = fh.read(READ_CHUNK)  # type: ignore[attr-defined]
        if not chunk:
            break
        read += len(chunk)
        if read > declared:
            raise BundleArchiveError(f"{archive}: refused: member {name!r} holds more than its declared {declared} bytes")
        cut = chunk.rfind(b"\n")
        if cut == -1:
            pending.append(chunk)
            continue
        pieces = b"".join([*pending, chunk[: cut + 1]]).split(b"\n")
        pieces.pop()  # the empty piece after the last newline
        pending = [chunk[cut + 1 :]]
        for raw in pieces:
            line = raw.decode("utf-8", errors="replace").strip()
            if line:
                batch.append(line)
                size += len(line)
                if size >= batch_bytes or len(batch) >= batch_rows:
                    yield stem, batch
                    batch, size = [], 0
    tail = b"".join(pending).decode("utf-8", errors="replace").strip()
    if tail:
        batch.append(tail)
    if batch:
        yield stem, batch
