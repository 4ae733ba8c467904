"""From sampled tokens to what users read: logprob entries, incremental text, stop strings, RequestOutput.

The scheduler has already appended each token and decided the stops that tokens decide (stop token ids,
EOS, max_tokens). What needs the tokenizer happens here, as in vLLM's output processor: the text grows by
the token's delta, a stop string found in it finishes the sequence, and logprobs get their decoded tokens.
"""

import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager

from jax_engine.beam_search import BeamSearchSequence, beam_score
from jax_engine.core.scheduler_output import SchedulerOutput
from jax_engine.detokenizer import (cut_at_stop, decoded_text, decoded_token, find_stop_string,
                                    searches_stop_strings)
from jax_engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from jax_engine.sample.sampler import SampledToken
from jax_engine.sequence import Sequence
from jax_engine.sequence_group import SequenceGroup
from reference.request import RequestStatus


class OutputProcessor:
    """`tokenizer` None makes no text: an engine without a tokenizer, or an engine core whose API server makes the
    text (jax_engine/engine_core/text_processor.py)."""

    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids

    def process_token(self, seq: Sequence, sampled: SampledToken, tokens_after: int = 0) -> RequestStatus | None:
        """Record a token the scheduler appended, `tokens_after` of them after it this step (speculative decoding
        appends several); return FINISHED_STOPPED if it completed a stop string."""
        now = time.time()
        seq.metrics.first_token_time = seq.metrics.first_token_time or now
        seq.metrics.last_token_time = now
        params = seq.sampling_params
        if seq.logprobs is not None:
            seq.logprobs.append(self.logprob_entry(sampled.token, sampled.logprob, sampled.rank, sampled.top_ids,
                                                   sampled.top_logprobs, params.logprobs))
        delta = seq.detokenizer.add_token(sampled.token)
        # The scheduler's finish (EOS, a stop token, max_tokens) is decided by the step's last token.
        ended = tokens_after == 0 and seq.status.is_finished and seq.status is not RequestStatus.FINISHED_LENGTH
        status = None
        if delta and searches_stop_strings(params, seq.num_output_tokens - tokens_after, ended):
            status = self._check_stop_strings(seq, len(delta))
        if status is not None or seq.status.is_finished:
            seq.metrics.finished_time = now
        return status

    def process_tokens(self, appended: list[tuple[Sequence, SampledToken]], failing_alone: Callable,
                       fail_request: Callable[[Sequence], None]) -> list[Sequence]:
        """process_token for each appended token, in order; returns the sequences a stop string ended. Where that
        was one of several tokens a sequence emitted this step (speculative decoding), the ones after it are
        taken back. A sequence its grammar failed (FINISHED_ERROR) goes to `fail_request`; a token whose
        processing raises fails its request alone (`failing_alone`)."""
        stopped: dict[Sequence, list[SampledToken]] = {}  # the tokens after each one's stop string
        remaining = Counter(seq for seq, _ in appended)
        for seq, token in appended:
            remaining[seq] -= 1
            if seq in stopped:
                stopped[seq].append(token)
            elif seq.status is RequestStatus.FINISHED_ERROR:
                fail_request(seq)
            else:
                with failing_alone(seq):
                    if self.process_token(seq, token, remaining[seq]) is not None:
                        stopped[seq] = []
        for seq, dropped in stopped.items():
            seq.drop_last_tokens(dropped)
            if seq.status.is_finished:  # the scheduler had ended it at a later token, or at max_tokens: a stop
                seq.status = RequestStatus.FINISHED_STOPPED  # string came first (its blocks are already free)
        return list(stopped)

    def request_outputs(self, out: SchedulerOutput, groups: dict[str, SequenceGroup]) -> list[RequestOutput]:
        """One output per request that step `out` advanced; a finished one leaves `groups` (the engine's unfinished
        requests). One aborted while the step was in flight (async scheduling) has left already."""
        outputs = []
        for request_id in dict.fromkeys(s.seq.request_id for s in out.scheduled):
            if (group := groups.get(request_id)) is not None:
                outputs.append(self.request_output(group))
                if group.finished:
                    del groups[request_id]
        return outputs

    def logprob_entry(self, token: int, logprob: float, rank: int, top_ids, top_logprobs, k: int) -> PositionLogprobs:
        """vLLM's per-position logprobs: the chosen token, then the top k (ranks 1..k)."""
        entry = {int(token): Logprob(float(logprob), int(rank), decoded_token(self.tokenizer, token))}
        for i, (tid, lp) in enumerate(zip(top_ids[:k], top_logprobs[:k])):
            entry.setdefault(int(tid), Logprob(float(lp), i + 1, decoded_token(self.tokenizer, tid)))
        return entry

    @staticmethod
    def _check_stop_strings(seq: Sequence, delta_len: int) -> RequestStatus | None:
        detok, params = seq.detokenizer, seq.sampling_params
        found = find_stop_string(detok.text, delta_len, params.stop)
        if found is None:
            return None
        detok.text = cut_at_stop(detok.text, *found, params.include_stop_str_in_output)
        seq.stop_reason = found[1]
        return RequestStatus.FINISHED_STOPPED

    # ------------------------------------------------------------------------------- outputs
    def request_output(self, group: SequenceGroup) -> RequestOutput:
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
        return [CompletionOutput(i, decoded_text(self.tokenizer, b.tokens[n:]), b.tokens[n:],
                                 b.cum_logprob, None, b.finish_reason if group.finished else None)
                for i, b in enumerate(beams[: params.beam_width])]

    # ------------------------------------------------------------------------- prompt logprobs
    @staticmethod
    def prompt_positions(out: SchedulerOutput, row_of: dict[str, int]) -> list[tuple[Sequence, int, int]]:
        """(sequence, row of the step's hidden states, target token) of every prompt position to score.

        At prompt position p the score is the logprob of prompt token p + 1. Read before the scheduler
        advances the computed counts; a recomputed prefill scores nothing new.
        """
        positions = []
        for s in out.scheduled:
            seq, first = s.seq, s.seq.num_computed_tokens
            if seq.prompt_logprobs is None:
                continue
            for p in range(max(first, len(seq.prompt_logprobs) - 1),
                           min(first + s.num_new_tokens, seq.num_prompt_tokens - 1)):
                positions.append((seq, row_of[seq.seq_id] + p - first, seq.prompt_token_ids[p + 1]))
        return positions

    def score_prompts(self, out: SchedulerOutput, row_of: dict[str, int], hidden, token_logprobs,
                      failing_alone: Callable[[Sequence], AbstractContextManager]) -> None:
        """vLLM's prompt_logprobs: score the prompt positions this step computed, with the runner's
        `token_logprobs`; a sequence whose entry cannot be made fails alone."""
        positions = self.prompt_positions(out, row_of)
        if not positions:
            return
        seqs, rows, targets = zip(*positions)
        scores = token_logprobs(hidden, list(rows), list(targets))
        for i, (seq, target) in enumerate(zip(seqs, targets)):
            if not seq.status.is_finished:
                with failing_alone(seq):
                    seq.prompt_logprobs.append(self.logprob_entry(target, *(x[i] for x in scores),
                                                                  seq.sampling_params.prompt_logprobs))
