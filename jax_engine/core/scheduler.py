"""Iteration-level scheduler: the reference's policy (reference/scheduler.py), built for speed.

FCFS over waiting / running / swapped queues (or priority first: reference/scheduling_policy.py); running
sequences first, earliest arrival first; when blocks run out the latest-arrived running sequence is preempted
(recompute or swap); swapped sequences come back before new ones are admitted; nothing is admitted in a step
that preempted.

One thing the reference has no need of: a sequence may fork (the other samples of `n > 1`, the first beams of
a beam search), so it is admitted only when it and its forks to come fit under max_num_seqs, as vLLM v0 admits a
group by its `get_max_num_running_seqs()`. Admitting by the running count alone let a full batch fork past
max_num_seqs, into step shapes start-up never compiled. For the reference's one-sequence requests the rules
are the same.
"""

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from jax_engine.core.arrival_queue import ArrivalQueue
from jax_engine.core.kv_cache_manager import CacheConfig, KVCacheManager
from jax_engine.core.scheduler_output import BlockStats, Preemption, ScheduledSequence, SchedulerOutput
from jax_engine.sequence import Sequence
from jax_engine.structured_output.grammar import GrammarError
from reference.request import RequestStatus
from reference.scheduler import SchedulerConfig
from reference.scheduling_policy import check_priority

logger = logging.getLogger(__name__)

if TYPE_CHECKING:  # the sampler imports jax; the scheduler is host bookkeeping only
    from jax_engine.beam_search import BeamUpdate
    from jax_engine.sample.sampler import SampledToken


