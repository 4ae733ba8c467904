"""What every endpoint needs: the engine, the server's limits, and the checks on them."""

from dataclasses import dataclass

from jax_engine.async_llm_engine import AsyncLLMEngine
from jax_engine.sampling_params import SamplingParams
from jax_engine.server.errors import APIError, bad_request
from jax_engine.server.protocol import SamplingRequest


@dataclass(frozen=True)
class ServerConfig:
    """The server's own settings (the engine's are EngineArgs).

    Args:
        model_name: the name clients pass as `model` (and /v1/models lists).
        api_key: if set, every route but /health needs `Authorization: Bearer <api_key>`.
        max_n: the largest `n` (completions per prompt) a request may ask for.
        max_waiting_requests: past this many requests waiting to start, new ones get 503.
    """

    model_name: str
    api_key: str | None = None
    max_n: int = 16
    max_waiting_requests: int = 256


class ServerState:
    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig) -> None:
        self.engine, self.config = engine, config
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.scheduler_config.max_model_len
        self.vocab_size = engine.engine.model_config.vocab_size

    @property
    def model_name(self) -> str:
        return self.config.model_name

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(400, f"model {model!r} does not exist; this server serves {self.model_name!r}", "model",
                           "model_not_found")

    def sampling_params(self, body: SamplingRequest, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Check the model and n against this server, then build the request's SamplingParams (400 if bad)."""
        self.check_model(body.model)
        self.check_n(body.n)
        try:
            return body.sampling_params(max_tokens, logprobs)
        except ValueError as error:
            raise bad_request(error) from None

    def check_n(self, n: int) -> None:
        if n > self.config.max_n:
            raise APIError(400, f"n must be <= {self.config.max_n}, got {n}", "n")

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"{param} must be token ids in [0, {self.vocab_size}), got {bad[:5]}", param)
