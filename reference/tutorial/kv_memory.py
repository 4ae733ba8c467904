"""How much KV-cache memory a request trace really uses: contiguous preallocation versus paging.

Systems before vLLM reserved one contiguous chunk of slots per request, because the output length is
unknown in advance. At any moment a request's chunk splits into:

    |<------------------ reserved chunk (e.g. max_model_len slots) ------------------>|
    | prompt + tokens so far (USED) | future tokens (RESERVED) | never used (INTERNAL) |

Paging allocates one block of B slots at a time, so the only waste is the unfilled tail of the last block
(< B slots per request), and nothing is reserved.

Two ways to count, both over every decoding step of a trace (at step t of a request with prompt length P,
P + t slots hold tokens):

- `contiguous_usage` / `paged_usage` sum over each request's own steps, ignoring the other requests: how
  much of what a request holds is waste.
- `contiguous_usage_under_load` / `paged_usage_under_load` serve the whole trace from one fixed arena of
  slots, every request arriving at once (a loaded server), and count every slot of the arena at every step
  while some request is still waiting for memory. A free slot at such a moment is EXTERNAL FRAGMENTATION:
  memory that exists but cannot be given to the waiting request. A contiguous allocator leaves holes between
  chunks that are too small for the next chunk; a paged cache leaves fewer free blocks than the next
  prompt needs (at most one prompt's worth, since any free block fits any request).
"""

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from reference.block_manager import BlockManager
from reference.request import Request, SamplingParams
from reference.scheduler import Scheduler, SchedulerConfig


@dataclass(frozen=True)
class KVMemoryUsage:
    """Slot counts summed over all (request, decoding step) pairs, or over all (arena slot, step) pairs."""

    used: int  # slots holding a token's K/V
    reserved: int  # slots set aside for tokens the request will produce later
    internal_fragmentation: int  # slots allocated that no token will ever fill
    external_fragmentation: int = 0  # free slots of the arena that a waiting request cannot get

    @property
    def allocated(self) -> int:
        """Slots held by requests."""
        return self.used + self.reserved + self.internal_fragmentation

    @property
    def total(self) -> int:
        """Every slot counted: held by requests, or free but unusable."""
        return self.allocated + self.external_fragmentation

    @property
    def wasted(self) -> int:
        return self.reserved + self.internal_fragmentation + self.external_fragmentation

    @property
    def utilization(self) -> float:
        """Fraction of the counted slots that hold tokens (the paper reports 20.4-38.2% before vLLM)."""
        return self.used / self.total


def _check(trace: Sequence[tuple[int, int]]) -> None:
    for prompt_len, output_len in trace:
        if prompt_len < 1 or output_len < 1:
            raise ValueError(f"prompt_len and output_len must be >= 1, got ({prompt_len}, {output_len})")


def _steps(trace: Sequence[tuple[int, int]]):
    _check(trace)
    for prompt_len, output_len in trace:
        for t in range(1, output_len + 1):  # after the t-th output token is stored
            yield prompt_len, output_len, prompt_len + t


def contiguous_usage(trace: Sequence[tuple[int, int]], max_model_len: int) -> KVMemoryUsage:
    """Each request preallocates `max_model_len` contiguous slots."""
    used = reserved = fragmented = 0
    for prompt_len, output_len, filled in _steps(trace):
        if prompt_len + output_len > max_model_len:
            raise ValueError(f"prompt_len + output_len = {prompt_len + output_len} exceeds max_model_len={max_model_len}")
        used += filled
        reserved += prompt_len + output_len - filled
        fragmented += max_model_len - prompt_len - output_len
    return KVMemoryUsage(used, reserved, fragmented)


def paged_usage(trace: Sequence[tuple[int, int]], block_size: int) -> KVMemoryUsage:
    """Each request holds just enough blocks of `block_size` slots for its tokens so far."""
    # --8<-- [start:paged_count]
    used = fragmented = 0
    for _, _, filled in _steps(trace):
        used += filled
        fragmented += -filled % block_size  # empty slots in the last block
    return KVMemoryUsage(used, 0, fragmented)
    # --8<-- [end:paged_count]


# ------------------------------------------------------------------------------ under load, one arena
@dataclass(frozen=True)
class Chunk:
    """One request's contiguous reservation in the arena at one step."""

    request: int  # index in the trace
    start: int  # first slot
    size: int  # slots reserved
    filled: int  # slots holding tokens now
    final: int  # slots it will have filled when it finishes (prompt + output)


def _first_fit(taken: list[tuple[int, int]], size: int, arena_slots: int) -> int | None:
    """The lowest start of a hole of at least `size` slots between the taken (start, size) chunks."""
    cursor = 0
    for start, length in sorted(taken):
        if start - cursor >= size:
            return cursor
        cursor = start + length
    return cursor if arena_slots - cursor >= size else None


