"""A user request and its sequences: one for plain sampling, n for parallel sampling, beams for beam search.

Parallel sampling computes the prompt once: only the first sequence is scheduled; when its prompt is done
the others fork from it (sharing every block) and each samples its own first token from the same logits.
"""

from dataclasses import dataclass, field

from jax_engine.beam_search import BeamSearchParams, BeamSearchSequence
from jax_engine.request import Request
from jax_engine.sampling_params import SamplingParams


@dataclass
class SequenceGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    seqs: list[Request] = field(default_factory=list)  # every sequence, in output order
    pending_forks: list[Request] = field(default_factory=list)  # parallel samples not forked yet
    completed_beams: list[BeamSearchSequence] = field(default_factory=list)

    @property
    def is_beam_search(self) -> bool:
        return isinstance(self.params, BeamSearchParams)

    @property
    def live_seqs(self) -> list[Request]:
        return [s for s in self.seqs if not s.status.is_finished]

    @property
    def finished(self) -> bool:
        return not self.live_seqs
