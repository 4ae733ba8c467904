"""What the engine reports about itself: a trace of each step's decisions, and running statistics."""

import time
from dataclasses import dataclass

from jax_engine.core.kv_cache_manager import KVCacheManager
from jax_engine.core.scheduler import Scheduler
from jax_engine.core.scheduler_output import BlockStats, SchedulerOutput
from jax_engine.sequence import Sequence


@dataclass
class StepTrace:
    """What one step did, for tests and curious users (see LLMEngine.enable_trace)."""

    step: int
    scheduled: list[tuple[str, int]]  # (sequence id, tokens computed)
    preempted: list[tuple[str, str, str]]  # (sequence id, "recompute" | "swap", reason)
    cache_misses: list[tuple[str, str]]  # (sequence id, why its prompt was not (fully) found in the cache)
    copies: list[tuple[int, int]]  # copy-on-write block copies (src, dst)
    num_free_blocks: int


def step_trace(step: int, out: SchedulerOutput, scheduler: Scheduler) -> StepTrace:
    misses = [(seq.seq_id, reason) for seq in out.admitted if (reason := cache_miss(scheduler.kv, seq)) is not None]
    return StepTrace(step, [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled],
                     [(p.seq.seq_id, p.mode, p.reason) for p in out.preempted], misses,
                     list(out.copies), scheduler.block_stats().num_free_blocks)


def cache_miss(kv: KVCacheManager, seq: Sequence) -> str | None:
    """Why an admitted sequence's prompt was not (fully) found in the prefix cache; None if it was."""
    block_size = kv.block_size
    full_blocks, hit_blocks = (seq.num_tokens - 1) // block_size, seq.num_computed_tokens // block_size
    if hit_blocks >= full_blocks > 0:
        return None
    if not kv.enable_prefix_caching:
        return "prefix caching disabled"
    if not kv.reads_cache(seq.seq_id):
        return "prompt logprobs need every prompt token computed"
    if full_blocks == 0:
        return "prefix shorter than one block"
    return f"{hit_blocks} of {full_blocks} full blocks found in the cache"


class EngineStats:
    """Sums over steps (batch sizes, blocks held, blocks held without sharing) and when each sequence first ran."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.seqs_scheduled = 0
        self.blocks_held = 0
        self.blocks_unshared = 0

    def record(self, out: SchedulerOutput, blocks: BlockStats) -> None:
        now = time.time()
        for s in out.scheduled:
            s.seq.metrics.first_scheduled_time = s.seq.metrics.first_scheduled_time or now
        self.num_steps += 1
        self.seqs_scheduled += len(out.scheduled)
        self.blocks_held += blocks.num_blocks - blocks.num_free_blocks
        self.blocks_unshared += blocks.num_blocks_without_sharing

    def report(self, scheduler: Scheduler, runner, speculator=None) -> dict:
        """The statistics; programs are counted over the runner's and a draft model's (speculative decoding)."""
        steps, blocks = max(self.num_steps, 1), scheduler.block_stats()
        spec_decode = {} if speculator is None else {"spec_decode": speculator.stats()}
        programs = [r.programs for r in (runner, *(speculator.runners if speculator else []))]
        return spec_decode | {
            "num_blocks": blocks.num_blocks,
            "num_free_blocks": blocks.num_free_blocks,
            "num_cached_blocks": blocks.num_cached_blocks,
            "kv_cache_usage": blocks.usage,
            "prefix_cache_queries": blocks.prefix_cache_queries,
            "prefix_cache_hits": blocks.prefix_cache_hits,
            "num_preemptions": scheduler.num_preemptions,
            "memory_saved_by_sharing": 1 - self.blocks_held / self.blocks_unshared if self.blocks_unshared else 0.0,
            "num_steps": self.num_steps,
            "mean_batch_size": self.seqs_scheduled / steps,
            "mean_kv_cache_usage": self.blocks_held / steps / blocks.num_blocks,
            "num_programs": sum(p.num_programs for p in programs),
            "num_compilations": sum(p.num_late_compiles for p in programs),  # after start-up
            "compile_seconds": sum(p.late_compile_seconds for p in programs),
            "num_program_evictions": sum(p.num_evictions for p in programs),
        }
