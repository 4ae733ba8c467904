"""The serving systems the paper compares, each driven one step at a time by simulate.py.

    vllm         the oracle's Scheduler over its BlockManager: blocks of 16 tokens allocated as sequences grow,
                 preemption when they run out (reference/scheduler.py, unchanged)
    orca-oracle  the same iteration-level scheduling, but each request's KV cache is reserved whole and
    orca-pow2    contiguously when it is admitted (blocks of one token): its prompt plus its true output length
    orca-max     (an oracle no real system has), the next power of two above it, or max_model_len; nothing is
                 ever preempted, and the reservation's unused tail is the paper's internal fragmentation
    ft           FasterTransformer: static batching, a batch runs until its longest request ends, each
                 request reserving max_model_len

(The paper's Section 6.1 defines the baselines.)
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from reference.block_manager import BlockManager
from reference.request import Request, RequestStatus, SamplingParams
from reference.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from simulator.buddy import BuddySpace
from simulator.cost_model import CostModel
from simulator.workload import TraceRequest

SYSTEMS = ("vllm", "orca-oracle", "orca-pow2", "orca-max", "ft")


@dataclass
class Step:
    """One simulated step: how long it took and what it did."""

    duration_s: float
    num_batched: int  # requests that computed tokens in it
    first_tokens: list[int] = field(default_factory=list)  # requests whose first output token it produced
    finished: list[int] = field(default_factory=list)
    kv_usage: float = 0.0  # fraction of the KV cache held after it


class SchedulerSystem:
    """A system built on the oracle's Scheduler: it schedules, the cost model times the step, and every
    sequence that completes its tokens emits one."""

    def __init__(self, scheduler: Scheduler, cost: CostModel, paged: bool) -> None:
        self.scheduler, self.cost, self.paged = scheduler, cost, paged

    def add(self, index: int, request: TraceRequest) -> None:
        params = SamplingParams(temperature=0, max_tokens=request.output_len, ignore_eos=True)
        self.scheduler.add_request(Request(str(index), [0] * request.prompt_len, params, arrival=index))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def step(self) -> Step:
        scheduler, requests = self.scheduler, self.scheduler.requests
        out = scheduler.schedule()
        if not out.scheduled:
            raise RuntimeError("no request can be scheduled: the KV cache cannot hold the next one")
        chunks = [(requests[s.request_id].num_computed_tokens, s.num_new_tokens) for s in out.scheduled]
        duration = self.cost.step_time(chunks, self.paged) + self._swap_time(out)
        before = {s.request_id: len(requests[s.request_id].output_token_ids) for s in out.scheduled}
        finished = scheduler.update_from_output(out, dict.fromkeys(before, 0))
        first = [int(r) for r, n in before.items() if n == 0 and requests[r].output_token_ids]
        return Step(duration, len(out.scheduled), first, [int(r.request_id) for r in finished], self._kv_usage())

    def _kv_usage(self) -> float:
        """The fraction of the KV cache held: blocks, or a contiguous cache's reserved slots."""
        space = getattr(self.scheduler, "space", None)
        if space is not None:
            return 1 - space.num_free_slots / space.num_slots
        device = self.scheduler.block_manager.device
        return 1 - device.num_free_blocks / device.num_blocks

    def _swap_time(self, out: SchedulerOutput) -> float:
        moved = len(out.swap_in) + len(out.swap_out)
        return self.cost.swap_time(moved, self.scheduler.block_manager.block_size) if moved else 0.0


class ReservingScheduler(Scheduler):
    """Orca's admission: a waiting request starts only if its whole reservation (prompt + `reserve(request)`
    tokens) fits in one free range of the contiguous cache of `num_slots` tokens, and takes it at once, so a
    running request never needs more. (The oracle's block manager keeps the tables the Scheduler reads; the
    contiguous space decides what fits.)"""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, reserve: Callable[[Request], int],
                 num_slots: int) -> None:
        super().__init__(config, block_manager)
        self.reserve = reserve
        self.space = BuddySpace(num_slots)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            n = self._chunk(request.num_tokens, budget)
            reservation = request.token_ids + [0] * self.reserve(request)
            if n == 0 or not self.space.fits(len(reservation)):
                break
            self.waiting.pop(0)
            self.space.allocate(request.request_id, len(reservation))
            request.num_computed_tokens = bm.allocate(request.request_id, reservation, read_cache=False)
            self._enqueue(self.running, request, RequestStatus.RUNNING)
            self._add_scheduled(out, request, n)
            budget -= n

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.request_id in self.space.held:
            self.space.release(request.request_id)
        super()._finish(request, status)


