"""The batcher: forms batches by request count or by token budget and runs them on one model thread.

Why both policies: a batcher that caps batches by *request count* lets one batch of eight long
prompts carry ten times the tokens -- and the activation memory -- of a batch of eight short ones;
that is the ``request_count_batching`` incident. A *token budget* caps what a batch can hold, which
is the remedy. Every formed batch is reported (``on_batch``) before it runs, so the record of an
oversized batch exists even if the batch is what kills the process.

Batching is static: a batch is formed, prefilled in one ragged pass, then decoded step by step until
its last sequence is done; requests arriving meanwhile wait for the next batch. One thread per worker
runs the model (numpy releases the GIL in its kernels, so the event loop stays responsive), which is
why ``concurrent_batches`` is always 1 here. A request whose future was cancelled (inference timeout,
client gone) is dropped from its batch at the next step, freeing its KV cache; a step in which every
request was abandoned (a long prefill that timed out) is stopped within an attention chunk.

The batching window: after ``batch_wait_s``, a batch that holds fewer jobs than the recent batches
held (their median) waits a little longer for the rest -- at most half a decode step, capped at
``MAX_EXTRA_WAIT_S``. Why: closed-loop clients resubmit as soon as their answers arrive, so the same
few requests make up batch after batch; if one of them reaches the queue a moment after the fixed
window (more work on the event loop between a response and the next submit, e.g. request tracking),
it misses the batch and waits a whole batch for the next one, and every batch runs smaller, each
request costing more model time. Waiting up to half a step for it costs less than that. Under
overload the queue holds enough at once and nothing waits longer; under light load the recent batches
held one job and nothing waits longer either.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from diag.demo.kvcache import KvBudget, blocks_for
from diag.demo.model import DemoModel, Sequence, StepAborted
from diag.demo.weights import LoadedWeights

BatchingMode = Literal["requests", "tokens"]
RECENT_BATCHES = 8  # batches whose sizes set how many jobs the next one waits for
MAX_EXTRA_WAIT_S = 0.05  # the longest a batch waits past ``batch_wait_s`` for the jobs recent batches held
BATCHING_MODES: tuple[str, ...] = ("requests", "tokens")


@dataclass
class Completion:
    """What the model produced for one request (token ids; the app decodes them)."""

    ids: list[int]
    prompt_tokens: int
    batch_requests: int
    batch_tokens: int


@dataclass
class _Job:
    prompt_ids: list[int]
    max_tokens: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Completion]
    on_first_token: Callable[[], Any] | None = None
    seq: Sequence | None = field(default=None, repr=False)
    on_scheduled: Callable[[], Any] | None = None  # first admitted into a running batch (an engine's end of WAITING)
    # After a preemption: the tokens generated before it (now part of ``prompt_ids``, recomputed) and the
    # original prompt's length, so the completion is the same whether or not the job was preempted.
    resumed: list[int] = field(default_factory=list)
    prompt_len: int = -1

    def __post_init__(self) -> None:
        if self.prompt_len < 0:
            self.prompt_len = len(self.prompt_ids)

    @property
    def tokens(self) -> int:
        return len(self.prompt_ids)

    def abandoned(self) -> bool:
        return self.future.done()  # cancelled by a timeout or a vanished client

    def resolve(self, value: Completion | BaseException) -> None:
        def _set() -> None:
            if self.future.done():
                return
            if isinstance(value, BaseException):
                self.future.set_exception(value)
            else:
                self.future.set_result(value)

        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            self.loop.call_soon_threadsafe(_set)


class Batcher:
    """Queue + one model thread. ``submit`` is called from the event loop; everything else runs on the thread.

    ``weights`` returns the weights to use for the next batch (the registry's current ones), so a
    refresh takes effect at a batch boundary. ``on_batch(**BatchStats fields)`` and
    ``on_routing(layer, counts)`` are the tracker's ``record_batch`` / ``record_routing``; they must
    not raise (the tracker's never do) but are guarded anyway.
    """

    def __init__(
        self,
        weights: Callable[[], LoadedWeights],
        *,
        mode: BatchingMode = "tokens",
        max_batch_requests: int = 8,
        max_batch_tokens: int = 4096,
        batch_wait_s: float = 0.002,
        router_skew: float = 0.0,
        capacity_factor: float = 0.0,
        on_batch: Callable[..., Any] | None = None,
        on_routing: Callable[..., Any] | None = None,
        kv: KvBudget | None = None,
        kv_enforced: bool = True,
        min_step_s: float = 0.0,
    ) -> None:
        if mode not in BATCHING_MODES:
            raise ValueError(f"batching mode must be one of {BATCHING_MODES}")
        if max_batch_requests < 1 or max_batch_tokens < 1:
            raise ValueError("batch limits must be positive")
        if min_step_s < 0:
            raise ValueError("min_step_s must not be negative")
        self._weights = weights
        self.mode: BatchingMode = mode
        self.max_batch_requests = max_batch_requests
        self.max_batch_tokens = max_batch_tokens
        self.batch_wait_s = batch_wait_s
        self.router_skew = router_skew
        self.capacity_factor = capacity_factor
        self._on_batch = on_batch
        self._on_routing = on_routing
        self.kv = kv  # None: no KV accounting (the model's caches are bounded by memory alone)
        # False: blocks are counted (usage reported) but neither admission nor preemption applies them -- the
        # default budget, so the scenarios that do not ask for one batch exactly as without it.
        self.kv_enforced = kv_enforced
        # A floor on each model step's time: an accelerator, not the host's CPU, paces a real engine's steps, so
        # a scenario that needs a known service rate (a backlog past one slot) gets it on a busy host as on an
        # idle one. The CPU's own time only adds to it when a step is slower than the floor.
        self.min_step_s = min_step_s
        self._queue: collections.deque[_Job] = collections.deque()
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._recent_sizes: collections.deque[int] = collections.deque(maxlen=RECENT_BATCHES)
        self._step_s = 0.0  # how long the last decode step took
        self.batches = 0
        self.running = 0  # sequences in the running batch now (an engine's num_requests_running)
        self.aborted_steps = 0  # steps stopped early because every request in them was abandoned

    # ------------------------------------------------------------------ event-loop side

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="demo-model", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    async def submit(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        on_first_token: Callable[[], Any] | None = None,
        on_scheduled: Callable[[], Any] | None = None,
    ) -> Completion:
        """Queue a request and wait for its completion. Cancelling the await drops it from its batch."""
        loop = asyncio.get_running_loop()
        job = _Job(list(prompt_ids), max(1, int(max_tokens)), loop, loop.create_future(), on_first_token)
        job.on_scheduled = on_scheduled
        with self._cond:
            if self._stop:
                raise RuntimeError("batcher stopped")
            self._queue.append(job)
            self._cond.notify()
        return await job.future

    @property
    def queued(self) -> int:
        return len(self._queue)

    # ------------------------------------------------------------------ model-thread side

    def _take_batch(self) -> list[_Job] | None:
        with self._cond:
            while not self._queue and not self._stop:
                self._cond.wait()
            if self._stop:
                return None
        if self.batch_wait_s > 0:
            time.sleep(self.batch_wait_s)  # let requests that arrived together share the batch
        with self._cond:
            self._wait_for_recent_size()
            batch: list[_Job] = []
            tokens = 0
            blocks = 0
            no_room = False
            while self._queue and len(batch) < self.max_batch_requests:
                job = self._queue[0]
                if job.abandoned():
                    self._queue.popleft()
                    continue
                if self.mode == "tokens" and batch and tokens + job.tokens > self.max_batch_tokens:
                    break  # over budget: it opens the next batch (a lone oversized job still runs, alone)
                # KV admission (vLLM's): the prompt's blocks, plus the slot of its next token, must be free.
                need = blocks_for(job.tokens + 1)
                if self.kv is not None and self.kv_enforced and blocks + need > self.kv.total_blocks:
                    if not batch:  # more than the whole cache: it could never run (the settings refuse such limits)
                        self._queue.popleft()
                        job.resolve(ValueError(f"the prompt needs {need} KV blocks; the cache has {self.kv.total_blocks}"))
                        continue
                    no_room = True
                    break
                self._queue.popleft()
                batch.append(job)
                tokens += job.tokens
                blocks += need
            if self.kv is not None:
                self.kv.waiting_for_capacity = len(self._queue) if no_room else 0
            if batch:
                self._recent_sizes.append(len(batch))
            return batch

    def _wait_for_recent_size(self) -> None:
        """Called with the lock held: wait (up to half a decode step, at most ``MAX_EXTRA_WAIT_S``) while the
        queue holds fewer jobs than the median of the recent batches (see the module's notes)."""
        if not self._recent_sizes or self._step_s <= 0:
            return
        wanted = min(statistics.median_high(self._recent_sizes), self.max_batch_requests)
        deadline = time.monotonic() + min(self._step_s / 2, MAX_EXTRA_WAIT_S)
        while len(self._queue) < wanted and not self._stop:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._cond.wait(remaining)

    def _run(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            if batch:
                self._run_batch(batch)

    def _run_batch(self, batch: list[_Job]) -> None:
        self.batches += 1
        tokens = [j.tokens for j in batch]
        self._report(
            self._on_batch,
            requests=len(batch),
            input_tokens=sum(tokens),
            max_request_tokens=max(tokens),
            active_decode_sequences=0,
            concurrent_batches=1,
            phase="prefill",
        )
        try:
            weights = self._weights()
            model = DemoModel(weights, router_skew=self.router_skew, capacity_factor=self.capacity_factor)
            cfg = weights.config
            routing = np.zeros((cfg.n_layers, cfg.experts), dtype=np.int64) if cfg.experts else None
            capacity = np.zeros(cfg.n_layers, dtype=np.int64) if cfg.experts and self.capacity_factor > 0 else None
            for j in batch:
                j.seq = model.new_sequence(j.prompt_ids, j.max_tokens)
                if j.on_scheduled is not None:
                    self._report(j.on_scheduled)
            live = list(batch)
            first = True
            while live:
                live = self._fit_kv(live)
                self.running = len(live)
                step_started = time.monotonic()
                try:
                    # A prefill whose requests all timed out (or left) stops within an attention chunk.
                    model.step(
                        [j.seq for j in live if j.seq is not None],
                        routing,
                        capacity,
                        should_stop=lambda jobs=live: all(j.abandoned() for j in jobs),
                    )
                except StepAborted:
                    self.aborted_steps += 1
                    for j in live:
                        j.seq = None  # frees the KV caches and activations now
                    break
                self._pace(step_started)
                if not first:  # a decode step (the prefill's length depends on the prompts)
                    self._step_s = time.monotonic() - step_started
                else:
                    first = False
                    for j in live:
                        if j.on_first_token is not None:
                            self._report(j.on_first_token)
                still = []
                for j in live:
                    assert j.seq is not None
                    if j.abandoned():
                        j.seq = None  # frees its KV cache now, not when the batch ends
                    elif j.seq.done:
                        j.resolve(Completion(j.resumed + j.seq.generated, j.prompt_len, len(batch), sum(tokens)))
                        j.seq = None
                    else:
                        still.append(j)
                live = still
            if routing is not None:
                for layer in range(routing.shape[0]):
                    counts = [int(n) for n in routing[layer]]
                    if capacity is None:
                        self._report(self._on_routing, layer, counts)
                    else:  # capacity summed over the batch's passes, like the counts
                        self._report(self._on_routing, layer, counts, int(capacity[layer]))
        except Exception as exc:  # MemoryError included: the requests fail, the worker lives on
            for j in batch:
                j.seq = None
                j.resolve(exc)
        finally:
            self.running = 0
            if self.kv is not None:
                self.kv.set_used(0)  # the batch's sequences are gone: their blocks are free

    def _pace(self, step_started: float) -> None:
        """Sleep out what is left of ``min_step_s`` since ``step_started`` (nothing when the step took longer)."""
        left = self.min_step_s - (time.monotonic() - step_started)
        if left > 0:
            time.sleep(left)

    def _fit_kv(self, live: list[_Job]) -> list[_Job]:
        """Before a step: every live sequence needs the blocks of its cached tokens and of the ones this step adds.
        When they do not fit, the most recently admitted sequence is preempted (vLLM's recompute policy): its
        blocks are freed and it goes back to the front of the queue with what it generated so far, to be
        prefilled again. The first sequence is never preempted: the budget holds any one request (settings)."""
        if self.kv is None:
            return live
        need = [blocks_for(j.seq.cache.length + len(j.seq.pending)) if j.seq is not None else 0 for j in live]
        kept = list(live)
        while self.kv_enforced and len(kept) > 1 and sum(need) > self.kv.total_blocks:
            victim = kept.pop()
            need.pop()
            self._requeue(victim)
        self.kv.set_used(sum(need))
        return kept

    def _requeue(self, victim: _Job) -> None:
        seq, victim.seq = victim.seq, None  # frees its KV cache now
        generated = list(seq.generated) if seq is not None else []
        resumed = _Job(
            victim.prompt_ids + generated,
            max(1, victim.max_tokens - len(generated)),
            victim.loop,
            victim.future,
            None if generated else victim.on_first_token,  # a recompute does not report a first token twice
            resumed=victim.resumed + generated,
            prompt_len=victim.prompt_len,
        )
        assert self.kv is not None
        self.kv.preempted()
        with self._cond:
            self._queue.appendleft(resumed)
            self._cond.notify()

    @staticmethod
    def _report(fn: Callable[..., Any] | None, *args: Any, **kwargs: Any) -> None:
        if fn is None:
            return
        with contextlib.suppress(Exception):
            fn(*args, **kwargs)
