"""LLMEngine: add requests, step, read outputs. The loop that LLM.generate and the server drive.

    step():
        schedule          -> which sequences run, how many tokens each, block copies
        model runner      -> swap / copy blocks, pad inputs to buckets, run the jitted model
        sampler           -> one token per sequence whose tokens are all computed
        process outputs   -> forks, beams, logprobs, detokenize, stop checks, free finished sequences
"""

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from jax_engine.attention.backend import RAGGED_BACKENDS, get_attention_backend
from jax_engine.beam_search import BeamSearchParams, BeamSearchSequence, beam_score, select_candidates
from jax_engine.buckets import bucket
from jax_engine.config import (EngineArgs, GiB, bytes_per_block, kv_cache_bytes, platform, resolve_block_size,
                               resolve_dtype, resolve_scheduler_config)
from jax_engine.core.kv_cache_manager import KVCacheManager
from jax_engine.core.scheduler import Scheduler, SchedulerOutput
from jax_engine.detokenizer import IncrementalDetokenizer
from jax_engine.loader import Checkpoint, load_checkpoint
from jax_engine.model_runner import ModelRunner
from jax_engine.models.llama import LlamaForCausalLM
from jax_engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jax_engine.request import Request
from jax_engine.sampler import sample, sampler_inputs
from jax_engine.sampling_params import SamplingParams
from jax_engine.sequence_group import SequenceGroup
from reference.request import RequestStatus, check, is_int, is_unicode

logger = logging.getLogger(__name__)

Prompt = str | list[int] | dict


@dataclass
class StepTrace:
    """What one step did, for tests and curious users (see LLMEngine.enable_trace)."""

    step: int
    scheduled: list[tuple[str, int]]  # (sequence id, tokens computed)
    preempted: list[tuple[str, str, str]]  # (sequence id, "recompute" | "swap", reason)
    cache_misses: list[tuple[str, str]]  # (sequence id, why its prompt was not (fully) found in the cache)
    copies: list[tuple[int, int]]  # copy-on-write block copies (src, dst)
    num_free_blocks: int


