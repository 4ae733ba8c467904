"""The reference engine: the whole serving loop in one readable place.

    generate(prompts)                      add every request, then step until all are finished
      step():
        1. scheduler.schedule()            who runs, how many tokens each, which blocks to copy
        2. kv_cache copies                 swap out, swap in, copy-on-write
        3. _prepare_batch(out)             flat token ids, positions, slots, block tables
        4. model.forward(batch)            write new K/V at their slots, paged attention
        5. sample                          one token per request whose tokens are all computed;
                                           with drafts, verify them: the accepted ones and one more
        6. scheduler.update_from_output    append tokens, roll back rejected drafts, finish requests
        7. proposer.propose                draft the next tokens of each decoding request (speculation)
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from reference.block_manager import BlockManager
from reference.kv_cache import KVCache
from reference.llama import LlamaModel
from reference.paged_attention import AttentionMetadata
from reference.request import Request, SamplingParams
from reference.sampler import sample
from reference.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from reference.speculative import rejection_sample, target_probs_from_logits


class Proposer(Protocol):
    """Drafts tokens to follow a context (reference/speculative.py: NgramProposer, DraftModelProposer)."""

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]: ...


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class Generation:
    """A finished request: its tokens, its text (when the engine has a tokenizer) and why it stopped."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str
    num_cached_tokens: int
    text: str | None = None


@dataclass
class Batch:
    """The model inputs of one step, flattened across the scheduled requests."""

    token_ids: np.ndarray
    positions: np.ndarray
    metadata: AttentionMetadata
    logits_indices: np.ndarray  # last row of each request that samples this step, and its drafts' rows before it
    sampling_ids: list[str]  # those requests, in the same order


