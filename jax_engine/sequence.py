"""One sequence being generated, as the engine tracks it (vLLM v0's and nano-vllm's `Sequence`).

A request with `n` completions, or a beam search, becomes several of these, held together by its
SequenceGroup (jax_engine/sequence_group.py) and reported as one RequestOutput. The reference's
`Request` is one sequence too: it has no parallel sampling of its own.
"""

from dataclasses import dataclass, field

from jax_engine.detokenizer import IncrementalDetokenizer
from jax_engine.lora.request import LoRARequest
from jax_engine.outputs import PositionLogprobs, RequestMetrics
from jax_engine.sampling_params import SamplingParams
from jax_engine.structured_output.grammar import GrammarMatcher
from reference.request import RequestStatus


@dataclass(eq=False)
class Sequence:
    seq_id: str  # unique per sequence: "<request id>" or "<request id>#<index>" for later samples and beams
    request_id: str  # the user's request it belongs to
    index: int  # which of the request's sequences
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival: int
    seed: int  # resolved seed: the user's seed + index, or one drawn by the engine
    max_tokens: int  # resolved: SamplingParams.max_tokens or the room left under max_model_len
    eos_token_ids: tuple[int, ...]
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    all_token_ids: list[int] = field(default_factory=list)
    priority: int = 0  # with arrival, its place in the scheduler's queues (reference/scheduling_policy.py)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    stop_reason: int | str | None = None
    beam_proposals: list[tuple[int, float]] | None = None  # beam search: (token, logprob) this step
    fork_parent: "Sequence | None" = None  # a parallel sample waiting for its parent's prompt to be computed
    num_pending_forks: int = 0  # sequences still to fork from this one (parallel samples, the first beams)
    grammar: GrammarMatcher | None = None  # structured output: where its output stands in its grammar
    spec_token_ids: list[int] = field(default_factory=list)  # drafts the next step verifies (jax_engine/spec_decode)
    lora_request: LoRARequest | None = None  # the adapter it runs with (jax_engine/lora/); None: the base model

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    def adopt(self, parent: "Sequence") -> None:
        """Take over a parent's tokens and progress: this sequence was just forked from it."""
        self.all_token_ids = list(parent.all_token_ids)
        self.num_computed_tokens = parent.num_computed_tokens
        self.num_cached_tokens = parent.num_cached_tokens
        self.cumulative_logprob = parent.cumulative_logprob

    @property
    def max_num_running_seqs(self) -> int:
        """The rows this sequence will take once its pending forks run: the scheduler admits it only when they
        fit under max_num_seqs (vLLM v0's `get_max_num_running_seqs`)."""
        return 1 + self.num_pending_forks

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Prompt logprobs need every prompt position computed: no prefix-cache hits (the reference's field)."""
        return getattr(self.sampling_params, "prompt_logprobs", None) is not None

    @property
    def token_ids(self) -> list[int]:
        return self.all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    def tokens_to_compute(self, n: int) -> list[int]:
        """The next n tokens whose K/V a step computes: from num_computed_tokens on, drafts after the last token."""
        tokens = self.all_token_ids + self.spec_token_ids if self.spec_token_ids else self.all_token_ids
        return tokens[self.num_computed_tokens : self.num_computed_tokens + n]

    def drop_last_tokens(self, tokens: list) -> None:
        """Take back the last appended tokens (SampledTokens): a stop string ended the text before them."""
        if tokens:
            del self.all_token_ids[-len(tokens) :]
            self.cumulative_logprob -= sum(token.logprob for token in tokens)

    def append_token(self, token_id: int, logprob: float = 0.0) -> RequestStatus | None:
        """Record a sampled token; return the finished status it causes, if any."""
        self.all_token_ids.append(token_id)
        self.cumulative_logprob += logprob
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                self.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED  # vLLM leaves stop_reason None for EOS
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
