"""What generate() returns: vLLM's RequestOutput and CompletionOutput; and what embed() returns."""

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Logprob:
    """The log-probability of one token, its rank in the distribution, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob (the sampled or prompt token, plus the top-k alternatives).
PositionLogprobs = dict[int, Logprob]


@dataclass
class RequestMetrics:
    """Timestamps (time.time()) of a request's life, for latency figures."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    """One completion of a prompt (there are n of them)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop", "length" or "abort"; None while running
    # The stop token id or stop string that ended it; with finish_reason "error", why its grammar stopped it (a
    # str: the grammar passed one of its parser's limits), if that was the error.
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its completions so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)


@dataclass
class PoolingOutput:
    """A pooling request's vector (vLLM's PoolingOutput; a NumPy array here, a tensor there)."""

    data: np.ndarray


@dataclass
class PoolingRequestOutput:
    """What an embedding engine returns for a prompt (vLLM's PoolingRequestOutput): reported once, finished. An
    aborted request's data is empty."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class EmbeddingOutput:
    """An embedding as a list of floats (vLLM's EmbeddingOutput)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What LLM.embed returns for a prompt (vLLM's EmbeddingRequestOutput)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(output.request_id, EmbeddingOutput(output.outputs.data.tolist()), output.prompt_token_ids,
                   output.finished)
