"""Iteration-level scheduler: the reference's policy (reference/scheduler.py), built for speed.

FCFS over waiting / running / swapped queues; running sequences first, earliest arrival first; when blocks
run out the latest-arrived running sequence is preempted (recompute or swap); swapped sequences come back
before new ones are admitted; nothing is admitted in a step that preempted.

One thing the reference has no need of: a sequence may fork (the other samples of `n > 1`, the first beams of
a beam search), so it is admitted only when it and its forks to come fit under max_num_seqs, as vLLM v0 admits a
group by its `get_max_num_running_seqs()`. Admitting by the running count alone let a full batch fork past
max_num_seqs, into step shapes start-up never compiled. For the reference's one-sequence requests the rules
are the same.
"""

import bisect
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jax_engine.core.kv_cache_manager import KVCacheManager
from jax_engine.sequence import Sequence
from reference.request import RequestStatus
from reference.scheduler import SchedulerConfig

logger = logging.getLogger(__name__)

if TYPE_CHECKING:  # the sampler imports jax; the scheduler is host bookkeeping only
    from jax_engine.sampler import SampledToken


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int


@dataclass
class Preemption:
    seq: Sequence
    mode: str  # "recompute" or "swap"
    reason: str


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Preemption] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # taken from WAITING this step
    swap_out: dict[int, int] = field(default_factory=dict)  # device block -> host block
    swap_in: dict[int, int] = field(default_factory=dict)  # host block -> device block
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class _ArrivalQueue:
    """Sequences kept sorted by arrival in a plain list: a binary search finds where to insert; inserting
    or popping the front shifts the list (a memmove, cheap at the queue lengths the engine sees)."""

    def __init__(self) -> None:
        self.items: list[Sequence] = []

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        return iter(self.items)

    def insert(self, seq: Sequence) -> None:
        bisect.insort(self.items, seq, key=lambda r: r.arrival)

    def remove(self, seq: Sequence) -> None:
        self.items.remove(seq)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.waiting, self.running, self.swapped = _ArrivalQueue(), _ArrivalQueue(), _ArrivalQueue()
        self.num_preemptions = 0

    def add_request(self, seq: Sequence, cache_salt: str | None = None) -> None:
        """Queue a request's first sequence; `cache_salt` roots its prefix-cache hashes (vLLM's field)."""
        if seq.skip_reading_prefix_cache:
            self.kv.uncached.add(seq.seq_id)
        if cache_salt is not None:
            self.kv.cache_salts[seq.seq_id] = cache_salt
        self._enqueue(self.waiting, seq, RequestStatus.WAITING)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start `child` as a copy of running `parent`: same tokens and progress, every block shared."""
        child.adopt(parent)
        parent.num_pending_forks = max(0, parent.num_pending_forks - 1)
        self.kv.fork(parent.seq_id, child.seq_id)
        self._enqueue(self.running, child, RequestStatus.RUNNING)

    def has_unfinished_requests(self) -> bool:
        return bool(len(self.waiting) or len(self.running) or len(self.swapped))

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    # ------------------------------------------------------------------------------- one step
    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences and token counts; allocate, swap and copy their blocks (see module doc)."""
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

    def update_from_output(self, out: SchedulerOutput, sampled: list[tuple[Sequence, "SampledToken"]]) -> None:
        """After the model ran `out`: advance computed counts, cache full blocks, fork, append, finish.

        Args:
            out: the output of the `schedule()` call that the model just ran.
            sampled: a token for every sequence whose tokens are now all computed, in sampling order. A
                parallel sample that is not running yet (`fork_parent` set) forks from its parent here,
                sharing every block, then takes its own token.
        Stop tokens, EOS and max_tokens finish a sequence and free its blocks; stop strings, which need the
        text, are the output processor's (jax_engine/output_processor.py).
        """
        for s in out.scheduled:
            if s.seq.status.is_finished:  # failed while this step ran: it holds no blocks any more
                continue
            s.seq.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_blocks(s.seq.seq_id, s.seq.all_token_ids, s.seq.num_computed_tokens)
        for seq, _ in sampled:  # fork before anyone appends, so children copy the parent's prompt alone
            if seq.fork_parent is not None:
                self.fork(seq.fork_parent, seq)
                seq.fork_parent = None
        for seq, token in sampled:
            status = seq.append_token(token.token, token.logprob)
            if status is not None:
                self.finish(seq, status)

    def _chunk(self, num_remaining: int, budget: int) -> int:
        if self.config.enable_chunked_prefill:
            return min(num_remaining, budget)
        return num_remaining if num_remaining <= budget else 0

    def _schedule_running(self, out: SchedulerOutput) -> int:
        kv, running, used, i = self.kv, self.running.items, 0, 0
        while i < len(running):
            seq = running[i]
            n = self._chunk(seq.num_tokens - seq.num_computed_tokens, self.config.max_num_batched_tokens - used)
            if n == 0:
                i += 1
                continue
            while not kv.can_append_slots(seq.seq_id, seq.num_computed_tokens, n):
                needed = kv.num_blocks_to_append(seq.seq_id, seq.num_computed_tokens, n)
                reason = f"{seq.seq_id} needed {needed} blocks, {kv.device.num_free_blocks} free"
                self._preempt(running.pop(), out, reason)
                if seq.status is not RequestStatus.RUNNING:
                    return used
            out.copies += kv.append_slots(seq.seq_id, seq.num_computed_tokens, n)
            out.scheduled.append(ScheduledSequence(seq, n))
            used += n
            i += 1
        return used

    def _num_free_rows(self) -> int:
        """Sequences that may still join the batch: max_num_seqs less the running ones and their forks to come."""
        return self.config.max_num_seqs - sum(seq.max_num_running_seqs for seq in self.running)

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        kv, used, free_rows = self.kv, 0, self._num_free_rows()
        while len(self.swapped) and self.swapped.items[0].max_num_running_seqs <= free_rows:
            seq = self.swapped.items[0]
            n = self._chunk(seq.num_tokens - seq.num_computed_tokens, budget - used)
            extra = kv.num_blocks_to_append(seq.seq_id, seq.num_computed_tokens, n)
            if n == 0 or not kv.can_swap_in([seq.seq_id], extra):
                break
            free_rows -= seq.max_num_running_seqs
            self.swapped.items.pop(0)
            out.swap_in.update(kv.swap_in([seq.seq_id]))
            out.copies += kv.append_slots(seq.seq_id, seq.num_computed_tokens, n)
            self._enqueue(self.running, seq, RequestStatus.RUNNING)
            out.scheduled.append(ScheduledSequence(seq, n))
            used += n
        return used

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        kv, free_rows = self.kv, self._num_free_rows()
        while len(self.waiting) and self.waiting.items[0].max_num_running_seqs <= free_rows:
            seq = self.waiting.items[0]
            num_cached = len(kv.find_cached_prefix(seq.seq_id, seq.token_ids)) * kv.block_size
            n = self._chunk(seq.num_tokens - num_cached, budget)
            if n == 0 or not kv.can_allocate(seq.seq_id, seq.token_ids):
                break
            free_rows -= seq.max_num_running_seqs
            self.waiting.items.pop(0)
            seq.num_computed_tokens = kv.allocate(seq.seq_id, seq.token_ids)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = seq.num_computed_tokens
            self._enqueue(self.running, seq, RequestStatus.RUNNING)
            out.scheduled.append(ScheduledSequence(seq, n))
            out.admitted.append(seq)
            budget -= n

    def _preempt(self, seq: Sequence, out: SchedulerOutput, reason: str) -> None:
        self.num_preemptions += 1
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        if self.config.preemption_mode == "swap" and self.kv.can_swap_out([seq.seq_id]):
            out.swap_out.update(self.kv.swap_out([seq.seq_id]))
            self._enqueue(self.swapped, seq, RequestStatus.SWAPPED)
            out.preempted.append(Preemption(seq, "swap", reason))
        else:
            if self.config.preemption_mode == "swap":
                reason += "; host swap space full, recomputing instead"
            self.kv.free(seq.seq_id)
            seq.num_computed_tokens = 0
            self._enqueue(self.waiting, seq, RequestStatus.WAITING)
            out.preempted.append(Preemption(seq, "recompute", reason))
        logger.info("preempted %s by %s: %s", seq.seq_id, out.preempted[-1].mode, out.preempted[-1].reason)

    def _enqueue(self, queue: _ArrivalQueue, seq: Sequence, status: RequestStatus) -> None:
        seq.status = status
        queue.insert(seq)

    def finish(self, seq: Sequence, status: RequestStatus) -> None:
        """Take a sequence out of its queue and free its blocks (it stopped, or was aborted)."""
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue.items:
                queue.remove(seq)
        if seq.seq_id in self.kv.block_tables:
            self.kv.free(seq.seq_id)
        self.kv.forget(seq.seq_id)
        seq.status = status
