"""What the scheduler hands the rest of the engine: one step's plan (vLLM v1's core/sched/output.py), and the
state of the KV cache's blocks for statistics and traces."""

from dataclasses import dataclass, field

from jax_engine.sequence import Sequence


@dataclass
class ScheduledSequence:
    """One sequence's share of a step: tokens to compute from num_computed_tokens on, and the blocks they are
    written to (the KV manager's own list, as it stands after this step's allocation)."""

    seq: Sequence
    num_new_tokens: int
    block_table: list[int]


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


@dataclass(frozen=True)
class BlockStats:
    """The KV cache's device blocks as the scheduler sees them, for statistics and traces."""

    num_blocks: int
    num_free_blocks: int  # cached blocks no sequence holds count as free
    num_cached_blocks: int
    num_blocks_without_sharing: int  # what the resident sequences would hold if no block were shared
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens found

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks
