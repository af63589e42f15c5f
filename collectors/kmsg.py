"""Kernel OOM kills from /dev/kmsg: pure parsers, a two-line assembler, and a non-blocking watcher.

Why /dev/kmsg: it is the only place the kernel says *which* process it killed, in *which* cgroup, and
whether a cgroup limit (``CONSTRAINT_MEMCG``) or the whole host ran out -- memory.events only counts.
cAdvisor parses the same lines (``utils/oomparser``).

Record format (Documentation/ABI/testing/dev-kmsg): ``prio,seq,usec,flags[,more];message`` then
optional continuation lines that start with a space (``KEY=VALUE``; ignored here). One OOM kill prints
(besides the stack and task dump):

  ``oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,oom_memcg=/a/b,task_memcg=/a/b,task=python,pid=11092,uid=0``
  ``Memory cgroup out of memory: Killed process 11092 (python) total-vm:221188kB, anon-rss:204288kB, ...``

(``Out of memory: Killed process ...`` for a host-wide OOM; ``global_oom`` replaces ``oom_memcg=`` there.)
Before them a memcg OOM prints the group's stats (``Memory cgroup stats for /a/b:``, then one ``key value`` per
record, or escaped newlines in one record); only ``unevictable`` (``total_unevictable`` on v1) is kept and put
on the kill of that group: memory reclaim could not free (mlock'd pages), the reason a group with file pages
still ran out.
The assembler joins the two by pid into one ``OomEvent``. Either line alone still yields an event:
the kernel rate-limits the header (and with it the ``oom-kill:`` line) in OOM storms, so later kills
print only ``Killed process``, and a ``Killed process`` line may be lost to ring-buffer overwrite.

Time: the record stamp is printk's ``local_clock()`` (sched_clock), which, like CLOCK_MONOTONIC and
unlike CLOCK_BOOTTIME, does not advance while the machine is suspended. So wall time =
``time.time() - time.monotonic() + usec/1e6`` (the same conversion journald uses for kernel messages);
using BOOTTIME would shift every event by the total time spent suspended.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from collectors.records import OomEvent

MAX_RECORDS_PER_POLL = 20000  # bounds one poll's CPU even if the ring buffer is flooding
READ_BUFFER = 16384  # one /dev/kmsg record per read; the kernel caps a record at 8 KiB
PAIR_WINDOW_RECORDS = 200
PAIR_WINDOW_S = 2.0


@dataclass(frozen=True)
class KmsgRecord:
    """One /dev/kmsg record (continuation lines dropped). ``priority`` is the syslog prefix (facility*8+level)."""

    priority: int
    seq: int
    usec: int
    flags: str
    message: str


def parse_kmsg_record(line: str) -> KmsgRecord | None:
    """Parse ``prio,seq,usec,flags[,...];message``; None for a continuation line or garbage."""
    if not isinstance(line, str) or not line or line[0] in " \t":
        return None
    header, sep, message = line.partition(";")
    if not sep:
        return None
    fields = header.split(",")
    if len(fields) < 4:
        return None
    numbers = []
    for token in fields[:3]:
        if not (0 < len(token) <= 20 and token.isascii() and token.isdigit()):
            return None
        numbers.append(int(token))
    return KmsgRecord(priority=numbers[0], seq=numbers[1], usec=numbers[2], flags=fields[3], message=message.rstrip("\n"))


def parse_kmsg_chunk(data: bytes | str) -> list[KmsgRecord]:
    """All records in a read: one per read on /dev/kmsg, many when a regular file stands in for it."""
    text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
    records = []
    for line in text.split("\n"):
        record = parse_kmsg_record(line)
        if record is not None:
            records.append(record)
    return records


# --------------------------------------------------------------------------- the two OOM lines

# The kernel's layout: oom-kill:constraint=C,nodemask=N,cpuset=S,mems_allowed=M,(oom_memcg=G|global_oom),
# task_memcg=T,task=COMM,pid=P,uid=U. Split by finding each separator once (``_split_oom_kill``): a regex with a
# lazy group per field backtracks polynomially on a line that repeats the separators (a 2 KB line took 40 s).
_OOM_HEAD_RE = re.compile(r"oom-kill:constraint=(?P<constraint>[^,]*),nodemask=")
_OOM_TAIL_RE = re.compile(r",pid=(?P<pid>[0-9]{1,10}),uid=(?P<uid>[0-9]{1,10})\s*\Z")
_KILLED_RE = re.compile(r"Killed process (?P<pid>[0-9]{1,10}) \((?P<rest>.*)$")
_KB_FIELDS = {
    "total_vm_bytes": re.compile(r"total-vm:([0-9]{1,20})kB"),
    "anon_rss_bytes": re.compile(r"anon-rss:([0-9]{1,20})kB"),
    "file_rss_bytes": re.compile(r"file-rss:([0-9]{1,20})kB"),
    "shmem_rss_bytes": re.compile(r"shmem-rss:([0-9]{1,20})kB"),
}
_UID_RE = re.compile(r"\bUID:([0-9]{1,10})")
_STATS_HEAD = "Memory cgroup stats for "
_UNEVICTABLE_RE = re.compile(r"(?:^|\n|\\x0a)(?P<total>total_)?unevictable (?P<value>[0-9]{1,20})(?=$|\n|\\x0a)")
STATS_WINDOW_RECORDS = 120  # the stats block is ~80 records on v1; a value farther from its header is not its
_TAIL_RE = re.compile(r"\) (?=total-vm:)")


def parse_oom_kill_line(message: str) -> dict[str, object] | None:
    """The ``oom-kill:constraint=...`` summary line -> constraint, oom_memcg, task_memcg, task, pid, uid."""
    if not isinstance(message, str) or "oom-kill:" not in message:
        return None
    body = message[message.index("oom-kill:") :]
    strict = _split_oom_kill(body)
    if strict is not None:
        return strict
    # Lenient fallback for layouts we have not seen: comma-separated key=value, pid required.
    pairs: dict[str, str] = {}
    for item in body[len("oom-kill:") :].split(","):
        key, eq, value = item.partition("=")
        if eq and key in ("constraint", "oom_memcg", "task_memcg", "task", "pid", "uid"):
            pairs.setdefault(key, value.strip())
    pid = pairs.get("pid", "")
    if not (pid.isascii() and pid.isdigit() and len(pid) <= 10):
        return None
    uid = pairs.get("uid", "")
    return {
        "constraint": pairs.get("constraint") or None,
        "oom_memcg": pairs.get("oom_memcg"),
        "task_memcg": pairs.get("task_memcg"),
        "task": pairs.get("task"),
        "pid": int(pid),
        "uid": int(uid) if uid.isascii() and uid.isdigit() and len(uid) <= 10 else None,
    }


def _split_oom_kill(body: str) -> dict[str, object] | None:
    """The kernel's own layout, each field up to its next separator (the last ``,task=`` for the task name,
    which may itself hold commas); None when a separator is missing. Linear in the line."""
    head = _OOM_HEAD_RE.match(body)
    tail = _OOM_TAIL_RE.search(body)
    if head is None or tail is None or "\n" in body[: tail.start()]:
        return None
    end = tail.start()
    cpuset = body.find(",cpuset=", head.end(), end)
    mems = body.find(",mems_allowed=", cpuset + 1, end) if cpuset != -1 else -1
    if mems == -1:
        return None
    memcg = body.find(",oom_memcg=", mems + 1, end)
    global_oom = body.find(",global_oom,task_memcg=", mems + 1, end)
    oom_memcg: str | None = None
    if memcg != -1 and (global_oom == -1 or memcg < global_oom):
        task_memcg_at = body.find(",task_memcg=", memcg + 1, end)
        if task_memcg_at == -1:
            return None
        oom_memcg = body[memcg + len(",oom_memcg=") : task_memcg_at]
    elif global_oom != -1:
        task_memcg_at = global_oom + len(",global_oom")
    else:
        return None
    start = task_memcg_at + len(",task_memcg=")
    task_at = body.rfind(",task=", start, end)
    if task_at == -1:
        return None
    return {
        "constraint": head["constraint"] or None,
        "oom_memcg": oom_memcg,
        "task_memcg": body[start:task_at],
        "task": body[task_at + len(",task=") : end],
        "pid": int(tail["pid"]),
        "uid": int(tail["uid"]),
    }


def parse_killed_process_line(message: str) -> dict[str, object] | None:
    """``[Memory cgroup out of memory|Out of memory]: Killed process PID (comm) total-vm:...kB, ...``.

    ``constraint`` is CONSTRAINT_MEMCG when the kernel's prefix says a memory cgroup ran out (it prints
    that prefix exactly for memcg OOMs); otherwise unknown (None) from this line alone.
    """
    if not isinstance(message, str):
        return None
    m = _KILLED_RE.search(message)
    if m is None:
        return None
    rest = m["rest"]
    tail = _TAIL_RE.search(rest)
    if tail is not None:
        task, numbers = rest[: tail.start()], rest[tail.end() :]
    else:
        close = rest.rfind(")")
        task, numbers = (rest[:close], rest[close + 1 :]) if close >= 0 else (rest, "")
    event: dict[str, object] = {"pid": int(m["pid"]), "task": task}
    prefix = message[: m.start()]
    event["constraint"] = "CONSTRAINT_MEMCG" if "Memory cgroup out of memory" in prefix else None
    for name, pattern in _KB_FIELDS.items():
        found = pattern.search(numbers)
        event[name] = int(found.group(1)) * 1024 if found else None
    uid = _UID_RE.search(numbers)
    event["uid"] = int(uid.group(1)) if uid else None
    return event


def estimate_boot_time() -> float:
    """Wall-clock time of printk's zero (see the module docstring for why MONOTONIC, not BOOTTIME)."""
    return time.time() - time.monotonic()


