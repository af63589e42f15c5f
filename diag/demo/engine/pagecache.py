"""The model file's page cache and the group's room for it: what the mmap thrashing scenario turns.

Why these two steps: with ``use_mmap`` and no mlock, llama.cpp computes straight from the mapped file,
so every token reads every weight page. A memory cgroup charges a file page to the group that first
faults it in; a model file still cached from its writer (or an earlier server) is charged elsewhere
and never reclaimed by the engine's group, so ``evict_from_page_cache`` (the scenarios' own) empties it
first. The group's limit is then set from what the *running* server holds besides the file
(``anon_bytes``, measured after a warm-up request, since llama.cpp's buffers are part of it) plus a
share of the model: sized from a guess, the limit would either OOM-kill the server or leave room for
the whole model.
"""

from __future__ import annotations

from diag.demo.scenarios.cgroups import MAX_LIMIT_BYTES, MemoryGroup


def anon_bytes(group: MemoryGroup) -> int:
    """The group's memory that reclaim cannot drop without swap: anonymous pages (``rss`` in v1's memory.stat)."""
    stat = group.stat()
    return stat.get("total_rss", stat.get("rss", 0))


def set_limit(group: MemoryGroup, limit_bytes: int) -> None:
    """Lower (or raise) the running group's hard limit; the kernel reclaims file pages to fit.

    Raises ``OSError`` (EBUSY) when the group cannot be reclaimed below the new limit, and ``ValueError``
    for a limit outside what a scenario group may have."""
    if not 0 < limit_bytes <= MAX_LIMIT_BYTES:
        raise ValueError(f"a scenario group needs a limit between 1 byte and {MAX_LIMIT_BYTES >> 30} GiB")
    (group.v1_dir / "memory.limit_in_bytes").write_text(str(limit_bytes))
    group.limit_bytes = limit_bytes
