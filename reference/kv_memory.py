"""How much KV-cache memory a request trace really uses: contiguous preallocation versus paging.

Systems before vLLM reserved one contiguous chunk of `max_model_len` slots per request, because the output
length is unknown in advance. At any moment a request's chunk splits into:

    |<-------------------------------- max_model_len slots -------------------------------->|
    | prompt + tokens so far (USED) | future tokens (RESERVED) | never used (INTERNAL FRAG.)  |

Paging allocates one block of B slots at a time, so the only waste is the unfilled tail of the last block
(< B slots per request), and nothing is reserved.

We average over every decoding step of every request: at step t of a request with prompt length P and
output length O, P + t slots hold tokens.
"""

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVMemoryUsage:
    """Slot counts summed over all (request, decoding step) pairs of a trace."""

    used: int  # slots holding a token's K/V
    reserved: int  # slots set aside for tokens the request will produce later
    internal_fragmentation: int  # slots allocated that no token will ever fill

    @property
    def allocated(self) -> int:
        return self.used + self.reserved + self.internal_fragmentation

    @property
    def wasted(self) -> int:
        return self.reserved + self.internal_fragmentation

    @property
    def utilization(self) -> float:
        """Fraction of allocated slots that hold tokens (the paper reports 20-38% before vLLM)."""
        return self.used / self.allocated


def _steps(trace: Sequence[tuple[int, int]]):
    for prompt_len, output_len in trace:
        if prompt_len < 1 or output_len < 1:
            raise ValueError(f"prompt_len and output_len must be >= 1, got ({prompt_len}, {output_len})")
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
    used = fragmented = 0
    for _, _, filled in _steps(trace):
        used += filled
        fragmented += -filled % block_size  # empty slots in the last block
    return KVMemoryUsage(used, 0, fragmented)