def orca_reservation(policy: str, max_model_len: int) -> Callable[[Request], int]:
    """Output tokens Orca reserves for a request: its true output length, the next power of two, or up to
    max_model_len."""
    def reserve(request: Request) -> int:
        true_len, room = request.sampling_params.max_tokens, max_model_len - len(request.prompt_token_ids)
        return {"oracle": true_len, "pow2": min(1 << (true_len - 1).bit_length(), room), "max": room}[policy]

    return reserve


class StaticBatchingSystem:
    """FasterTransformer: when no batch runs, the waiting requests (up to `max_batch`, and as many as fit with
    max_model_len reserved each) form one; it computes their prompts in one step, then decodes every row until
    the longest request ends. Requests that arrive meanwhile wait for the next batch."""

    def __init__(self, cost: CostModel, max_batch: int, max_model_len: int) -> None:
        self.cost, self.max_model_len = cost, max_model_len
        self.batch_limit = min(max_batch, cost.kv_cache_tokens // max_model_len)
        if self.batch_limit < 1:
            raise ValueError(f"the KV cache ({cost.kv_cache_tokens} tokens) cannot reserve max_model_len "
                             f"({max_model_len}) tokens for even one request")
        self.waiting: deque[tuple[int, TraceRequest]] = deque()
        self.batch: list[tuple[int, TraceRequest]] = []
        self.produced = 0  # tokens each row of the batch has emitted
        self.num_preemptions = 0

    def add(self, index: int, request: TraceRequest) -> None:
        self.waiting.append((index, request))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.batch)

    def step(self) -> Step:
        if not self.batch:  # a new batch: its prompts, and every row's first token
            self.batch = [self.waiting.popleft() for _ in range(min(self.batch_limit, len(self.waiting)))]
            self.produced = 1
            chunks = [(0, r.prompt_len) for _, r in self.batch]
            first = [i for i, _ in self.batch]
        else:  # every row decodes, those whose output is complete too (their slots are padding)
            chunks = [(r.prompt_len + self.produced - 1, 1) for _, r in self.batch]
            self.produced, first = self.produced + 1, []
        finished = [i for i, r in self.batch if r.output_len == self.produced]
        used = len(self.batch) * self.max_model_len / self.cost.kv_cache_tokens
        step = Step(self.cost.step_time(chunks, paged=False), len(self.batch), first, finished, used)
        if self.produced >= max(r.output_len for _, r in self.batch):
            self.batch = []
        return step


def make_system(name: str, cost: CostModel, max_num_seqs: int = 256, block_size: int = 16,
                swap_space_bytes: float = 0.0, preemption_mode: str = "recompute"):
    """The system `name` (one of SYSTEMS) over the KV cache the cost model leaves room for."""
    max_model_len = cost.model.max_model_len
    if cost.kv_cache_tokens < block_size:
        raise ValueError(f"{cost.model.name}'s weights ({cost.weight_bytes / 2**30:.1f} GiB per device) leave no room "
                         f"for a KV cache on {cost.hardware.name} at gpu_memory_utilization "
                         f"{cost.gpu_memory_utilization}: add devices (tensor parallelism)")
    if name == "ft":
        return StaticBatchingSystem(cost, max_num_seqs, max_model_len)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max(max_model_len, 2048),
                             max_model_len=max_model_len, preemption_mode=preemption_mode)
    if name == "vllm":
        blocks = BlockManager(cost.kv_cache_tokens // block_size, block_size,
                              int(swap_space_bytes // (cost.kv_bytes_per_token * block_size)),
                              enable_prefix_caching=False)
        return SchedulerSystem(Scheduler(config, blocks), cost, paged=True)
    if name.startswith("orca-") and name[5:] in ("oracle", "pow2", "max"):
        # The contiguous space decides what fits; the tables only need room for each reservation's last block.
        blocks = BlockManager(cost.kv_cache_tokens // block_size + max_num_seqs, block_size,
                              enable_prefix_caching=False)
        scheduler = ReservingScheduler(config, blocks, orca_reservation(name[5:], max_model_len),
                                       cost.kv_cache_tokens)
        return SchedulerSystem(scheduler, cost, paged=False)
    raise ValueError(f"system must be one of {list(SYSTEMS)}, got {name!r}")
