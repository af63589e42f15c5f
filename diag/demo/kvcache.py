"""The demo's KV-cache budget, in blocks, with vLLM's accounting: admission by free blocks, preemption when full.

Why a budget at all: the demo's model keeps a real KV cache per sequence, but in host memory with no
limit but the cgroup's. An engine with paged attention (vLLM) pre-allocates a fixed number of KV blocks
on the GPU and schedules within them: a waiting request is admitted only when its prompt's blocks are
free, and a *running* sequence that needs a new block when none is free is preempted -- its blocks are
freed and it goes back to the front of the waiting queue, to be recomputed (prefill of its prompt plus
what it had generated) when blocks free up. Usage is blocks in use / total. This module is that
accounting; the batcher applies it, the dialect exporter reports it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

BLOCK_TOKENS = 16  # vLLM's default block size (tokens per KV block)


def blocks_for(tokens: int) -> int:
    """Blocks holding ``tokens`` tokens (a partly filled last block is a whole block)."""
    return max(0, -(-int(tokens) // BLOCK_TOKENS))


@dataclass
class KvBudget:
    """The KV cache's blocks and what the scheduler did with them; read by the exporter from another thread."""

    total_tokens: int
    used_blocks: int = 0
    preemptions: int = 0  # sequences preempted (and later recomputed), cumulative
    waiting_for_capacity: int = 0  # queued requests the last admission could not fit
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.total_tokens < BLOCK_TOKENS:
            raise ValueError(f"the KV-cache budget must hold at least one block ({BLOCK_TOKENS} tokens)")

    @property
    def total_blocks(self) -> int:
        return self.total_tokens // BLOCK_TOKENS

    @property
    def usage(self) -> float:
        """Blocks in use / total, 0-1 (vLLM's ``kv_cache_usage_perc``)."""
        return min(1.0, self.used_blocks / self.total_blocks)

    def set_used(self, blocks: int) -> None:
        with self._lock:
            self.used_blocks = max(0, int(blocks))

    def preempted(self, n: int = 1) -> None:
        with self._lock:
            self.preemptions += n
