"""vLLM's SamplingParams: the reference's sampling fields plus the rest of vLLM's API."""

import math
from dataclasses import dataclass, field

from reference.request import SamplingParams as _ReferenceSamplingParams

MAX_LOGPROBS = 20


def _check(ok: bool, name: str, limit: str, value) -> None:
    if not ok:
        raise ValueError(f"{name} must be {limit}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams(_ReferenceSamplingParams):
    """Sampling parameters for text generation, with vLLM's names and defaults.

    Validated on construction: a bad value raises ValueError naming the field and its limit.

    Args:
        n: number of completions per prompt.
        temperature: 0 is greedy; higher flattens the distribution.
        top_p: keep the smallest set of tokens whose probability reaches top_p.
        top_k: keep the k most likely tokens (0 or -1: all).
        min_p: keep tokens at least min_p times as likely as the most likely one.
        presence_penalty: subtracted from the logits of tokens already generated.
        frequency_penalty: subtracted once per earlier occurrence in the output.
        repetition_penalty: divides positive (multiplies negative) logits of tokens in prompt or output.
        seed: per-request seed; the token at position p depends only on (seed, p).
        stop: strings that end generation (not included in the text unless include_stop_str_in_output).
        stop_token_ids: tokens that end generation (included in token_ids).
        ignore_eos: keep generating after the end-of-sequence token.
        max_tokens: most tokens to generate; None means until max_model_len.
        min_tokens: stop tokens are suppressed until this many tokens were generated.
        logprobs: return this many top log-probabilities per generated token (plus the sampled one).
        prompt_logprobs: the same for every prompt token.
        skip_special_tokens: leave special tokens out of the text.
        include_stop_str_in_output: keep the matched stop string in the text.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = field(default=())
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        _check(isinstance(self.n, int) and self.n >= 1, "n", ">= 1", self.n)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and -2 <= value <= 2, name, "in [-2, 2]", value)
        r = self.repetition_penalty
        _check(isinstance(r, (int, float)) and math.isfinite(r) and r > 0, "repetition_penalty", "a finite number > 0", r)
        _check(all(isinstance(s, str) and s for s in stop), "stop", "a list of non-empty strings", self.stop)
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "a list of token ids >= 0", self.stop_token_ids)
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", ">= 0", self.min_tokens)
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS), name,
                   f"None or in [0, {MAX_LOGPROBS}]", value)

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