class ReferenceEngine:
    """Continuous batching over a paged KV cache, in NumPy. Slow on purpose; read it."""

    def __init__(
        self,
        model: LlamaModel,
        *,
        num_blocks: int,
        block_size: int = 16,
        num_host_blocks: int = 0,
        enable_prefix_caching: bool = True,
        scheduler_config: SchedulerConfig | None = None,
        eos_token_ids: Sequence[int] = (),
        tokenizer: Tokenizer | None = None,
        seed: int = 0,
        proposer: Proposer | None = None,
    ) -> None:
        cfg = model.config
        self.model = model
        self.block_manager = BlockManager(num_blocks, block_size, num_host_blocks, enable_prefix_caching)
        self.scheduler = Scheduler(scheduler_config or SchedulerConfig(), self.block_manager)
        self.kv_cache = KVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, num_host_blocks)
        self.eos_token_ids = tuple(eos_token_ids)
        self.tokenizer = tokenizer
        self.rng = np.random.default_rng(seed)
        self.proposer = proposer  # speculative decoding when set
        self.num_draft_tokens = self.num_accepted_tokens = 0  # drafts verified, and accepted, so far
        self.trace: list[SchedulerOutput] = []  # every step's decisions, for tests and the tutorial
        self._arrivals = 0

    # --------------------------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                    priority: int = 0) -> None:
        """Validate and queue one request (`priority`: see scheduling_policy.py); raise ValueError naming the bad
        field."""
        token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt must not be empty")
        bad = [t for t in token_ids if not 0 <= t < self.model.config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, vocab_size={self.model.config.vocab_size}); got {bad[:5]}")
        self.scheduler.add_request(Request(request_id, token_ids, params, arrival=self._arrivals, priority=priority))
        self._arrivals += 1

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs an engine with a tokenizer; pass token ids instead")
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -------------------------------------------------------------------------------- one step
    # --8<-- [start:step]
    def step(self) -> list[Request]:
        """Schedule, run the model once, sample; returns the requests that finished."""
        out = self.scheduler.schedule()
        self.trace.append(out)
        self.kv_cache.swap_out(out.swap_out)
        self.kv_cache.swap_in(out.swap_in)
        self.kv_cache.copy_blocks(out.copies)
        if not out.scheduled:
            return []
        batch = self._prepare_batch(out)
        # --8<-- [end:step]
        logits = self.model.forward(batch.token_ids, batch.positions, self.kv_cache, batch.metadata, batch.logits_indices)
        sampled, row = {}, 0
        for request_id in batch.sampling_ids:
            request = self.scheduler.requests[request_id]
            num_rows = 1 + len(request.spec_token_ids)
            sampled[request_id] = self._emit(request, logits[row : row + num_rows])
            row += num_rows
        finished = self.scheduler.update_from_output(out, sampled, self.eos_token_ids)
        self._propose()
        return finished

    # --8<-- [start:speculative_step]
    def _emit(self, request: Request, logits: np.ndarray) -> int | list[int]:
        """The token a request samples, or with drafts the ones the target verifies
        (logits: a row per draft, then one after the last)."""
        params, drafts = request.sampling_params, request.spec_token_ids
        if not drafts:
            return sample(logits[0], params, request.num_tokens, self.rng,
                          request.output_token_ids)
        target_probs = target_probs_from_logits(logits, params, request.output_token_ids,
                                                drafts)
        rng = (self.rng if params.seed is None
               else np.random.default_rng([params.seed % 2**64, request.num_tokens]))
        # None for draft_probs: the proposers' drafts are one-hot
        emitted = rejection_sample(drafts, None, target_probs, rng)
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += len(emitted) - 1
        return emitted

    def _propose(self) -> None:
        """Draft the next tokens of every request that just sampled; the next step verifies
        them."""
        for request in self.scheduler.running if self.proposer else []:
            if request.num_computed_tokens == request.num_tokens - 1:
                # a step emits up to drafts + 1 tokens
                room = request.max_num_tokens - request.num_tokens - 1
                request.spec_token_ids = self.proposer.propose(request.token_ids, room)
    # --8<-- [end:speculative_step]

    def _prepare_batch(self, out: SchedulerOutput) -> Batch:
        bs = self.block_manager.block_size
        token_ids, positions, slots, starts, seq_lens, logits_indices, sampling_ids = [], [], [], [0], [], [], []
        for s in out.scheduled:
            request = self.scheduler.requests[s.request_id]
            tokens = request.token_ids + request.spec_token_ids  # drafts follow the last token (speculation)
            first, last = request.num_computed_tokens, request.num_computed_tokens + s.num_new_tokens
            # --8<-- [start:slot_mapping]
            token_ids += tokens[first:last]
            positions += range(first, last)
            slots += [s.block_table[p // bs] * bs + p % bs for p in range(first, last)]
            # --8<-- [end:slot_mapping]
            starts.append(starts[-1] + s.num_new_tokens)
            seq_lens.append(last)
            if last >= request.num_tokens:  # prompt fully computed: this step samples a token
                logits_indices += range(starts[-1] - 1 - len(request.spec_token_ids), starts[-1])
                sampling_ids.append(s.request_id)
        metadata = AttentionMetadata(np.array(slots), np.array(starts), np.array(seq_lens),
                                     [s.block_table for s in out.scheduled])
        return Batch(np.array(token_ids), np.array(positions), metadata, np.array(logits_indices, dtype=int), sampling_ids)

    # ------------------------------------------------------------------------------- the front door
    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[Generation]:
        """Generate a completion for every prompt; results come back in input order."""
        params_list = [params or SamplingParams()] * len(prompts) if not isinstance(params, Sequence) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        ids = [f"ref-{self._arrivals + i}" for i in range(len(prompts))]
        try:
            for request_id, prompt, p in zip(ids, prompts, params_list):
                self.add_request(request_id, prompt, p)
        except ValueError:
            for request_id in ids:  # a bad prompt must not leave the good ones queued
                self.abort_request(request_id)
            raise
        while self.has_unfinished_requests():
            self.step()
        return [self._generation(self.scheduler.requests[i]) for i in ids]

    def _generation(self, request: Request) -> Generation:
        text = None if self.tokenizer is None else self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        return Generation(request.request_id, request.prompt_token_ids, request.output_token_ids,
                          request.status.finish_reason, request.num_cached_tokens or 0, text)
