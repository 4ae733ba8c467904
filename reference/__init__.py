"""The NumPy reference oracle of a PagedAttention serving engine.

Read in this order: block_pool -> block_manager -> request -> scheduling_policy -> scheduler -> paged_attention ->
kv_cache -> llama -> sampler -> engine -> beam_search. reference/tutorial/ holds what only the tutorial needs
(kv_memory, the memory accounting behind its fragmentation figures).
Only NumPy and the standard library are imported here (a test enforces it).
"""

from reference.beam_search import beam_search
from reference.block_manager import BlockManager
from reference.block_pool import Block, BlockHash, BlockPool, hash_block_tokens
from reference.engine import Generation, ReferenceEngine
from reference.kv_cache import KVCache
from reference.llama import LlamaModel
from reference.paged_attention import AttentionMetadata, dense_attention, paged_attention, write_kv
from reference.request import Request, RequestStatus, SamplingParams
from reference.sampler import sample
from reference.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

__all__ = [
    "AttentionMetadata", "Block", "BlockHash", "BlockManager", "BlockPool", "Generation", "KVCache",
    "LlamaModel", "ReferenceEngine", "Request", "RequestStatus", "SamplingParams", "Scheduler",
    "SchedulerConfig", "SchedulerOutput", "beam_search", "dense_attention", "hash_block_tokens",
    "paged_attention", "sample", "write_kv",
]