@dataclass
class _Pending:
    fields: dict[str, object]
    usec: int
    index: int
    since: float


class OomAssembler:
    """Joins ``oom-kill:`` and ``Killed process`` records of one kill (by pid) into one ``OomEvent``.

    An ``oom-kill:`` line waits for its partner for ``window_records`` records or ``window_s`` seconds
    (``expire``), then is emitted alone. A ``Killed process`` line with no waiting partner is emitted
    alone, unless its pid was just emitted alone from an ``oom-kill:`` line (no double counting).
    """

    def __init__(
        self,
        boot_time: Callable[[], float] = estimate_boot_time,
        *,
        window_records: int = PAIR_WINDOW_RECORDS,
        window_s: float = PAIR_WINDOW_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._boot_time = boot_time
        self._window_records = window_records
        self._window_s = window_s
        self._monotonic = monotonic
        self._pending: dict[int, _Pending] = {}
        self._index = 0
        self._emitted_alone: dict[int, int] = {}  # pid -> record index when its summary went out alone
        # The latest memcg stats block: its group, where its header was, and its unevictable bytes (hierarchical
        # total_unevictable wins over the group's own when v1 prints both). One block at a time: bounded.
        self._stats: tuple[str, int] | None = None
        self._unevictable: tuple[int, bool] | None = None

    def feed(self, record: KmsgRecord) -> list[OomEvent]:
        self._index += 1
        events: list[OomEvent] = []
        message = record.message
        if message.startswith(_STATS_HEAD) or "unevictable " in message:
            self._feed_stats(message)
        if "oom-kill:" in message:
            fields = parse_oom_kill_line(message)
            if fields is not None:
                unevictable = self._unevictable_of(fields.get("oom_memcg"))  # type: ignore[arg-type]
                if unevictable is not None:
                    fields["unevictable_bytes"] = unevictable
                pid = int(fields["pid"])  # type: ignore[call-overload]
                if pid in self._pending:  # a second summary for a pid still waiting: keep both
                    events.append(self._emit_alone(pid))
                self._pending[pid] = _Pending(fields, record.usec, self._index, self._monotonic())
        elif "Killed process" in message:
            killed = parse_killed_process_line(message)
            if killed is not None:
                pid = int(killed["pid"])  # type: ignore[call-overload]
                pending = self._pending.pop(pid, None)
                if pending is not None:
                    events.append(self._event(pending.fields, killed, pending.usec))
                elif self._index - self._emitted_alone.get(pid, -(1 << 62)) <= 2 * self._window_records:
                    del self._emitted_alone[pid]  # the partner of a summary we already reported
                else:
                    events.append(self._event(None, killed, record.usec))
        for pid, pending in list(self._pending.items()):
            if self._index - pending.index > self._window_records:
                events.append(self._emit_alone(pid))
        return events

    def _feed_stats(self, message: str) -> None:
        """Keep the group of a stats header, and the unevictable value of the block that follows it."""
        if message.startswith(_STATS_HEAD):
            path = message[len(_STATS_HEAD) :].split("\\x0a", 1)[0].split("\n", 1)[0].rstrip().rstrip(":")
            self._stats, self._unevictable = (path, self._index), None
        if self._stats is None or self._index - self._stats[1] > STATS_WINDOW_RECORDS:
            return
        for m in _UNEVICTABLE_RE.finditer(message):
            total = m["total"] is not None
            if self._unevictable is None or total or not self._unevictable[1]:
                self._unevictable = (int(m["value"]), total)

    def _unevictable_of(self, oom_memcg: str | None) -> int | None:
        """The unevictable bytes of the stats block just before a kill of ``oom_memcg`` (None: none, or another group's)."""
        if self._stats is None or self._unevictable is None or self._index - self._stats[1] > STATS_WINDOW_RECORDS:
            return None
        if oom_memcg is not None and self._stats[0] != oom_memcg:
            return None
        return self._unevictable[0]

    def expire(self) -> list[OomEvent]:
        """Emit ``oom-kill:`` lines that waited longer than ``window_s`` (nothing else arrived to push them out)."""
        now = self._monotonic()
        return [self._emit_alone(pid) for pid, p in list(self._pending.items()) if now - p.since >= self._window_s]

    def flush(self) -> list[OomEvent]:
        """Emit everything still waiting (end of input)."""
        return [self._emit_alone(pid) for pid in list(self._pending)]

    def _emit_alone(self, pid: int) -> OomEvent:
        pending = self._pending.pop(pid)
        self._emitted_alone[pid] = self._index
        if len(self._emitted_alone) > 256:
            horizon = self._index - 2 * self._window_records
            self._emitted_alone = {p: i for p, i in self._emitted_alone.items() if i >= horizon}
        return self._event(pending.fields, None, pending.usec)

    def _event(self, kill: dict[str, object] | None, killed: dict[str, object] | None, usec: int) -> OomEvent:
        kill = kill or {}
        killed = killed or {}
        try:
            boot = float(self._boot_time())
        except Exception:
            boot = estimate_boot_time()

        def pick(name: str) -> object:
            value = kill.get(name)
            return killed.get(name) if value is None else value

        return OomEvent(
            ts=boot + usec / 1e6,
            constraint=pick("constraint"),  # type: ignore[arg-type]
            oom_memcg=kill.get("oom_memcg"),  # type: ignore[arg-type]
            task_memcg=kill.get("task_memcg"),  # type: ignore[arg-type]
            task=pick("task"),  # type: ignore[arg-type]
            pid=pick("pid"),  # type: ignore[arg-type]
            uid=pick("uid"),  # type: ignore[arg-type]
            total_vm_bytes=killed.get("total_vm_bytes"),  # type: ignore[arg-type]
            anon_rss_bytes=killed.get("anon_rss_bytes"),  # type: ignore[arg-type]
            file_rss_bytes=killed.get("file_rss_bytes"),  # type: ignore[arg-type]
            shmem_rss_bytes=killed.get("shmem_rss_bytes"),  # type: ignore[arg-type]
            unevictable_bytes=kill.get("unevictable_bytes"),  # type: ignore[arg-type]
        )


def parse_oom_events(lines: Iterable[str], boot_time: float = 0.0) -> list[OomEvent]:
    """All OOM kills in a dump of /dev/kmsg-format lines (bundles, tests). ``ts`` = boot_time + stamp."""
    assembler = OomAssembler(lambda: boot_time)
    events: list[OomEvent] = []
    for line in lines:
        record = parse_kmsg_record(line)
        if record is not None:
            events.extend(assembler.feed(record))
    events.extend(assembler.flush())
    return events


# --------------------------------------------------------------------------- the watcher


class KmsgOomWatcher:
    """Reads new /dev/kmsg records without blocking and returns the OOM kills among them.

    It starts at the END of the ring buffer: only kills from the moment the agent starts are reported
    (history would replay as a flood of stale events after every agent restart). ``error`` says why it
    cannot watch (not root with dmesg_restrict=1, no /dev/kmsg in a container); ``poll`` then returns [].
    ``overwritten`` counts EPIPE: records the kernel overwrote before we read them.
    """

    def __init__(self, path: str = "/dev/kmsg", *, assembler: OomAssembler | None = None) -> None:
        self.path = path
        self.error: str | None = None
        self.overwritten = 0
        self.records_read = 0
        self._assembler = assembler or OomAssembler()
        self._fd: int | None = None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, ValueError) as exc:
            self.error = f"cannot open {path}: {_describe(exc)}"
            return
        try:
            os.lseek(fd, 0, os.SEEK_END)
        except OSError as exc:
            os.close(fd)
            self.error = f"cannot seek to the end of {path}: {_describe(exc)}"
            return
        self._fd = fd

    def poll(self) -> list[OomEvent]:
        """Every OOM kill logged since the last poll (never blocks, never raises)."""
        if self._fd is None:
            return []
        events: list[OomEvent] = []
        try:
            for _ in range(MAX_RECORDS_PER_POLL):
                try:
                    data = os.read(self._fd, READ_BUFFER)
                except BlockingIOError:  # EAGAIN: nothing more for now
                    break
                except OSError as exc:
                    if exc.errno == errno.EPIPE:  # records overwritten under us; the next read resumes
                        self.overwritten += 1
                        continue
                    if exc.errno == errno.EINVAL:  # a record larger than our buffer; the kernel skips it
                        continue
                    self.error = f"read {self.path}: {_describe(exc)}"
                    break
                if not data:  # a regular file standing in for /dev/kmsg: end of file
                    break
                for record in parse_kmsg_chunk(data):
                    self.records_read += 1
                    events.extend(self._assembler.feed(record))
            events.extend(self._assembler.expire())
        except Exception as exc:  # a parser bug must not reach the agent loop
            self.error = f"kmsg parsing failed: {exc!r}"
        return events

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> KmsgOomWatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno:
        return os.strerror(exc.errno)
    return str(exc) or type(exc).__name__


__all__ = [
    "KmsgOomWatcher",
    "KmsgRecord",
    "OomAssembler",
    "estimate_boot_time",
    "parse_killed_process_line",
    "parse_kmsg_chunk",
    "parse_kmsg_record",
    "parse_oom_events",
    "parse_oom_kill_line",
]
