"""A user request and its sequences: one for plain sampling, n for parallel sampling, beams for beam search.

Parallel sampling computes the prompt once: only the first sequence is scheduled; when its prompt is done
the others fork from it (sharing every block) and each samples its own first token from the same logits.
Beam search forks the best beams and frees the pruned ones after every step (jax_engine/beam_search.py).
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from jax_engine.core.scheduler_output import SchedulerOutput
from jax_engine.beam_search import BeamSearchParams, BeamSearchSequence, BeamUpdate, select_candidates
from jax_engine.detokenizer import IncrementalDetokenizer, NoDetokenizer
from jax_engine.lora.request import LoRARequest
from jax_engine.outputs import RequestMetrics
from jax_engine.sample.sampler import SampledToken
from jax_engine.sampling_params import SamplingParams
from jax_engine.sequence import Sequence
from jax_engine.structured_output.grammar import GrammarCompiler


class SequenceFactory:
    """Makes a group's sequences: ids, resolved seeds, detokenizers, logprob lists, grammar matchers."""

    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], seed: int | None,
                 grammars: GrammarCompiler) -> None:
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.eos_token_ids = eos_token_ids
        self._rng = np.random.default_rng(seed)  # seeds for requests that set none

    def __call__(self, group: "SequenceGroup", index: int, params: SamplingParams, max_tokens: int,
                 metrics: RequestMetrics) -> Sequence:
        seq_id = group.request_id if index == 0 else f"{group.request_id}#{index}"
        seed = params.seed + index if params.seed is not None else int(self._rng.integers(2**31))
        detokenizer = NoDetokenizer() if self.tokenizer is None else IncrementalDetokenizer(
            self.tokenizer, group.prompt_token_ids, params.skip_special_tokens)
        seq = Sequence(seq_id, group.request_id, index, group.prompt_token_ids, params, group.arrival,
                       seed & 0xFFFFFFFF, params.max_tokens or max_tokens, self.eos_token_ids, detokenizer, metrics,
                       priority=group.priority)
        seq.lora_request = group.lora_request
        seq.logprobs = [] if params.logprobs is not None else None
        seq.prompt_logprobs = [None] if params.prompt_logprobs is not None else None
        if params.compiled_grammar is not None:  # each sample walks the grammar on its own
            seq.grammar = self.grammars.matcher(params.compiled_grammar)
        return seq


@dataclass
class SequenceGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    arrival: int  # the engine's arrival count: the scheduler's FCFS order
    priority: int  # vLLM's: lower runs first under scheduling_policy "priority" (0 under "fcfs")
    seqs: list[Sequence] = field(default_factory=list)  # every sequence, in output order
    completed_beams: list[BeamSearchSequence] = field(default_factory=list)
    lora_request: LoRARequest | None = None  # every sequence's adapter

    @classmethod
    def create(cls, request_id: str, prompt: str | None, token_ids: list[int],
               params: SamplingParams | BeamSearchParams, arrival: int, room: int, metrics: RequestMetrics,
               new_sequence: SequenceFactory, lora_request: LoRARequest | None = None,
               priority: int = 0) -> "SequenceGroup":
        """The group with its first sequence (to schedule) and, for n > 1, the samples that fork from it."""
        group = cls(request_id, prompt, token_ids, params, arrival, priority, lora_request=lora_request)
        if group.is_beam_search:  # beams read the top 2 x width logprobs of each step
            beam_params = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=True,
                                         logprobs=2 * params.beam_width)
            group.seqs.append(new_sequence(group, 0, beam_params, room, metrics))
            group.seqs[0].num_pending_forks = params.beam_width - 1  # its first step forks the other beams
        else:
            group.seqs = [new_sequence(group, i, params, room, metrics) for i in range(params.n)]
            for child in group.seqs[1:]:
                child.fork_parent = group.seqs[0]
            group.seqs[0].num_pending_forks = params.n - 1
        return group

    @property
    def is_beam_search(self) -> bool:
        return isinstance(self.params, BeamSearchParams)

    @property
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.status.is_finished]

    @property
    def finished(self) -> bool:
        return not self.live_seqs

    def sampling_seqs(self, seq: Sequence) -> list[Sequence]:
        """Who samples from `seq`'s logits row: itself and, once, the parallel samples that fork from it."""
        return [seq] + [child for child in self.seqs if child.fork_parent is seq and not child.status.is_finished]

    def propose(self, seq: Sequence, sampled: SampledToken) -> bool:
        """Beam search: keep a beam's top tokens as its proposals (beam_update picks among them)."""
        if self.is_beam_search:
            seq.beam_proposals = list(zip(sampled.top_ids.tolist(), sampled.top_logprobs.tolist()))
        return self.is_beam_search

    def beam_update(self, new_sequence: SequenceFactory, eos_token_ids: tuple[int, ...]) -> BeamUpdate | None:
        """Once every live beam proposed its next tokens: keep the best, fork, free the pruned (a plan for the
        scheduler). None while a beam has not proposed yet (it was preempted)."""
        beams, params = self.live_seqs, self.params
        if any(b.beam_proposals is None for b in beams):
            return None
        survivors, completed = select_candidates(beams, params, eos_token_ids)
        self.completed_beams += [BeamSearchSequence(c.beam.all_token_ids + [c.token], c.cum_logprob,
                                                    finish_reason="stop") for c in completed]
        update, used = BeamUpdate(), set()
        for candidate in survivors:
            beam = candidate.beam
            if id(beam) in used:  # the beam's first survivor continues it in place; later ones fork it
                child = new_sequence(self, len(self.seqs), beam.sampling_params, beam.max_tokens, beam.metrics)
                self.seqs.append(child)
                update.forks.append((beam, child))
                beam = child
            used.add(id(candidate.beam))
            update.appends.append((beam, candidate.token, candidate.logprob))
        for beam in beams:
            beam.beam_proposals = None
        update.pruned = [beam for beam in beams if id(beam) not in used]
        return update


def beam_updates(groups: dict[str, SequenceGroup], out: SchedulerOutput, new_sequence: SequenceFactory,
                 eos_token_ids: tuple[int, ...], failing_alone: Callable) -> list[BeamUpdate]:
    """A step's beam-search plans: every beam search (of the unfinished `groups`) that ran in step `out` and whose
    live beams have all proposed. One whose selection raises fails alone (`failing_alone`)."""
    updates = []
    for request_id in dict.fromkeys(s.seq.request_id for s in out.scheduled):
        group = groups.get(request_id)  # None: aborted while the step was in flight (async scheduling)
        if group is not None and group.is_beam_search and not group.finished:
            with failing_alone(group.seqs[0]):
                if (update := group.beam_update(new_sequence, eos_token_ids)) is not None:
                    updates.append(update)
    return updates
