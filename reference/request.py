"""A request's state as it moves through the scheduler, and the sampling parameters it carries."""

import enum
import math
from dataclasses import dataclass, field

import numpy as np


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


FLOAT32_MAX = float(np.finfo(np.float32).max)
# vLLM's rule: a positive temperature below this is raised to it (logits / 1e-5 overflow float32).
MIN_TEMPERATURE = 0.01
# What a sampler packs into int32 arrays; token ids must also be below the model's vocabulary size.
INT32_MAX = 2**31 - 1
MAX_STOP_TOKEN_IDS = 256
# Bounds on what one request's token controls may ask of every step's sampler.
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_BIAS = 100.0  # OpenAI's range for a bias: [-100, 100]
MAX_ALLOWED_TOKEN_IDS = 1 << 20
MAX_BAD_WORDS = 256


def _shown(value) -> str:
    """The value as an error message shows it: a 10 MB string or a 400-digit number is cut short."""
    if isinstance(value, int) and value.bit_length() > 256:  # repr() refuses over 4300 digits
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def check(ok: bool, name: str, limit: str, value) -> None:
    """Raise a ValueError naming the field, its limit and the value given, unless `ok`."""
    if not ok:
        raise ValueError(f"{name} must be {limit}, got {_shown(value)}")


def is_int(value) -> bool:
    """An integer, strictly: True and 1.0 are not (no bool-to-id or float-to-count coercion)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_unicode(text: str) -> bool:
    """Text that UTF-8 can encode: JSON and Python strings can hold lone surrogates ("\\ud800"), which no
    tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_int(value, name: str, low: int, high: int | None = None, optional: bool = False) -> int | None:
    """`value` as a Python int in [low, high] (or None if `optional`), or a ValueError naming the field."""
    if optional and value is None:
        return None
    limit = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
    check(is_int(value) and low <= value and (high is None or value <= high), name,
          limit + (" or None" if optional else ""), value)
    return int(value)


def check_real(value, name: str, low: float, high: float, low_open: bool = False) -> float:
    """`value` as a finite Python float in [low, high] ((low, high] if low_open), or a ValueError."""
    finite = is_int(value) or (isinstance(value, (float, np.floating)) and math.isfinite(value))
    in_range = finite and (low < value if low_open else low <= value) and value <= high
    check(in_range, name, f"a number in {'(' if low_open else '['}{low:g}, {high:g}]", value)
    return float(value)


def check_bool(value, name: str) -> bool:
    check(isinstance(value, (bool, np.bool_)), name, "true or false", value)
    return bool(value)


def token_id_tuple(value, name: str, max_len: int) -> tuple[int, ...]:
    """A list of token ids (ints >= 0, at most max_len of them) as a tuple."""
    check(isinstance(value, (list, tuple)) and len(value) <= max_len, name,
          f"a list of at most {max_len} token ids", value)
    return tuple(check_int(t, name, 0, INT32_MAX) for t in value)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. Defaults follow vLLM (temperature 1, max_tokens 16).

    max_tokens None means "until max_model_len". temperature 0 means greedy; a positive temperature below
    0.01 is raised to 0.01, as vLLM does. top_k 0 or -1, top_p 1 and min_p 0 disable those filters. With a
    `seed`, the token at position p is drawn from a random stream that depends only on (seed, p).
    Every field is checked on construction: a ValueError names the field and its limit.

    Token controls, applied to the logits before anything else (vLLM's order; see sampler.processed_logits):
    `allowed_token_ids` keeps only those tokens; `bad_words_token_ids` bans the last token of each word
    whose other tokens end the output so far; `logit_bias` adds a bias in [-100, 100] to a token's logit.
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
        temperature = check_real(self.temperature, "temperature", 0, FLOAT32_MAX)
        self._set("temperature", max(temperature, MIN_TEMPERATURE) if temperature > 0 else 0.0)
        self._set("top_p", check_real(self.top_p, "top_p", 0, 1, low_open=True))
        self._set("top_k", check_int(self.top_k, "top_k", -1, INT32_MAX))
        self._set("min_p", check_real(self.min_p, "min_p", 0, 1))
        self._set("max_tokens", check_int(self.max_tokens, "max_tokens", 1, optional=True))
        if self.seed is not None:
            check(is_int(self.seed) and -(2**63) <= self.seed < 2**64, "seed", "a 64-bit integer or None", self.seed)
            self._set("seed", int(self.seed))
        stop_token_ids = self.stop_token_ids if self.stop_token_ids is not None else ()
        self._set("stop_token_ids", token_id_tuple(stop_token_ids, "stop_token_ids", MAX_STOP_TOKEN_IDS))
        self._set("ignore_eos", check_bool(self.ignore_eos, "ignore_eos"))
        self._set("logit_bias", _logit_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            allowed = token_id_tuple(self.allowed_token_ids, "allowed_token_ids", MAX_ALLOWED_TOKEN_IDS)
            check(len(allowed) > 0, "allowed_token_ids", "a non-empty list of token ids or None", allowed)
            self._set("allowed_token_ids", allowed)
        words = self.bad_words_token_ids or ()
        check(isinstance(words, (list, tuple)) and len(words) <= MAX_BAD_WORDS, "bad_words_token_ids",
              f"at most {MAX_BAD_WORDS} token-id sequences", words)
        words = tuple(token_id_tuple(w, "bad_words_token_ids", MAX_STOP_TOKEN_IDS) for w in words)
        check(all(words), "bad_words_token_ids", "non-empty token-id sequences", words)
        self._set("bad_words_token_ids", words)

    def _set(self, name: str, value) -> None:
        """Store a checked field in its normal form (a frozen dataclass has no plain setattr)."""
        object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _logit_bias(bias) -> dict[int, float] | None:
    if bias is None:
        return None
    check(isinstance(bias, dict) and len(bias) <= MAX_LOGIT_BIAS, "logit_bias",
          f"a dict of at most {MAX_LOGIT_BIAS} token id -> bias entries", bias)
    return {check_int(token, "logit_bias", 0, INT32_MAX): check_real(value, "logit_bias", -MAX_BIAS, MAX_BIAS)
            for token, value in bias.items()}


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
    # vLLM's name: a request asking for prompt logprobs needs every prompt position computed, so it takes no
    # prefix-cache hits (the engine sets this from SamplingParams.prompt_logprobs).
    skip_reading_prefix_cache: bool = False

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
