"""Iteration-level scheduler: the reference's policy (reference/scheduler.py), built for speed.

FCFS over waiting / running / swapped queues; running requests first, earliest arrival first; when blocks
run out the latest-arrived running request is preempted (recompute or swap); swapped requests come back
before new ones are admitted; nothing is admitted in a step that preempted.
"""

import bisect
from dataclasses import dataclass, field

from jax_engine.core.kv_cache_manager import KVCacheManager
from jax_engine.request import Request
from reference.request import RequestStatus
from reference.scheduler import SchedulerConfig


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int


@dataclass
class Preemption:
    request: Request
    mode: str  # "recompute" or "swap"
    reason: str


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Preemption] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)  # taken from WAITING this step
    swap_out: dict[int, int] = field(default_factory=dict)  # device block -> host block
    swap_in: dict[int, int] = field(default_factory=dict)  # host block -> device block
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class _ArrivalQueue:
    """Requests kept sorted by arrival: O(log n) insert, O(1) pop at either end."""

    def __init__(self) -> None:
        self.items: list[Request] = []

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        return iter(self.items)

    def insert(self, request: Request) -> None:
        bisect.insort(self.items, request, key=lambda r: r.arrival)

    def remove(self, request: Request) -> None:
        self.items.remove(request)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.waiting, self.running, self.swapped = _ArrivalQueue(), _ArrivalQueue(), _ArrivalQueue()
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self._enqueue(self.waiting, request, RequestStatus.WAITING)

    def add_running(self, request: Request) -> None:
        """A sequence forked from a running one: it already holds (shared) blocks."""
        self._enqueue(self.running, request, RequestStatus.RUNNING)

    def has_unfinished_requests(self) -> bool:
        return bool(len(self.waiting) or len(self.running) or len(self.swapped))

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    # ------------------------------------------------------------------------------- one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens - self._schedule_running(out)
        if not out.preempted:
            budget -= self._schedule_swapped(out, budget)
            if not len(self.swapped):
                self._schedule_waiting(out, budget)
        if not out.scheduled and len(self.running) and (len(self.waiting) or len(self.swapped)):
            # Every running sequence is idle (beams waiting for a sibling) and holds the blocks the
            # others need: give the latest arrival's blocks up so the queue cannot deadlock.
            self._preempt(self.running.items.pop(), out, "idle while holding blocks others wait for")
        return out

    def _chunk(self, num_remaining: int, budget: int) -> int:
        if self.config.enable_chunked_prefill:
            return min(num_remaining, budget)
        return num_remaining if num_remaining <= budget else 0

    def _schedule_running(self, out: SchedulerOutput) -> int:
        kv, running, used, i = self.kv, self.running.items, 0, 0
        while i < len(running):
            request = running[i]
            n = self._chunk(request.num_tokens - request.num_computed_tokens, self.config.max_num_batched_tokens - used)
            if n == 0:
                i += 1
                continue
            while not kv.can_append_slots(request.request_id, request.num_computed_tokens, n):
                needed = kv.num_blocks_to_append(request.request_id, request.num_computed_tokens, n)
                reason = f"{request.request_id} needed {needed} blocks, {kv.device.num_free_blocks} free"
                self._preempt(running.pop(), out, reason)
                if request.status is not RequestStatus.RUNNING:
                    return used
            out.copies += kv.append_slots(request.request_id, request.num_computed_tokens, n)
            out.scheduled.append(ScheduledRequest(request, n))
            used += n
            i += 1
        return used

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        kv, used = self.kv, 0
        while len(self.swapped) and len(self.running) < self.config.max_num_seqs:
            request = self.swapped.items[0]
            n = self._chunk(request.num_tokens - request.num_computed_tokens, budget - used)
            extra = kv.num_blocks_to_append(request.request_id, request.num_computed_tokens, n)
            if n == 0 or not kv.can_swap_in([request.request_id], extra):
                break
            self.swapped.items.pop(0)
            out.swap_in.update(kv.swap_in([request.request_id]))
            out.copies += kv.append_slots(request.request_id, request.num_computed_tokens, n)
            self._enqueue(self.running, request, RequestStatus.RUNNING)
            out.scheduled.append(ScheduledRequest(request, n))
            used += n
        return used

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        kv = self.kv
        while len(self.waiting) and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.items[0]
            num_cached = len(kv.find_cached_prefix(request.request_id, request.token_ids)) * kv.block_size
            n = self._chunk(request.num_tokens - num_cached, budget)
            if n == 0 or not kv.can_allocate(request.request_id, request.token_ids):
                break
            self.waiting.items.pop(0)
            request.num_computed_tokens = kv.allocate(request.request_id, request.token_ids)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = request.num_computed_tokens
            self._enqueue(self.running, request, RequestStatus.RUNNING)
            out.scheduled.append(ScheduledRequest(request, n))
            out.admitted.append(request)
            budget -= n

    def _preempt(self, request: Request, out: SchedulerOutput, reason: str) -> None:
        self.num_preemptions += 1
        out.scheduled = [s for s in out.scheduled if s.request is not request]
        if self.config.preemption_mode == "swap" and self.kv.can_swap_out([request.request_id]):
            out.swap_out.update(self.kv.swap_out([request.request_id]))
            self._enqueue(self.swapped, request, RequestStatus.SWAPPED)
            out.preempted.append(Preemption(request, "swap", reason))
        else:
            if self.config.preemption_mode == "swap":
                reason += "; host swap space full, recomputing instead"
            self.kv.free(request.request_id)
            request.num_computed_tokens = 0
            self._enqueue(self.waiting, request, RequestStatus.WAITING)
            out.preempted.append(Preemption(request, "recompute", reason))

    def _enqueue(self, queue: _ArrivalQueue, request: Request, status: RequestStatus) -> None:
        request.status = status
        queue.insert(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of its queue and free its blocks (it stopped, or was aborted)."""
        for queue in (self.waiting, self.running, self.swapped):
            if request in queue.items:
                queue.remove(request)
        if request.request_id in self.kv.block_tables:
            self.kv.free(request.request_id)
        self.kv.forget(request.request_id)
        request.status = status
