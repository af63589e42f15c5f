"""The levels a cause alert and the rule for the same class share: one definition, read by both.

Why a module of plain numbers: the rules judge the flight recorder, the cause alerts (``alerts/causes.py``)
judge the same signals in Prometheus. When each kept its own thresholds they disagreed -- the thrashing
alert asked for memory PSI *some* over 20 % while the rules call PSI *full* over 5 % thrashing, and the
duplicate-copies alert counted two processes sharing one mmap as two copies. Every level both sides apply
lives here, with its reason, and nothing here imports anything (the alert generator reads it without the
rules' numpy machinery). ``tests/alerts/test_causes_vs_rules.py`` replays every scenario recording through
both and compares what they conclude.
"""

from __future__ import annotations

# Memory stalls (the kernel's PSI, percent of wall time). Thresholds are for *diagnosis*, a tier below the
# ones that kill: systemd-oomd acts on a cgroup at memory PSI full > 60 % for 30 s (oomd.conf(5) defaults);
# Android's lmkd reports medium pressure at some >= 7 % and critical at full >= 70 %. Here some >= 10 % is
# pressure, and full >= 5 % a thrashing candidate: the kernel's PSI documentation calls time with *every*
# task stalled on memory thrashing, and the scenario recordings of real thrashing reach 28-74 % full while
# the healthy, queue and batching ones stay at 0.
PSI_SOME_UP = 10.0
PSI_FULL_UP = 5.0
# Page-ins that back a stall (per second): a healthy warm service takes ~0 major faults per second.
FAULTS_UP = 50.0  # major faults
REFAULTS_UP = 200.0  # pages refaulted (evicted, then needed again)
SWAP_UP = 100.0  # pages swapped in + out

# Memory near its limit: the working set at >= 90 % of the limit; limit events (memory.events max/high,
# failcnt) count only once the working set is >= 80 % of it (a group streaming files hits its limit routinely).
NEAR_LIMIT = 0.90
LIMIT_EVENTS_NEAR = 0.80
# Memory pressure wants two of its indicators (PSI some, near the limit, limit events): one alone is routine.
PRESSURE_INDICATORS = 2

# A queue that overwhelms its slots: requests wait >= 3x their inference time.
OVERWHELM_FACTOR = 3.0

# A model holder whose private memory (USS) is >= 60 % of its resident memory holds the big part of it
# privately: a copy of its own. Processes sharing one read-only mmap of the weights stay well under it.
PRIVATE_DOMINANT = 0.6

# The KV cache of an engine with paged attention (vLLM's v1 scheduler; llama.cpp's slots): usage is the
# fraction of its blocks in use (``vllm:kv_cache_usage_perc`` is a fraction 0-1 despite its name). The
# scheduler preempts (and later recomputes) a running sequence only when it cannot get a block, so usage
# sits at its ceiling when it does; >= 95 % allows for block granularity and a scrape that lands between
# a preemption and the freed blocks being reused. Below 80 % the cache has room: requests that wait then
# wait for a slot (queue backlog), not for KV capacity.
KV_CEILING = 0.95
KV_ROOM = 0.80
# Preemptions that matter: sustained, not a single one (>= 3 a minute).
PREEMPTIONS_UP = 0.05
