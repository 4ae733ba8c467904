"""What the engine reports about itself: a trace of each step's decisions, and running statistics."""

import time
from dataclasses import dataclass

from jax_engine.core.kv_cache_manager import KVCacheManager
from jax_engine.core.scheduler import Scheduler, SchedulerOutput
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


def step_trace(step: int, out: SchedulerOutput, kv: KVCacheManager) -> StepTrace:
    misses = []
    for seq in out.admitted:
        full_blocks, hit_blocks = (seq.num_tokens - 1) // kv.block_size, seq.num_computed_tokens // kv.block_size
        if hit_blocks < full_blocks or full_blocks == 0:
            misses.append((seq.seq_id, _miss_reason(seq, kv, hit_blocks, full_blocks)))
    return StepTrace(step, [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled],
                     [(p.seq.seq_id, p.mode, p.reason) for p in out.preempted], misses,
                     list(out.copies), kv.device.num_free_blocks)


def _miss_reason(seq: Sequence, kv: KVCacheManager, hit_blocks: int, full_blocks: int) -> str:
    if not kv.enable_prefix_caching:
        return "prefix caching disabled"
    if seq.seq_id in kv.uncached:
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

    def record(self, out: SchedulerOutput, kv: KVCacheManager) -> None:
        now = time.time()
        for s in out.scheduled:
            s.seq.metrics.first_scheduled_time = s.seq.metrics.first_scheduled_time or now
        self.num_steps += 1
        self.seqs_scheduled += len(out.scheduled)
        self.blocks_held += kv.device.num_blocks - kv.device.num_free_blocks
        self.blocks_unshared += sum(len(t) for seq, t in kv.block_tables.items() if seq not in kv.swapped_out)

    def report(self, kv: KVCacheManager, scheduler: Scheduler, runner) -> dict:
        steps = max(self.num_steps, 1)
        return {
            "num_blocks": kv.device.num_blocks,
            "num_free_blocks": kv.device.num_free_blocks,
            "num_cached_blocks": kv.device.num_cached_blocks,
            "kv_cache_usage": kv.usage,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_preemptions": scheduler.num_preemptions,
            "memory_saved_by_sharing": 1 - self.blocks_held / self.blocks_unshared if self.blocks_unshared else 0.0,
            "num_steps": self.num_steps,
            "mean_batch_size": self.seqs_scheduled / steps,
            "mean_kv_cache_usage": self.blocks_held / steps / kv.device.num_blocks,
            "num_programs": runner.programs.num_programs,
            "num_compilations": runner.programs.num_late_compiles,  # after start-up
            "compile_seconds": runner.compile_seconds,
            "num_program_evictions": runner.programs.num_evictions,
        }