def first_fit_steps(
    trace: Sequence[tuple[int, int]], reservations: Sequence[int], arena_slots: int
) -> Iterator[tuple[list[Chunk], int]]:
    """Serve a trace from an arena of `arena_slots` slots with a first-fit contiguous allocator.

    Every request arrives at once, in trace order. Before each step, waiting requests are admitted in order
    while the first of them finds a hole of `reservations[i]` slots (the lowest-addressed hole that is big
    enough); the first that does not fit blocks the ones behind it (first come, first served). Then every
    admitted request stores one more token; one that has stored all its output tokens leaves, and its chunk
    becomes a hole.

    Yields:
        (every admitted request's chunk after the step, ordered by address; the number still waiting).
    """
    _check(trace)
    if len(reservations) != len(trace):
        raise ValueError(f"got {len(reservations)} reservations for {len(trace)} requests")
    for (prompt_len, output_len), size in zip(trace, reservations):
        if not prompt_len + output_len <= size <= arena_slots:
            raise ValueError(f"a reservation must hold its request ({prompt_len + output_len} slots) and fit the "
                             f"arena ({arena_slots} slots), got {size}")
    waiting = deque(range(len(trace)))
    running: dict[int, tuple[int, int]] = {}  # request -> (start slot, output tokens stored)
    while waiting or running:
        while waiting:
            taken = [(start, reservations[i]) for i, (start, _) in running.items()]
            start = _first_fit(taken, reservations[waiting[0]], arena_slots)
            if start is None:
                break
            running[waiting.popleft()] = (start, 0)
        running = {i: (start, stored + 1) for i, (start, stored) in running.items()}
        chunks = [Chunk(i, start, reservations[i], trace[i][0] + stored, sum(trace[i]))
                  for i, (start, stored) in running.items()]
        yield sorted(chunks, key=lambda c: c.start), len(waiting)
        running = {i: (start, stored) for i, (start, stored) in running.items() if stored < trace[i][1]}


def contiguous_usage_under_load(
    trace: Sequence[tuple[int, int]], reservations: Sequence[int], arena_slots: int
) -> KVMemoryUsage:
    """Every arena slot at every step of `first_fit_steps` while a request waits: held, or free but unusable."""
    # --8<-- [start:contiguous_count]
    used = reserved = internal = external = 0
    for chunks, num_waiting in first_fit_steps(trace, reservations, arena_slots):
        if num_waiting == 0:  # nobody is short of memory: free slots are idle, not wasted
            continue
        used += sum(c.filled for c in chunks)
        reserved += sum(c.final - c.filled for c in chunks)
        internal += sum(c.size - c.final for c in chunks)
        external += arena_slots - sum(c.size for c in chunks)
    return KVMemoryUsage(used, reserved, internal, external)
    # --8<-- [end:contiguous_count]


def paged_usage_under_load(
    trace: Sequence[tuple[int, int]], block_size: int, num_blocks: int, max_model_len: int
) -> KVMemoryUsage:
    """The same count for a paged cache of `num_blocks` blocks, served by the reference Scheduler.

    The scheduler admits requests first come, first served while their prompt's blocks are free, grows each
    running request one block at a time, and preempts (by recompute) the latest arrival when a block is
    missing. Counted as every step runs while a request waits (as in `first_fit_steps`, which counts the chunks
    of the requests that finish in the step): tokens stored (used), the rest of the held blocks (internal: the
    unfilled tail of each last block), and the free blocks (external).
    """
    _check(trace)
    config = SchedulerConfig(max_num_seqs=max(len(trace), 1), max_num_batched_tokens=max_model_len,
                             max_model_len=max_model_len)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    scheduler = Scheduler(config, bm)
    for i, (prompt_len, output_len) in enumerate(trace):
        params = SamplingParams(max_tokens=output_len, ignore_eos=True)
        scheduler.add_request(Request(str(i), [0] * prompt_len, params, arrival=i))
    used = internal = external = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        new_tokens = {s.request_id: s.num_new_tokens for s in out.scheduled}
        if scheduler.waiting:  # the step's blocks are allocated; count its tokens as stored
            for request in scheduler.running:
                filled = request.num_computed_tokens + new_tokens.get(request.request_id, 0)
                used += filled
                internal += len(bm.block_tables[request.request_id]) * block_size - filled
            external += bm.device.num_free_blocks * block_size
        # The token each request samples once all its tokens are computed: its value does not matter here,
        # since the memory a request holds depends only on how many tokens it has.
        requests = scheduler.requests
        sampled = {request_id: 0 for request_id, n in new_tokens.items()
                   if requests[request_id].num_computed_tokens + n == requests[request_id].num_tokens}
        scheduler.update_from_output(out, sampled)
    return KVMemoryUsage(used, 0, internal, external)