def _cache_salt(prompt: Prompt) -> str | None:
    """vLLM's `cache_salt` prompt field: prefix-cache hits only between prompts with the same salt."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    check(salt is None or (isinstance(salt, str) and salt != ""), "cache_salt", "a non-empty string or None", salt)
    return salt


class LLMEngine:
    """A continuous-batching engine over a paged KV cache."""

    def __init__(self, args: EngineArgs, checkpoint: Checkpoint | None = None) -> None:
        """Load the model (or take an already loaded `checkpoint`), size the KV cache, build the loop."""
        started = time.perf_counter()
        self.args = args
        checkpoint = checkpoint or load_checkpoint(args.model)
        self.model_config = cfg = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.dtype = resolve_dtype(args.dtype)
        self.scheduler_config = resolve_scheduler_config(args, cfg)
        model = LlamaForCausalLM.from_hf_weights(cfg, checkpoint.weights, self.dtype)
        self.attention_backend, attention = get_attention_backend(args.attention_backend, platform())
        block_size = resolve_block_size(args.block_size, self.attention_backend)
        block_bytes = bytes_per_block(cfg, block_size, self.dtype)
        weight_bytes = cfg.num_params * np.dtype(self.dtype).itemsize
        num_blocks = args.num_gpu_blocks_override or kv_cache_bytes(args, weight_bytes) // block_bytes
        num_host_blocks = int(args.swap_space * GiB) // block_bytes
        max_len = self.scheduler_config.max_model_len
        if num_blocks * block_size < max_len:
            raise ValueError(
                f"the KV cache holds {num_blocks * block_size} tokens ({num_blocks} blocks of {block_size}) "
                f"but max_model_len is {max_len}: raise kv_cache_memory_bytes or lower max_model_len")
        logger.info("# %s blocks: %d, # host (swap) blocks: %d (%.2f GiB KV cache, %d tokens)",
                    platform().upper(), num_blocks, num_host_blocks, num_blocks * block_bytes / GiB,
                    num_blocks * block_size)
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size, num_host_blocks, args.enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache_manager)
        self.runner = ModelRunner(model, num_blocks, block_size, num_host_blocks, max_len, attention, self.dtype,
                                  ragged=self.attention_backend in RAGGED_BACKENDS)
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids = tuple(cfg.eos_token_ids) or ((eos,) if eos is not None else ())
        self._rng = np.random.default_rng(args.seed)
        self._groups: dict[str, SequenceGroup] = {}
        self._pending_outputs: list[RequestOutput] = []  # aborted requests, reported on the next step
        self._arrivals = 0
        self.num_steps = 0
        self.trace: list[StepTrace] | None = None
        self._blocks_held = 0  # summed over steps: physical blocks held by sequences
        self._blocks_unshared = 0  # summed over steps: blocks they would hold without sharing
        self._seqs_scheduled = 0  # summed over steps: sequences in the batch
        logger.info("engine ready in %.1f s (attention backend %r)", time.perf_counter() - started, self.attention_backend)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    # ------------------------------------------------------------------------------ requests
    def _prompt_token_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):  # vLLM's TextPrompt / TokensPrompt (which may carry its text too)
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._prompt_token_ids(prompt["prompt_token_ids"])[1]
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            check(is_unicode(prompt), "prompt", "valid Unicode (no lone surrogates)", prompt)
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
            return None, [int(t) for t in prompt]
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | BeamSearchParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Validate and queue a request. Raises ValueError naming the bad field and its limit.

        With SamplingParams(n=k) the prompt is computed once and forked into k sequences; with
        BeamSearchParams the request runs beam search (see jax_engine/beam_search.py).
        """
        params = params or SamplingParams()
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self.validate_request(prompt, params)
        cache_salt = _cache_salt(prompt)
        room = self.scheduler_config.max_model_len - len(token_ids)
        group = SequenceGroup(request_id, text, token_ids, params)
        metrics = RequestMetrics(arrival_time or time.time())
        if group.is_beam_search:  # beams read the top 2 x width logprobs of each step
            beam_params = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=True,
                                         logprobs=2 * params.beam_width)
            group.seqs.append(self._new_sequence(group, 0, beam_params, room, metrics))
        else:
            group.seqs = [self._new_sequence(group, i, params, room, metrics) for i in range(params.n)]
            group.pending_forks = group.seqs[1:]
        first = group.seqs[0]
        if getattr(params, "prompt_logprobs", None) is not None:  # every prompt position must be scored
            self.kv_cache_manager.uncached.add(first.request_id)
        if cache_salt is not None:
            self.kv_cache_manager.cache_salts[first.request_id] = cache_salt
        self.scheduler.add_request(first)
        self._groups[request_id] = group
        self._arrivals += 1

    def _new_sequence(self, group: SequenceGroup, index: int, params: SamplingParams, room: int,
                      metrics: RequestMetrics) -> Request:
        seq_id = group.request_id if index == 0 else f"{group.request_id}#{index}"
        seed = params.seed + index if params.seed is not None else int(self._rng.integers(2**31))
        detokenizer = IncrementalDetokenizer(self.tokenizer, group.prompt_token_ids, params.skip_special_tokens)
        seq = Request(seq_id, group.request_id, index, group.prompt_token_ids, params, self._arrivals,
                      seed & 0xFFFFFFFF, params.max_tokens or room, self.eos_token_ids, detokenizer, metrics)
        seq.logprobs = [] if params.logprobs is not None else None
        seq.prompt_logprobs = [None] if params.prompt_logprobs is not None else None
        return seq

    def validate_request(self, prompt: Prompt, params: SamplingParams | BeamSearchParams) -> tuple[str | None, list[int]]:
        """Tokenize and check a request without queuing it; returns (prompt text or None, token ids).

        Reads only the tokenizer and the configuration, so a server may call it while a step runs.
        """
        _cache_salt(prompt)
        text, token_ids = self._prompt_token_ids(prompt)
        if not token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, vocab_size={vocab}), got {bad[:5]}")
        limit = self.scheduler_config.max_model_len
        room = limit - len(token_ids)
        if room < 1:
            raise ValueError(f"prompt ({len(token_ids)} tokens) leaves no room for output: it exceeds "
                             f"max_model_len={limit} - 1")
        if params.max_tokens is not None and params.max_tokens > room:  # the message names the field to lower
            raise ValueError(f"max_tokens ({params.max_tokens}) + prompt ({len(token_ids)} tokens) exceeds "
                             f"max_model_len={limit}")
        self._check_params_fit(params, room)
        return text, token_ids

    def _check_params_fit(self, params: SamplingParams | BeamSearchParams, room: int) -> None:
        """The limits that depend on this engine: vocabulary, batch size, room left for output."""
        vocab, max_seqs = self.model_config.vocab_size, self.scheduler_config.max_num_seqs
        if isinstance(params, BeamSearchParams):
            check(params.beam_width <= max_seqs, "beam_width", f"<= max_num_seqs ({max_seqs})", params.beam_width)
            return
        check(params.n <= max_seqs, "n", f"<= max_num_seqs ({max_seqs})", params.n)
        check(params.top_k <= vocab, "top_k", f"-1, 0 (disabled) or at most vocab_size ({vocab})", params.top_k)
        check(all(t < vocab for t in params.stop_token_ids), "stop_token_ids",
              f"token ids below vocab_size ({vocab})", params.stop_token_ids)
        check(params.min_tokens <= room, "min_tokens", f"<= the room left under max_model_len ({room} tokens)",
              params.min_tokens)

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests wherever they are and free their blocks; unknown ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            group = self._groups.pop(rid, None)
            if group is None:
                continue
            for seq in group.live_seqs:
                self.scheduler.finish(seq, RequestStatus.FINISHED_ABORTED)
            self._pending_outputs.append(self._request_output(group))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending_outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    def enable_trace(self) -> list[StepTrace]:
        """Record every step's decisions from now on in `self.trace` (returned)."""
        self.trace = []
        return self.trace

    # ---------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, sample, and report every request that progressed."""
        outputs, self._pending_outputs = self._pending_outputs, []
        out = self.scheduler.schedule()
        for p in out.preempted:
            logger.info("preempted %s by %s: %s", p.request.request_id, p.mode, p.reason)
        if self.trace is not None:
            self.trace.append(self._step_trace(out))
        if not out.scheduled:
            return outputs
        self.num_steps += 1
        now = time.time()
        for s in out.scheduled:
            s.request.metrics.first_scheduled_time = s.request.metrics.first_scheduled_time or now
        self._record_step(out)
        self.runner.apply_block_moves(out)
        inputs = self.runner.prepare(out, self.kv_cache_manager.block_tables)
        logits, hidden = self.runner.execute(inputs)
        self._advance(out)
        self._score_prompts(out, inputs.row_of, hidden)
        requests, rows = self._fork_parallel_samples(inputs.sampling_requests)
        for request, result in self._sample(logits, requests, rows):
            if request.status.is_finished:  # its request failed earlier in this step
                continue
            with self._failing_alone(request):
                if self._groups[request.parent_id].is_beam_search:
                    request.beam_proposals = list(zip(result[3].tolist(), result[4].tolist()))
                else:
                    self._append_token(request, *result)
        self.runner.recycled.give(logits)
        for group_id in {s.request.parent_id for s in out.scheduled}:
            group = self._groups[group_id]
            if group.is_beam_search and not group.finished:
                with self._failing_alone(group.seqs[0]):
                    self._advance_beams(group)
            outputs.append(self._request_output(group))
            if group.finished:
                del self._groups[group_id]
        return outputs

    def _advance(self, out: SchedulerOutput) -> None:
        for s in out.scheduled:
            request = s.request
            request.num_computed_tokens += s.num_new_tokens
            self.kv_cache_manager.cache_full_blocks(request.request_id, request.all_token_ids,
                                                    request.num_computed_tokens)

    # ------------------------------------------------------------------------ fault isolation
    @contextlib.contextmanager
    def _failing_alone(self, seq: Request) -> Iterator[None]:
        """Host work for one sequence: if it raises, its request fails alone and the step goes on.

        The request finishes with finish_reason "error" and its blocks are freed; the traceback goes to the
        log. A fault of the step itself (scheduling, the model, the sampler's device call) still raises.
        """
        try:
            yield
        except Exception:
            logger.exception("request %s failed; it ends with finish_reason 'error', the others go on",
                             seq.parent_id)
            for failed in self._groups[seq.parent_id].live_seqs:
                self.scheduler.finish(failed, RequestStatus.FINISHED_ERROR)

    def _sample(self, logits, requests: list[Request], rows: list[int]) -> list[tuple[Request, tuple]]:
        """(sequence, sampled token and logprobs) for every sequence whose sampling row could be packed."""
        try:
            batch = self._sampling_batch(logits, requests, rows)
        except Exception:  # some sequence's values do not pack into the sampler's arrays: it fails alone
            packable = []
            for request, row in zip(requests, rows):
                with self._failing_alone(request):
                    sampler_inputs([request], 1, self.model_config.vocab_size)
                    packable.append((request, row))
            packable = [(r, row) for r, row in packable if not r.status.is_finished]
            requests, rows = [r for r, _ in packable], [row for _, row in packable]
            batch = self._sampling_batch(logits, requests, rows)
        if batch is None:
            return []
        logits, arrays, flags, num_logprobs = batch
        result, scratch = sample(logits, **arrays, flags=flags, num_logprobs=num_logprobs,
                                 scratch=self.runner.recycled.take(logits.shape))
        tokens, token_logprobs, ranks, top_ids, top_logprobs = (np.asarray(x) for x in result)
        self.runner.recycled.give(scratch)
        return [(r, (int(tokens[i]), float(token_logprobs[i]), int(ranks[i]), top_ids[i], top_logprobs[i]))
                for i, r in enumerate(requests)]

    def _sampling_batch(self, logits, requests: list[Request], rows: list[int]) -> tuple | None:
        if not requests:
            return None
        if rows != list(range(len(rows))):  # forked samples read their parent's logits row
            logits = logits[np.array(rows + [0] * (bucket(len(rows), 8) - len(rows)), np.int32)]
        return logits, *sampler_inputs(requests, logits.shape[0], self.model_config.vocab_size)

    # ---------------------------------------------------------------------------- sharing
    def _fork_parallel_samples(self, requests: list[Request]) -> tuple[list[Request], list[int]]:
        """Fork waiting parallel samples off a sequence whose prompt just finished; they share its logits row."""
        expanded, rows = [], []
        for row, request in enumerate(requests):
            if request.status.is_finished:  # failed while its prompt was scored
                continue
            expanded.append(request)
            rows.append(row)
            group = self._groups[request.parent_id]
            for child in group.pending_forks:
                child.adopt(request)
                self.kv_cache_manager.fork(request.request_id, child.request_id)
                self.scheduler.add_running(child)
                expanded.append(child)
                rows.append(row)
            group.pending_forks = []
        return expanded, rows

    def _advance_beams(self, group: SequenceGroup) -> None:
        """Once every live beam proposed its next tokens: keep the best, fork, free the pruned."""
        beams, params = group.live_seqs, group.params
        if any(b.beam_proposals is None for b in beams):
            return  # a beam was preempted before it proposed: wait for it
        survivors, completed = select_candidates(beams, params, self.eos_token_ids)
        group.completed_beams += [BeamSearchSequence(c.beam.all_token_ids + [c.token], c.cum_logprob,
                                                     finish_reason="stop") for c in completed]
        plan, used = [], set()
        for candidate in survivors:  # fork before anyone appends, so children copy the parent's tokens
            beam = candidate.beam
            target = beam if id(beam) not in used else self._fork_beam(group, beam)
            used.add(id(beam))
            plan.append((target, candidate))
        for beam in beams:
            beam.beam_proposals = None
            if id(beam) not in used:
                self.scheduler.finish(beam, RequestStatus.FINISHED_ABORTED)  # pruned: its blocks are freed
        for target, candidate in plan:
            target.all_token_ids.append(candidate.token)
            target.cumulative_logprob = candidate.cum_logprob
            if target.num_output_tokens >= params.max_tokens:
                self.scheduler.finish(target, RequestStatus.FINISHED_LENGTH)

    def _fork_beam(self, group: SequenceGroup, parent: Request) -> Request:
        child = self._new_sequence(group, len(group.seqs), parent.sampling_params, parent.max_tokens, parent.metrics)
        child.adopt(parent)
        self.kv_cache_manager.fork(parent.request_id, child.request_id)
        self.scheduler.add_running(child)
        group.seqs.append(child)
        return child

    def _record_step(self, out: SchedulerOutput) -> None:
        kv = self.kv_cache_manager
        self._seqs_scheduled += len(out.scheduled)
        self._blocks_held += kv.device.num_blocks - kv.device.num_free_blocks
        self._blocks_unshared += sum(len(t) for seq, t in kv.block_tables.items() if seq not in kv.swapped_out)

    # ------------------------------------------------------------------------ token outputs
    def _score_prompts(self, out: SchedulerOutput, row_of: dict[str, int], hidden) -> None:
        """Prompt logprobs: at each computed prompt position p, the logprob of prompt token p + 1."""
        rows, targets, owners = [], [], []
        for s in out.scheduled:
            r = s.request
            if r.prompt_logprobs is None:
                continue
            for p in range(r.num_computed_tokens - s.num_new_tokens, min(r.num_computed_tokens, r.num_prompt_tokens - 1)):
                if p + 1 >= len(r.prompt_logprobs):  # not scored yet (a recomputed prefill scores nothing new)
                    rows.append(row_of[r.request_id] + p - (r.num_computed_tokens - s.num_new_tokens))
                    targets.append(r.prompt_token_ids[p + 1])
                    owners.append(r)
        if not rows:
            return
        num_top = max(r.sampling_params.prompt_logprobs for r in owners)
        logprob, rank, top_ids, top_logprobs = self.runner.token_logprobs(hidden, rows, targets, num_top)
        for i, (r, target) in enumerate(zip(owners, targets)):
            if not r.status.is_finished:
                with self._failing_alone(r):
                    r.prompt_logprobs.append(self._logprob_entry(target, logprob[i], rank[i], top_ids[i],
                                                                 top_logprobs[i], r.sampling_params.prompt_logprobs))

    def _logprob_entry(self, token: int, logprob: float, rank: int, top_ids, top_logprobs, k: int) -> dict:
        """vLLM's per-position logprobs: the chosen token, then the top k (ranks 1..k)."""
        entry = {int(token): Logprob(float(logprob), int(rank), self.tokenizer.decode([int(token)]))}
        for i, (tid, lp) in enumerate(zip(top_ids[:k], top_logprobs[:k])):
            entry.setdefault(int(tid), Logprob(float(lp), i + 1, self.tokenizer.decode([int(tid)])))
        return entry

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
    def _request_output(self, group: SequenceGroup) -> RequestOutput:
        if group.is_beam_search:
            completions = self._beam_completions(group)
        else:
            completions = [CompletionOutput(s.index, s.detokenizer.text, s.output_token_ids,
                                            s.cumulative_logprob if s.sampling_params.logprobs is not None else None,
                                            s.logprobs, s.status.finish_reason, s.stop_reason) for s in group.seqs]
        first = group.seqs[0]
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, first.prompt_logprobs,
                             completions, group.finished, first.num_cached_tokens or 0, first.metrics)

    def _beam_completions(self, group: SequenceGroup) -> list[CompletionOutput]:
        """The best beam_width of live, length-finished and EOS-completed beams, by vLLM's beam score."""
        params, n = group.params, len(group.prompt_token_ids)
        beams = [BeamSearchSequence(s.all_token_ids, s.cumulative_logprob, finish_reason=s.status.finish_reason)
                 for s in group.seqs if s.status is not RequestStatus.FINISHED_ABORTED]
        beams += group.completed_beams
        beams.sort(key=lambda b: beam_score(b.tokens, b.cum_logprob, self.eos_token_ids, params.length_penalty),
                   reverse=True)
        return [CompletionOutput(i, self.tokenizer.decode(b.tokens[n:], skip_special_tokens=True), b.tokens[n:],
                                 b.cum_logprob, None, b.finish_reason if group.finished else None)
                for i, b in enumerate(beams[: params.beam_width])]

    # ---------------------------------------------------------------------------- statistics
    def _step_trace(self, out: SchedulerOutput) -> StepTrace:
        kv = self.kv_cache_manager
        misses = []
        for r in out.admitted:
            full_blocks, hit_blocks = (r.num_tokens - 1) // kv.block_size, r.num_computed_tokens // kv.block_size
            if hit_blocks < full_blocks or full_blocks == 0:
                misses.append((r.request_id, self._miss_reason(r, hit_blocks, full_blocks)))
        return StepTrace(self.num_steps, [(s.request.request_id, s.num_new_tokens) for s in out.scheduled],
                         [(p.request.request_id, p.mode, p.reason) for p in out.preempted], misses,
                         list(out.copies), kv.device.num_free_blocks)

    def _miss_reason(self, request: Request, hit_blocks: int, full_blocks: int) -> str:
        if not self.kv_cache_manager.enable_prefix_caching:
            return "prefix caching disabled"
        if request.request_id in self.kv_cache_manager.uncached:
            return "prompt logprobs need every prompt token computed"
        if full_blocks == 0:
            return "prefix shorter than one block"
        return f"{hit_blocks} of {full_blocks} full blocks found in the cache"

    def stats(self) -> dict:
        """KV-cache and scheduling statistics since the engine started."""
        kv = self.kv_cache_manager
        return {
            "num_blocks": kv.device.num_blocks,
            "num_free_blocks": kv.device.num_free_blocks,
            "num_cached_blocks": kv.device.num_cached_blocks,
            "kv_cache_usage": kv.usage,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "memory_saved_by_sharing": 1 - self._blocks_held / self._blocks_unshared if self._blocks_unshared else 0.0,
            "num_steps": self.num_steps,
            "mean_batch_size": self._seqs_scheduled / max(self.num_steps, 1),
            "mean_kv_cache_usage": self._blocks_held / max(self.num_steps, 1) / kv.device.num_blocks,
            "num_compilations": len(self.runner.compiled_shapes),
            "compile_seconds": self.runner.compile_seconds,
        }
