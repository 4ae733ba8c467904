"""Iteration-level scheduling (continuous batching) with preemption.

Every engine step asks the scheduler which requests run and how many tokens each computes. Requests join
and leave the batch between steps, not between batches. The policy, in order:

1. RUNNING requests, earliest arrival first, each get their next tokens (a decode token, or the next
   prefill chunk). When the cache has no free block for one of them, the *latest-arrived* running
   request is preempted, repeatedly, until the blocks fit (it may be the request itself):

    - "recompute": its blocks are freed and it returns to WAITING; later its prompt and the tokens it
      already generated are recomputed as one prefill;
    - "swap": its blocks are copied to the host pool and it waits in SWAPPED.

2. If nobody was preempted this step, SWAPPED requests come back, earliest first.
3. If nobody was preempted and nothing is swapped out, WAITING requests are admitted, strictly FCFS.

"Earliest arrival" is the "fcfs" policy's order; the "priority" policy puts a request's priority first
(scheduling_policy.py).

Budgets: at most `max_num_seqs` running requests and `max_num_batched_tokens` tokens per step. Without
chunked prefill a prompt is computed whole or not at all; with it, a long prompt is split across steps.
"""

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

from reference.block_manager import BlockManager
from reference.request import Request, RequestStatus
from reference.scheduling_policy import SCHEDULING_POLICIES, check_priority, queue_order

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's budgets and policies, checked when the config is made."""

    max_num_seqs: int = 256  # the most requests running at once (rows of a decode batch)
    max_num_batched_tokens: int = 2048  # the most tokens computed in one step, prefill and decode together
    max_model_len: int = 2048  # the longest a request may grow, prompt plus generated tokens
    # Without chunked prefill a prompt is computed whole or waits, so the token budget must hold max_model_len.
    enable_chunked_prefill: bool = False
    # "swap" falls back to "recompute" when the host pool is full too.
    preemption_mode: str = "recompute"
    # "fcfs": earliest arrival first; "priority": lowest priority value first, then earliest arrival.
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) without chunked prefill, or a long prompt could never be scheduled"
            )


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: which tokens it computes, and the blocks they are written to."""

    request_id: str
    num_new_tokens: int  # tokens to compute this step, from position num_computed_tokens on
    block_table: list[int]


@dataclass
class SchedulerOutput:
    """What one step runs, and the block copies the KV cache must make before it runs."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    swap_out: dict[int, int] = field(default_factory=dict)  # device block -> host block
    swap_in: dict[int, int] = field(default_factory=dict)  # host block -> device block
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Decides, step by step, which requests run; owns the waiting / running / swapped queues."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------------- requests in and out
    def add_request(self, request: Request) -> None:
        """Queue a request; raise ValueError if it could never fit in the model or the cache."""
        limit = self.config.max_model_len
        if request.sampling_params.max_tokens is None:  # generate until the model's length limit
            room = max(1, limit - len(request.prompt_token_ids))
            request.sampling_params = dataclasses.replace(request.sampling_params, max_tokens=room)
        if request.max_num_tokens > limit:
            raise ValueError(
                f"prompt ({len(request.prompt_token_ids)} tokens) + max_tokens "
                f"({request.sampling_params.max_tokens}) = {request.max_num_tokens} exceeds max_model_len={limit}"
            )
        bm = self.block_manager
        if bm.num_blocks_for(request.max_num_tokens) > bm.device.num_blocks:
            raise ValueError(
                f"request {request.request_id!r} needs {bm.num_blocks_for(request.max_num_tokens)} blocks "
                f"but the KV cache has only num_blocks={bm.device.num_blocks}"
            )
        check_priority(request.priority, self.config.policy)
        assert request.request_id not in self.requests, f"duplicate request_id {request.request_id!r}"
        self.requests[request.request_id] = request
        self._enqueue(self.waiting, request, RequestStatus.WAITING)

    def abort_request(self, request_id: str) -> None:
        """Finish a request as FINISHED_ABORTED and free its blocks; a finished or unknown id is ignored."""
        request = self.requests.get(request_id)
        if request is not None and not request.status.is_finished:
            self._finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still waiting, running or swapped out."""
        return bool(self.waiting or self.running or self.swapped)

    # ------------------------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        """Decide what the next step runs (the module's policy), and reserve the blocks it writes to.

        The block tables in the output already hold every slot the step writes; the KV cache makes the
        output's copies before the model runs, and `update_from_output` follows once it has run.
        """
        # --8<-- [start:schedule]
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens - self._schedule_running(out)
        if not out.preempted:
            budget -= self._schedule_swapped(out, budget)
            if not self.swapped:
                self._schedule_waiting(out, budget)
        return out
        # --8<-- [end:schedule]

    def _chunk(self, num_remaining: int, budget: int) -> int:
        """How many of a request's remaining tokens fit in this step's token budget."""
        if self.config.enable_chunked_prefill:
            return min(num_remaining, budget)
        return num_remaining if num_remaining <= budget else 0

    def _schedule_running(self, out: SchedulerOutput) -> int:
        bm, used, i = self.block_manager, 0, 0
        while i < len(self.running):
            request = self.running[i]
            budget = self.config.max_num_batched_tokens - used
            n = self._chunk(request.num_tokens - request.num_computed_tokens, budget)
            if n == 0:
                i += 1
                continue
            n = self._with_drafts(request, n, budget)
            # --8<-- [start:schedule_running]
            while not bm.can_append_slots(request.request_id, request.num_computed_tokens, n):
                self._preempt(self.running.pop(), out)  # the queue's last goes first
                if request.status is not RequestStatus.RUNNING:
                    return used
            out.copies += bm.append_slots(request.request_id, request.num_computed_tokens, n)
            self._add_scheduled(out, request, n)
            # --8<-- [end:schedule_running]
            used += n
            i += 1
        return used

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        bm, used = self.block_manager, 0
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            n = self._chunk(request.num_tokens - request.num_computed_tokens, budget - used)
            extra = bm.num_blocks_to_append(request.request_id, request.num_computed_tokens, n)
            if n == 0 or not bm.can_swap_in([request.request_id], extra):
                break
            self.swapped.pop(0)
            out.swap_in.update(bm.swap_in([request.request_id]))
            out.copies += bm.append_slots(request.request_id, request.num_computed_tokens, n)
            self._enqueue(self.running, request, RequestStatus.RUNNING)
            self._add_scheduled(out, request, n)
            used += n
        return used

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            read_cache = not request.skip_reading_prefix_cache
            num_cached = len(bm.find_cached_prefix(request.token_ids, read_cache=read_cache)) * bm.block_size
            n = self._chunk(request.num_tokens - num_cached, budget)
            if n == 0 or not bm.can_allocate(request.token_ids, read_cache=read_cache):
                break
            self.waiting.pop(0)
            request.num_computed_tokens = bm.allocate(request.request_id, request.token_ids, read_cache=read_cache)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = request.num_computed_tokens
            self._enqueue(self.running, request, RequestStatus.RUNNING)
            self._add_scheduled(out, request, n)
            budget -= n

    # ----------------------------------------------------------------------------------- helpers
    # --8<-- [start:with_drafts]
    def _with_drafts(self, request: Request, n: int, budget: int) -> int:
        """A decoding request's tokens this step with its drafts after them, as lookahead:
        as many drafts as the token budget holds, and none when the free blocks cannot hold
        them: a draft never preempts its own request."""
        del request.spec_token_ids[max(0, budget - n):]
        wanted = n + len(request.spec_token_ids)
        if request.spec_token_ids and not self.block_manager.can_append_slots(
                request.request_id, request.num_computed_tokens, wanted):
            request.spec_token_ids = []
        return n + len(request.spec_token_ids)
    # --8<-- [end:with_drafts]

    def _add_scheduled(self, out: SchedulerOutput, request: Request, n: int) -> None:
        table = self.block_manager.block_table(request.request_id)
        out.scheduled.append(ScheduledRequest(request.request_id, n, table))

    # --8<-- [start:preempt]
    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.num_preemptions += 1
        request.spec_token_ids = []  # drafts are verified only right after their token
        out.preempted.append(request.request_id)
        out.scheduled = [s for s in out.scheduled if s.request_id != request.request_id]
        bm = self.block_manager
        if self.config.preemption_mode == "swap" and bm.can_swap_out([request.request_id]):
            out.swap_out.update(bm.swap_out([request.request_id]))
            self._enqueue(self.swapped, request, RequestStatus.SWAPPED)
        else:  # recompute, or swap with a full host pool
            bm.free(request.request_id)
            request.num_computed_tokens = 0
            self._enqueue(self.waiting, request, RequestStatus.WAITING)
    # --8<-- [end:preempt]

    def _enqueue(self, queue: list[Request], request: Request, status: RequestStatus) -> None:
        """Insert keeping the policy's order, so every queue is served earliest arrival (highest priority)
        first."""
        request.status = status
        queue.append(request)
        queue.sort(key=queue_order)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        for queue in (self.waiting, self.running, self.swapped):
            if request in queue:
                queue.remove(request)
        if request.request_id in self.block_manager.block_tables:
            self.block_manager.free(request.request_id)
        request.status = status

    # -------------------------------------------------------------------------- after the model ran
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int | list[int]],
                           eos_token_ids: Iterable[int] = ()) -> list[Request]:
        """Advance computed counts, append what each request whose tokens are now all computed emitted, and
        free the requests that finished, which it returns.

        A request emits one sampled token, or with drafts a list: the drafts the target accepted, then its
        own token. Tokens after a stop are dropped. The rejected drafts are rolled back: the computed count
        goes back to the verified tokens, only blocks full of those enter the prefix cache, and blocks that
        held nothing else are freed.
        """
        finished = []
        for scheduled in out.scheduled:
            request = self.requests[scheduled.request_id]
            request.num_computed_tokens += scheduled.num_new_tokens - len(request.spec_token_ids)  # drafts: below
            self.block_manager.cache_full_blocks(request.request_id, request.token_ids, request.num_computed_tokens)
            if request.num_computed_tokens < request.num_tokens:
                continue  # mid-prefill: nothing to sample yet
            emitted, num_drafts, request.spec_token_ids = sampled[request.request_id], len(request.spec_token_ids), []
            for token in emitted if isinstance(emitted, list) else [emitted]:
                request.output_token_ids.append(token)
                status = request.stop_status(tuple(eos_token_ids))
                if status is not None:
                    break
            if status is not None:
                self._finish(request, status)
                finished.append(request)
            elif num_drafts:
                self._roll_back(request)
        return finished

    # --8<-- [start:roll_back]
    def _roll_back(self, request: Request) -> None:
        """After verifying drafts: every emitted token but the last is computed (the
        accepted drafts and the token before them); blocks full of them enter the prefix
        cache, and blocks that held only rejected drafts go back to the pool."""
        request.num_computed_tokens = request.num_tokens - 1
        self.block_manager.cache_full_blocks(request.request_id, request.token_ids,
                                             request.num_computed_tokens)
        self.block_manager.trim(request.request_id, request.num_computed_tokens)
    # --8<-- [end:roll_back]
