"""LLMEngine: add requests, step, read outputs. The loop that LLM.generate and the server drive.

    step():
        schedule          -> which requests run, how many tokens each, block copies
        model runner      -> swap / copy blocks, pad inputs to buckets, run the jitted model
        sampler           -> one token per request whose tokens are all computed
        process outputs   -> logprobs, detokenize, stop checks, free finished requests' blocks
"""

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from jax_engine.attention.backend import get_attention_backend
from jax_engine.config import (EngineArgs, GiB, bytes_per_block, kv_cache_bytes, platform, resolve_dtype,
                               resolve_scheduler_config)
from jax_engine.core.kv_cache_manager import KVCacheManager
from jax_engine.core.scheduler import Scheduler, SchedulerOutput
from jax_engine.detokenizer import IncrementalDetokenizer
from jax_engine.loader import load_checkpoint
from jax_engine.model_runner import ModelRunner
from jax_engine.models.llama import LlamaForCausalLM
from jax_engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jax_engine.request import Request
from jax_engine.sampler import sample, sampler_inputs
from jax_engine.sampling_params import SamplingParams
from reference.request import RequestStatus

logger = logging.getLogger(__name__)

Prompt = str | list[int] | dict


@dataclass
class _Parent:
    """A user request: its prompt and its n sequences."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(c.status.is_finished for c in self.children)


class LLMEngine:
    """A continuous-batching engine over a paged KV cache."""

    def __init__(self, args: EngineArgs) -> None:
        started = time.perf_counter()
        self.args = args
        checkpoint = load_checkpoint(args.model)
        self.model_config = cfg = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.dtype = resolve_dtype(args.dtype)
        self.scheduler_config = resolve_scheduler_config(args, cfg)
        model = LlamaForCausalLM.from_hf_weights(cfg, checkpoint.weights, self.dtype)
        del checkpoint
        block_bytes = bytes_per_block(cfg, args.block_size, self.dtype)
        weight_bytes = cfg.num_params * np.dtype(self.dtype).itemsize
        num_blocks = args.num_gpu_blocks_override or kv_cache_bytes(args, weight_bytes) // block_bytes
        num_host_blocks = int(args.swap_space * GiB) // block_bytes
        max_len = self.scheduler_config.max_model_len
        if num_blocks * args.block_size < max_len:
            raise ValueError(
                f"the KV cache holds {num_blocks * args.block_size} tokens ({num_blocks} blocks of {args.block_size}) "
                f"but max_model_len is {max_len}: raise kv_cache_memory_bytes or lower max_model_len")
        logger.info("# %s blocks: %d, # host (swap) blocks: %d (%.2f GiB KV cache, %d tokens)",
                    platform().upper(), num_blocks, num_host_blocks, num_blocks * block_bytes / GiB,
                    num_blocks * args.block_size)
        self.attention_backend, attention = get_attention_backend(args.attention_backend, platform())
        self.kv_cache_manager = KVCacheManager(num_blocks, args.block_size, num_host_blocks, args.enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache_manager)
        self.runner = ModelRunner(model, num_blocks, args.block_size, num_host_blocks, self.scheduler_config.max_num_seqs,
                                  self.scheduler_config.max_num_batched_tokens, max_len, attention, self.dtype)
        self.eos_token_ids = tuple(cfg.eos_token_ids) or ((self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())
        self._rng = np.random.default_rng(args.seed)
        self._parents: dict[str, _Parent] = {}
        self._pending_outputs: list[RequestOutput] = []  # aborted requests, reported on the next step
        self._arrivals = 0
        self.num_steps = 0
        logger.info("engine ready in %.1f s (attention backend %r)", time.perf_counter() - started, self.attention_backend)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    # ------------------------------------------------------------------------------ requests
    def _prompt_token_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):  # vLLM's TextPrompt / TokensPrompt
            prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            return None, [int(t) for t in prompt]
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Validate and queue a request. Raises ValueError naming the bad field and its limit."""
        params = params or SamplingParams()
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self._prompt_token_ids(prompt)
        max_max_tokens = self._validate_prompt(token_ids, params)
        parent = _Parent(text, token_ids, params)
        metrics = RequestMetrics(arrival_time or time.time())
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            seed = params.seed + index if params.seed is not None else int(self._rng.integers(2**31))
            detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
            child = Request(child_id, request_id, index, token_ids, params, self._arrivals, seed & 0xFFFFFFFF,
                            params.max_tokens or max_max_tokens, self.eos_token_ids, detokenizer, metrics)
            child.logprobs = [] if params.logprobs is not None else None
            child.prompt_logprobs = [None] if params.prompt_logprobs is not None else None
            parent.children.append(child)
        for child in parent.children:
            if params.prompt_logprobs is not None:  # every prompt position must be computed to score it
                self.kv_cache_manager.uncached.add(child.request_id)
            self.scheduler.add_request(child)
        self._parents[request_id] = parent
        self._arrivals += 1

    def _validate_prompt(self, token_ids: list[int], params: SamplingParams) -> int:
        """Check a prompt; return the largest max_tokens it leaves room for."""
        if not token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, vocab_size={vocab}), got {bad[:5]}")
        limit = self.scheduler_config.max_model_len
        room = limit - len(token_ids)
        if room < 1 or (params.max_tokens is not None and params.max_tokens > room):
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"max_model_len={limit}")
        return room

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests wherever they are and free their blocks; unknown ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            for child in parent.children:
                if not child.status.is_finished:
                    self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
            self._pending_outputs.append(self._request_output(rid, parent))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending_outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ---------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, sample, and report every request that progressed."""
        outputs, self._pending_outputs = self._pending_outputs, []
        out = self.scheduler.schedule()
        for victim in out.preempted:
            logger.info("preempted request %s by %s: out of KV blocks (%d free)", victim.request_id,
                        "swap" if victim.status is RequestStatus.SWAPPED else "recompute",
                        self.kv_cache_manager.device.num_free_blocks)
        if not out.scheduled:
            return outputs
        self.num_steps += 1
        now = time.time()
        for s in out.scheduled:
            s.request.metrics.first_scheduled_time = s.request.metrics.first_scheduled_time or now
        self.runner.apply_block_moves(out)
        inputs = self.runner.prepare(out, self.kv_cache_manager.block_tables)
        logits, hidden = self.runner.execute(inputs)
        sampled = self._sample(logits, inputs.sampling_requests)
        self._score_prompts(out, inputs.row_of, hidden)
        self._advance(out)
        touched = {s.request.parent_id for s in out.scheduled}
        for request, row in zip(inputs.sampling_requests, sampled):
            self._append_token(request, *row)
        for parent_id in touched:
            parent = self._parents.get(parent_id)
            if parent is not None:
                outputs.append(self._request_output(parent_id, parent))
                if parent.finished:
                    del self._parents[parent_id]
        return outputs

    def _sample(self, logits, requests: list[Request]) -> list[tuple]:
        if not requests:
            return []
        arrays, flags, num_logprobs = sampler_inputs(requests, logits.shape[0], self.model_config.vocab_size)
        result = sample(logits, **arrays, flags=flags, num_logprobs=num_logprobs)
        tokens, token_logprobs, ranks, top_ids, top_logprobs = (np.asarray(x) for x in result)
        return [(int(tokens[i]), float(token_logprobs[i]), int(ranks[i]), top_ids[i], top_logprobs[i])
                for i in range(len(requests))]

    def _score_prompts(self, out: SchedulerOutput, row_of: dict[str, int], hidden) -> None:
        """Prompt logprobs: at each computed prompt position p, the logprob of prompt token p + 1."""
        rows, targets, owners = [], [], []
        for s in out.scheduled:
            r = s.request
            if r.prompt_logprobs is None:
                continue
            for p in range(r.num_computed_tokens, min(r.num_computed_tokens + s.num_new_tokens, r.num_prompt_tokens - 1)):
                if p + 1 >= len(r.prompt_logprobs):  # not scored yet (a recomputed prefill scores nothing new)
                    rows.append(row_of[r.request_id] + p - r.num_computed_tokens)
                    targets.append(r.prompt_token_ids[p + 1])
                    owners.append(r)
        if not rows:
            return
        num_top = max(r.sampling_params.prompt_logprobs for r in owners)
        logprob, rank, top_ids, top_logprobs = self.runner.token_logprobs(hidden, rows, targets, num_top)
        for i, (r, target) in enumerate(zip(owners, targets)):
            r.prompt_logprobs.append(self._logprob_entry(target, logprob[i], rank[i], top_ids[i], top_logprobs[i],
                                                         r.sampling_params.prompt_logprobs))

    def _logprob_entry(self, token: int, logprob: float, rank: int, top_ids, top_logprobs, k: int) -> dict:
        """vLLM's per-position logprobs: the chosen token, then the top k (ranks 1..k)."""
        entry = {int(token): Logprob(float(logprob), int(rank), self.tokenizer.decode([int(token)]))}
        for i, (tid, lp) in enumerate(zip(top_ids[:k], top_logprobs[:k])):
            entry.setdefault(int(tid), Logprob(float(lp), i + 1, self.tokenizer.decode([int(tid)])))
        return entry

    def _advance(self, out: SchedulerOutput) -> None:
        for s in out.scheduled:
            request = s.request
            request.num_computed_tokens += s.num_new_tokens
            self.kv_cache_manager.cache_full_blocks(request.request_id, request.all_token_ids,
                                                    request.num_computed_tokens)

    def _append_token(self, request: Request, token: int, logprob: float, rank: int, top_ids, top_logprobs) -> None:
        now = time.time()
        request.metrics.first_token_time = request.metrics.first_token_time or now
        request.metrics.last_token_time = now
        status = request.append_token(token)
        request.cumulative_logprob += logprob
        params = request.sampling_params
        if request.logprobs is not None:
            request.logprobs.append(self._logprob_entry(token, logprob, rank, top_ids, top_logprobs, params.logprobs))
        delta = request.detokenizer.add_token(token)
        if status is None and params.stop and delta:
            status = self._check_stop_strings(request, len(delta))
        if status is not None:
            self.scheduler.finish(request, status)
            request.metrics.finished_time = now

    @staticmethod
    def _check_stop_strings(request: Request, delta_len: int) -> RequestStatus | None:
        detok, params = request.detokenizer, request.sampling_params
        for stop in params.stop:
            start = max(0, len(detok.text) - delta_len - len(stop) + 1)
            index = detok.text.find(stop, start)
            if index >= 0:
                detok.text = detok.text[: index + (len(stop) if params.include_stop_str_in_output else 0)]
                request.stop_reason = stop
                return RequestStatus.FINISHED_STOPPED
        return None

    # ------------------------------------------------------------------------------- outputs
    def _request_output(self, request_id: str, parent: _Parent) -> RequestOutput:
        completions = [
            CompletionOutput(
                index=c.index,
                text=c.detokenizer.text,
                token_ids=c.output_token_ids,
                cumulative_logprob=c.cumulative_logprob if c.sampling_params.logprobs is not None else None,
                logprobs=c.logprobs,
                finish_reason=c.status.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in parent.children
        ]
        first = parent.children[0]
        return RequestOutput(request_id, parent.prompt, parent.prompt_token_ids, first.prompt_logprobs, completions,
                             parent.finished, first.num_cached_tokens or 0, first.metrics)

    # ---------------------------------------------------------------------------- statistics
    def stats(self) -> dict:
        kv = self.kv_cache_manager
        return {
            "num_blocks": kv.device.num_blocks,
            "num_free_blocks": kv.device.num_free_blocks,
            "num_cached_blocks": kv.device.num_cached_blocks,
            "kv_cache_usage": kv.usage,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_compilations": len(self.runner.compiled_shapes),
            "compile_seconds": self.runner.compile_seconds,
        }
