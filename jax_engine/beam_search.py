"""Beam search over forked sequences: beams share KV blocks; pruned beams free theirs.

Each step every live beam proposes its 2 x beam_width most likely next tokens. The best beam_width
(beam, token) pairs by cumulative log-probability survive: the first survivor of a beam continues in
place, later ones fork it (sharing every block, copy-on-write on the partial last block), and beams with
no survivor are freed. Candidates ending in EOS are set aside as completed. At max_tokens the best
beam_width of completed and live beams, ranked with the length penalty, are returned (vLLM's rules).
"""

from dataclasses import dataclass, field

from jax_engine.sampling_params import MAX_LOGPROBS
from jax_engine.input_checks import check, check_bool, check_int, check_real

# Each step reads the top 2 x beam_width log-probabilities, which the compiled sampler caps at MAX_LOGPROBS.
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam search parameters (length_penalty in [-10, 10]: length ** penalty stays a float). max_tokens
    None: up to max_model_len, as with SamplingParams (vLLM's server fills in the same for a request without it)."""

    beam_width: int
    max_tokens: int | None
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "beam_width", check_int(self.beam_width, "beam_width", 1, MAX_BEAM_WIDTH))
        object.__setattr__(self, "max_tokens", check_int(self.max_tokens, "max_tokens", 1, optional=True))
        object.__setattr__(self, "ignore_eos", check_bool(self.ignore_eos, "ignore_eos"))
        object.__setattr__(self, "length_penalty", check_real(self.length_penalty, "length_penalty", -10, 10))
        check(self.temperature == 0, "temperature", "0 for beam search (scores are log-probabilities)",
              self.temperature)


@dataclass
class BeamSearchSequence:
    """One finished beam: prompt and generated tokens, score inputs, text and why it ended."""

    tokens: list[int]
    cum_logprob: float
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence] = field(default_factory=list)


def beam_score(tokens: list[int], cum_logprob: float, eos_token_ids: tuple[int, ...], length_penalty: float) -> float:
    """vLLM's ranking: cumulative logprob over length ** length_penalty (EOS not counted)."""
    length = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    return cum_logprob / (length**length_penalty)


@dataclass
class Candidate:
    cum_logprob: float
    beam: object  # the Sequence it extends
    token: int
    logprob: float  # the token's own


@dataclass
class BeamUpdate:
    """One beam-search step as a plan the scheduler applies (update_from_output): forks first, so children
    copy their parent's tokens, then the pruned beams are freed, then each surviving beam appends its token."""

    forks: list[tuple[object, object]] = field(default_factory=list)  # (parent, new child) Sequences
    pruned: list = field(default_factory=list)
    appends: list[tuple[object, int, float]] = field(default_factory=list)  # (beam, token, logprob)


def select_candidates(live_beams: list, params: BeamSearchParams, eos_token_ids: tuple[int, ...]) -> tuple[list[Candidate], list[Candidate]]:
    """Split every beam's proposals into (surviving live candidates, completed EOS candidates)."""
    live, completed = [], []
    for beam in live_beams:
        for token, logprob in beam.beam_proposals:
            candidate = Candidate(beam.cumulative_logprob + logprob, beam, token, logprob)
            (completed if token in eos_token_ids and not params.ignore_eos else live).append(candidate)
    live.sort(key=lambda c: c.cum_logprob, reverse=True)
    return live[: params.beam_width], completed
