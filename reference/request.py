"""A request's state as it moves through the scheduler, and the sampling parameters it carries."""

import enum
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    WAITING = enum.auto()  # queued; holds no blocks
    RUNNING = enum.auto()  # holds device blocks and is scheduled each step
    SWAPPED = enum.auto()  # preempted by swap: its blocks wait in the host pool
    FINISHED_STOPPED = enum.auto()  # sampled a stop token
    FINISHED_LENGTH = enum.auto()  # reached max_tokens
    FINISHED_ABORTED = enum.auto()  # aborted by the user
    FINISHED_ERROR = enum.auto()  # failed on its own (the engine's per-request fault isolation)

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        """vLLM's `finish_reason` string: "stop", "length", "abort" or "error"."""
        reasons = {"FINISHED_STOPPED": "stop", "FINISHED_LENGTH": "length", "FINISHED_ABORTED": "abort",
                   "FINISHED_ERROR": "error"}
        return reasons.get(self.name)


# vLLM's rule: a positive temperature below this is raised to it (logits / 1e-5 overflow float32).
MIN_TEMPERATURE = 0.01


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. Defaults follow vLLM (temperature 1, max_tokens 16).

    max_tokens None means "until max_model_len". temperature 0 means greedy; a positive temperature below
    0.01 is raised to 0.01, as vLLM does. top_k 0 or -1, top_p 1 and min_p 0 disable those filters. With a
    `seed`, the token at position p is drawn from a random stream that depends only on (seed, p).

    Token controls, applied to the logits before anything else (vLLM's order; see sampler.processed_logits):
    `allowed_token_ids` keeps only those tokens; `bad_words_token_ids` bans the last token of each word
    whose other tokens end the output so far; `logit_bias` adds a bias to a token's logit.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        # A plain range check, enough for the oracle's callers. The engine's SamplingParams
        # (jax_engine/sampling_params.py) refuses hostile input first: wrong types, NaN, huge lists.
        limits = [
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k >= -1, ">= -1"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, ">= 1 or None"),
            # An empty allowed set leaves nothing to sample; an empty word has no last token to ban.
            ("allowed_token_ids", self.allowed_token_ids is None or len(self.allowed_token_ids) > 0, "non-empty"),
            ("bad_words_token_ids", all(self.bad_words_token_ids), "non-empty token-id sequences"),
        ]
        for name, ok, limit in limits:
            if not ok:
                raise ValueError(f"{name} must be {limit}, got {getattr(self, name)!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)  # a frozen dataclass has no plain setattr

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Request:
    """One prompt being served. Its tokens are the prompt followed by everything sampled so far."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival: int  # arrival order; earlier arrivals are served first and preempted last
    priority: int = 0  # the "priority" policy serves lower values first (vLLM's); always 0 with "fcfs"
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int | None = None  # prefix-cache hit on first admission
    # vLLM's name: a request asking for prompt logprobs needs every prompt position computed, so it takes no
    # prefix-cache hits (the engine sets this from SamplingParams.prompt_logprobs).
    skip_reading_prefix_cache: bool = False
    # Speculative decoding: tokens a proposer drafted after the last one sampled. The next step computes them
    # after that token, as lookahead, and the target keeps the prefix of them that it verifies.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_num_tokens(self) -> int:
        """Prompt plus max_tokens: the most tokens this request can ever hold in the cache."""
        assert self.sampling_params.max_tokens is not None, "the scheduler resolves max_tokens=None on arrival"
        return len(self.prompt_token_ids) + self.sampling_params.max_tokens

    def stop_status(self, eos_token_ids: tuple[int, ...]) -> RequestStatus | None:
        """The finished status reached by the last sampled token, if any."""
        params, last = self.sampling_params, self.output_token_ids[-1]
        if last in params.stop_token_ids or (not params.ignore_eos and last in eos_token_ids):
            return RequestStatus.FINISHED_STOPPED
        if len(self.output_token_ids) >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
