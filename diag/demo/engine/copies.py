"""Private copies of one model in one memory group: several servers started together, and the limit that fits the
running copies but not one more.

Why measured, not guessed: with ``use_mmap=false`` each llama.cpp server reads the whole GGUF into its own
anonymous memory, beside its interpreter and llama.cpp's buffers. What one server costs depends on the Python,
the wheel and the model, so the limit for "three fit, a fourth does not" is set from the group's anonymous
memory once the running copies are ready: their total, plus what one more server needs besides its weights,
plus half the weights. A fourth server's interpreter and buffers then fit, and its weights are what the group
runs out of -- a memcg OOM kill while the copy is read in (file pages of the model are reclaimable and go first).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from diag.demo.engine.server import EngineServer, EngineSettings
from diag.demo.scenarios.cgroups import MemoryGroup


def start_together(
    settings: EngineSettings, group: MemoryGroup, logs: Sequence[Path], *, on_started: Callable[[EngineServer], object]
) -> list[EngineServer]:
    """Start one server per log path in ``group`` at once (their start-ups overlap: a busy host loads them in the
    time of about one), each handed to ``on_started`` as soon as it exists, so the caller can stop it whatever
    happens to the others. Raises the first start-up error; servers already started are the caller's to stop."""
    servers = [EngineServer(settings, log, group=group) for log in logs]
    for server in servers:
        on_started(server)
    with ThreadPoolExecutor(len(servers)) as pool:
        for future in [pool.submit(s.start) for s in servers]:
            future.result()
    return servers


def limit_for_one_short(anon: int, running: int, model_bytes: int) -> int:
    """The hard limit that holds ``running`` private copies whose group holds ``anon`` bytes of anonymous memory
    (``pagecache.anon_bytes``), and a next server's interpreter and buffers, but only half of its weights (see the
    module doc)."""
    if running < 1 or anon <= 0 or model_bytes <= 0:
        raise ValueError("running copies, their anonymous memory and the model's size must all be positive")
    per_server = anon / running
    return int(anon + max(per_server - model_bytes, 0) + model_bytes // 2)
