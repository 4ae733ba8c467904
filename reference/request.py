"""A request's state as it moves through the scheduler, and the sampling parameters it carries."""

import enum
import math
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    WAITING = enum.auto()  # queued; holds no blocks
    RUNNING = enum.auto()  # holds device blocks and is scheduled each step
    SWAPPED = enum.auto()  # preempted by swap: its blocks wait in the host pool
    FINISHED_STOPPED = enum.auto()  # sampled a stop token
    FINISHED_LENGTH = enum.auto()  # reached max_tokens
    FINISHED_ABORTED = enum.auto()  # aborted by the user

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        """vLLM's `finish_reason` string: "stop", "length" or "abort"."""
        reasons = {"FINISHED_STOPPED": "stop", "FINISHED_LENGTH": "length", "FINISHED_ABORTED": "abort"}
        return reasons.get(self.name)


def _check(ok: bool, name: str, limit: str, value) -> None:
    if not ok:
        raise ValueError(f"{name} must be {limit}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. Defaults follow vLLM (temperature 1, max_tokens 16).

    max_tokens None means "until max_model_len". temperature 0 means greedy. top_k 0 or -1, top_p 1 and min_p 0 disable those filters. With a `seed`,
    the token at position p is drawn from a random stream that depends only on (seed, p).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        t = self.temperature
        _check(isinstance(t, (int, float)) and math.isfinite(t) and t >= 0, "temperature", "a finite number >= 0", t)
        _check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "-1, 0 (disabled) or >= 1", self.top_k)
        _check(isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        m = self.max_tokens
        _check(m is None or (isinstance(m, int) and m >= 1), "max_tokens", ">= 1 or None", m)
        _check(self.seed is None or isinstance(self.seed, int), "seed", "an int or None", self.seed)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

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
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int | None = None  # prefix-cache hit on first admission

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
        stops = params.stop_token_ids + (() if params.ignore_eos else tuple(eos_token_ids))
        if last in stops:
            return RequestStatus.FINISHED_STOPPED
        if len(self.output_token_ids) >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