class Scheduler:
    """Decides, step by step, which sequences run; owns the queues and the KV-cache manager, which nobody else
    touches: the step's block tables travel in its output, statistics come from its methods."""

    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, max_loras: int = 0) -> None:
        self.config = config
        self.max_loras = max_loras  # most LoRA adapters among the running sequences (the device's slots)
        self.kv = KVCacheManager.from_config(cache_config)
        self.waiting, self.running, self.swapped = ArrivalQueue(), ArrivalQueue(), ArrivalQueue()
        self._queues = {RequestStatus.WAITING: self.waiting, RequestStatus.RUNNING: self.running,
                        RequestStatus.SWAPPED: self.swapped}  # where a sequence of each status waits
        self.seqs: dict[str, Sequence] = {}  # every unfinished sequence, by seq_id
        self.num_preemptions = 0

    def add_request(self, seqs: list[Sequence], cache_salt: str | None = None) -> None:
        """Queue a request: its first sequence waits to be scheduled, the others (parallel samples) fork from it
        later. `cache_salt` (vLLM's field) and the LoRA adapter root its prefix-cache hashes."""
        first = seqs[0]
        check_priority(first.priority, self.config.policy)
        if first.skip_reading_prefix_cache:
            self.kv.skip_reading_cache(first.seq_id)
        lora_name = None if first.lora_request is None else first.lora_request.lora_name
        if cache_salt is not None or lora_name is not None:
            self.kv.set_cache_salt(first.seq_id, cache_salt, lora_name)
        self.seqs.update((seq.seq_id, seq) for seq in seqs)
        self._enqueue(self.waiting, first, RequestStatus.WAITING)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start `child` as a copy of running `parent`: same tokens and progress, every block shared."""
        child.adopt(parent)
        parent.num_pending_forks = max(0, parent.num_pending_forks - 1)
        self.kv.fork(parent.seq_id, child.seq_id)
        self.seqs[child.seq_id] = child
        self._enqueue(self.running, child, RequestStatus.RUNNING)

    def has_unfinished_requests(self) -> bool:
        return bool(len(self.waiting) or len(self.running) or len(self.swapped))

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

    def update_from_output(self, out: SchedulerOutput, sampled: list[tuple[Sequence, "SampledToken"]],
                           beam_updates: Iterable["BeamUpdate"] = ()) -> list[tuple[Sequence, "SampledToken"]]:
        """After the model ran `out`: the one place where sequences grow. Returns the tokens appended.

        In order: computed counts advance and full blocks enter the prefix cache; parallel samples whose
        parent's prompt is now computed fork from it (`fork_parent`), sharing every block; each sampled token
        is appended and its grammar advanced; then each beam search's update (forks, prunes, appends) is
        applied. `sampled` may hold several tokens of one sequence, in order: those after a stop are dropped.
        Stop tokens, EOS and max_tokens finish a sequence and free its blocks; a token its grammar rejects
        ends it with FINISHED_ERROR (the caller ends the rest of its request). Stop strings, which need the
        text, are the output processor's: it ends those sequences through `finish_requests`.
        """
        self.update_computed(out)
        return self.append_sampled(out, sampled, beam_updates)

    def update_computed(self, out: SchedulerOutput) -> None:
        """The first half of update_from_output, which async scheduling runs before the step's tokens are known."""
        for s in out.scheduled:
            if s.seq.status.is_finished:  # failed while this step ran: it holds no blocks any more
                continue
            s.seq.num_computed_tokens += s.num_new_tokens - len(s.seq.spec_token_ids)  # drafts: in _roll_back
            self.kv.cache_full_blocks(s.seq.seq_id, s.seq.all_token_ids, s.seq.num_computed_tokens)

    def append_sampled(self, out: SchedulerOutput, sampled: list[tuple[Sequence, "SampledToken"]],
                       beam_updates: Iterable["BeamUpdate"] = ()) -> list[tuple[Sequence, "SampledToken"]]:
        """The second half of update_from_output: forks, appended tokens, drafts rolled back, beams."""
        for seq, _ in sampled:  # fork before anyone appends, so children copy the parent's prompt alone
            if seq.fork_parent is not None:
                self.fork(seq.fork_parent, seq)
                seq.fork_parent = None
        appended = [(seq, token) for seq, token in sampled if self._append(seq, token.token, token.logprob)]
        for s in out.scheduled:
            if s.seq.spec_token_ids:
                self._roll_back(s.seq)
        for update in beam_updates:
            self._apply_beam_update(update)
        return appended

    def _roll_back(self, seq: Sequence) -> None:
        """After a verification step: every emitted token but the last is computed; blocks full of verified
        tokens enter the prefix cache, and those only the rejected drafts were written to are freed."""
        seq.spec_token_ids = []
        seq.num_computed_tokens = seq.num_tokens - 1
        if seq.seq_id in self.kv.block_tables:  # not finished by the tokens it emitted
            self.kv.cache_full_blocks(seq.seq_id, seq.all_token_ids, seq.num_computed_tokens)
            self.kv.trim(seq.seq_id, seq.num_computed_tokens)

    def _append(self, seq: Sequence, token: int, logprob: float) -> bool:
        """Append one token, advance the sequence's grammar, finish it if the token ends it. False when the
        sequence had already finished (the token is dropped)."""
        if seq.status.is_finished:
            return False
        status = seq.append_token(token, logprob)
        if seq.grammar is not None:
            try:
                seq.grammar.accept(token)
            except RuntimeError as error:
                logger.error("request %s failed: %s", seq.request_id, str(error)[:300])
                status = RequestStatus.FINISHED_ERROR
                if isinstance(error, GrammarError):  # the request's doing: its output says why
                    seq.stop_reason = str(error)
        if status is not None:
            self._finish(seq, status)
        return True

    def _apply_beam_update(self, update: "BeamUpdate") -> None:
        for parent, child in update.forks:  # fork before anyone appends, so children copy the parent's tokens
            self.fork(parent, child)
        for beam in update.pruned:
            self._finish(beam, RequestStatus.FINISHED_ABORTED)
        for beam, token, logprob in update.appends:
            self._append(beam, token, logprob)

    def finish_requests(self, seq_ids: Iterable[str], status: RequestStatus) -> None:
        """End sequences from outside the step (aborts, stop strings, faults): out of their queues, blocks freed.
        Unknown or finished ids are ignored (vLLM's name)."""
        for seq_id in seq_ids:
            if (seq := self.seqs.get(seq_id)) is not None:
                self._finish(seq, status)

    def _finish(self, seq: Sequence, status: RequestStatus) -> None:
        queue = self._queues.get(seq.status)
        if queue is not None and seq in queue.items:  # a parallel sample not forked yet waits in no queue
            queue.remove(seq)
        if seq.seq_id in self.kv.block_tables:
            self.kv.free(seq.seq_id)
        self.kv.forget(seq.seq_id)
        self.seqs.pop(seq.seq_id, None)
        seq.status = status

    def _chunk(self, num_remaining: int, budget: int) -> int:
        if self.config.enable_chunked_prefill:
            return min(num_remaining, budget)
        return num_remaining if num_remaining <= budget else 0

    def _schedule_running(self, out: SchedulerOutput) -> int:
        kv, running, used, i = self.kv, self.running.items, 0, 0
        while i < len(running):
            seq = running[i]
            budget = self.config.max_num_batched_tokens - used
            n = self._chunk(seq.num_tokens - seq.num_computed_tokens, budget)
            if n == 0:
                i += 1
                continue
            n = self._with_drafts(seq, n, budget)
            while not kv.can_append_slots(seq.seq_id, seq.num_computed_tokens, n):
                needed = kv.num_blocks_to_append(seq.seq_id, seq.num_computed_tokens, n)
                reason = f"{seq.seq_id} needed {needed} blocks, {kv.device.num_free_blocks} free"
                self._preempt(running.pop(), out, reason)
                if seq.status is not RequestStatus.RUNNING:
                    return used
            out.copies += kv.append_slots(seq.seq_id, seq.num_computed_tokens, n)
            out.scheduled.append(ScheduledSequence(seq, n, kv.block_tables[seq.seq_id]))
            used += n
            i += 1
        return used

    def _with_drafts(self, seq: Sequence, n: int, budget: int) -> int:
        """A decoding sequence's tokens this step with its drafts after them, as lookahead: as many drafts as the
        token budget holds, and none when the free blocks cannot hold them (the reference's rule)."""
        del seq.spec_token_ids[max(0, budget - n):]
        if not self.kv.can_append_slots(seq.seq_id, seq.num_computed_tokens, n + len(seq.spec_token_ids)):
            seq.spec_token_ids = []
        return n + len(seq.spec_token_ids)

    def _num_free_rows(self) -> int:
        """Sequences that may still join the batch: max_num_seqs less the running ones and their forks to come."""
        return self.config.max_num_seqs - sum(seq.max_num_running_seqs for seq in self.running)

    # --8<-- [start:adapter_fits]
    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether `seq` may run beside the running sequences: its LoRA adapter runs
        already, or a device slot is left for it (max_loras). One that does not fit
        waits; the others may go ahead of it."""
        if seq.lora_request is None:
            return True
        running = {s.lora_request.lora_int_id for s in self.running if s.lora_request}
        adapter = seq.lora_request.lora_int_id
        return adapter in running or len(running) < self.max_loras
    # --8<-- [end:adapter_fits]

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        kv, used, free_rows = self.kv, 0, self._num_free_rows()
        while len(self.swapped) and self.swapped.items[0].max_num_running_seqs <= free_rows:
            seq = self.swapped.items[0]
            if not self._adapter_fits(seq):
                break
            n = self._chunk(seq.num_tokens - seq.num_computed_tokens, budget - used)
            extra = kv.num_blocks_to_append(seq.seq_id, seq.num_computed_tokens, n)
            if n == 0 or not kv.can_swap_in([seq.seq_id], extra):
                break
            free_rows -= seq.max_num_running_seqs
            self.swapped.items.pop(0)
            out.swap_in.update(kv.swap_in([seq.seq_id]))
            out.copies += kv.append_slots(seq.seq_id, seq.num_computed_tokens, n)
            self._enqueue(self.running, seq, RequestStatus.RUNNING)
            out.scheduled.append(ScheduledSequence(seq, n, kv.block_tables[seq.seq_id]))
            used += n
        return used

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        kv, free_rows, i = self.kv, self._num_free_rows(), 0
        while i < len(self.waiting) and self.waiting.items[i].max_num_running_seqs <= free_rows:
            seq = self.waiting.items[i]
            if not self._adapter_fits(seq):  # waits for a slot, without holding up the queue
                i += 1
                continue
            num_cached = len(kv.find_cached_prefix(seq.seq_id, seq.token_ids)) * kv.block_size
            n = self._chunk(seq.num_tokens - num_cached, budget)
            if n == 0 or not kv.can_allocate(seq.seq_id, seq.token_ids):
                break
            free_rows -= seq.max_num_running_seqs
            self.waiting.items.pop(i)
            seq.num_computed_tokens = kv.allocate(seq.seq_id, seq.token_ids)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = seq.num_computed_tokens
            self._enqueue(self.running, seq, RequestStatus.RUNNING)
            out.scheduled.append(ScheduledSequence(seq, n, kv.block_tables[seq.seq_id]))
            out.admitted.append(seq)
            budget -= n

    def _preempt(self, seq: Sequence, out: SchedulerOutput, reason: str) -> None:
        self.num_preemptions += 1
        seq.spec_token_ids = []  # drafts are only verified right after the token they follow
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

    def _enqueue(self, queue: ArrivalQueue, seq: Sequence, status: RequestStatus) -> None:
        seq.status = status
        queue.insert(seq)

    # ------------------------------------------------------------------------------- statistics
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (nothing forgotten) while sequences hold blocks."""
        return self.kv.reset_prefix_cache()

    def block_stats(self) -> BlockStats:
        kv = self.kv
        return BlockStats(kv.device.num_blocks, kv.device.num_free_blocks, kv.device.num_cached_blocks,
                          kv.num_blocks_without_sharing, kv.prefix_cache_queries, kv.prefix_cache_hits)
