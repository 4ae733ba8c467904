"""What every endpoint needs: the engine, the server's limits, and the checks on them."""

import asyncio
import hashlib
import logging
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from starlette.requests import Request

from jax_engine.async_llm_engine import AsyncLLMEngine
from jax_engine.beam_search import BeamSearchParams
from jax_engine.chat_content import resolve_content_format, template_text
from jax_engine.pooling_params import PoolingParams
from jax_engine.sampling_params import SamplingParams
from jax_engine.lora.request import LoRARequest
from jax_engine.server.errors import APIError, bad_request
from jax_engine.server.lora_adapters import ServedAdapters
from jax_engine.server.protocol import IGNORED_FIELDS, REQUEST_ID_PATTERN, RequestBody, SamplingRequest
from jax_engine.server.server_config import ServerConfig

logger = logging.getLogger(__name__)
_warned_fields: set[str] = set()  # the ignored fields already logged, once per process
T = TypeVar("T")


def api_key_tenant(api_key: bytes) -> str:
    """A name for the holder of an API key that does not reveal the key."""
    return hashlib.sha256(api_key).hexdigest()[:16]


class ServerState:
    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig) -> None:
        self.engine, self.config = engine, config
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.scheduler_config.max_model_len
        self.vocab_size = engine.engine.model_config.vocab_size
        # How messages' content reaches the chat template (jax_engine/chat_content.py), read once from it.
        self.content_format = resolve_content_format(config.chat_template_content_format,
                                                     template_text(self.tokenizer, config.chat_template))
        # One thread: HF tokenizers are not safe to call from several threads at once.
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        # Grammars compile on a thread of their own (waiting on the grammar worker process): a costly one never
        # holds up tokenization.
        self._grammar_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._grammar_thread.submit(engine.engine.grammar_compiler.prepare)
        self.adapters = ServedAdapters(engine, config.lora_modules, (config.model_name, *config.served_model_aliases))

    @property
    def model_name(self) -> str:
        return self.config.model_name

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name the base model is served under: the first is the one answers give."""
        return (self.config.model_name, *self.config.served_model_aliases)

    async def off_loop(self, work: Callable[[], T]) -> T:
        """Run tokenizer work (encoding, chat templates, decoding) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, work)

    @staticmethod
    def tenant(request: Request) -> str | None:
        """Whose turn the request waits for: its API key's tenant (None without keys)."""
        return getattr(request.state, "tenant", None)

    @staticmethod
    def header_request_id(request: Request) -> str | None:
        """vLLM's X-Request-Id header, which names the answer in place of the body's request_id; a 400 unless it
        is 1-256 visible ASCII characters (it is logged)."""
        value = request.headers.get("x-request-id")
        if value is not None and not re.fullmatch(REQUEST_ID_PATTERN, value):
            raise APIError(400, "the X-Request-Id header must be 1-256 visible ASCII characters", "X-Request-Id")
        return value

    def tokens_as_ids(self, body: SamplingRequest) -> bool:
        """Whether logprobs show tokens as token_id:N: the request's return_tokens_as_token_ids, else the
        server's flag (as vLLM: either one)."""
        return bool(body.return_tokens_as_token_ids or self.config.return_tokens_as_token_ids)

    def cache_salt(self, request: Request, salt: str | None) -> str | None:
        """The request's cache_salt, prefixed with its API key's tenant when tenants are isolated."""
        if self.config.prefix_cache_isolation == "none":
            return salt
        return f"{request.state.tenant}:{salt or ''}"

    def check_model(self, model: str | None) -> None:
        """A 400 unless `model` is None, one of the served model's names or one of its LoRA adapters'."""
        if model is not None and model not in self.model_names and model not in self.adapters.by_name:
            served = [*self.model_names, *self.adapters.by_name]
            raise APIError(400, f"model {model!r} does not exist; this server serves {served}", "model",
                           "model_not_found")

    def served_name(self, model: str | None) -> str:
        """The `model` an answer names: the request's adapter, or the served model."""
        return model if model in self.adapters.by_name else self.model_name

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names, or None for the base model."""
        return self.adapters.by_name.get(model)

    def check_fields(self, body: RequestBody) -> None:
        """A 400 naming the first field this server does not implement; a warning (once per name) for the fields
        it accepts and ignores (protocol.IGNORED_FIELDS)."""
        for name in body.model_extra or {}:
            if name not in IGNORED_FIELDS:
                raise APIError(400, f"{name} is not supported by this server", name, "unsupported_field")
            if name not in _warned_fields:
                _warned_fields.add(name)
                logger.warning("request field %r is accepted and ignored", name)

    async def sampling_params(self, body: SamplingRequest, max_tokens: int | None,
                              logprobs: int | None) -> SamplingParams | BeamSearchParams:
        """Check the fields, the model and n against this server, then build the request's SamplingParams
        (400 if bad), its grammar compiled off the event loop; BeamSearchParams with use_beam_search."""
        self.check_fields(body)
        self.check_model(body.model)
        self.check_n(body.n)
        defaults = self.engine.engine.default_sampling_fields
        try:
            if body.use_beam_search:  # refuses the fields it would not honour: no grammar to compile
                return body.beam_search_params(max_tokens, defaults)
            params = body.sampling_params(max_tokens, logprobs, defaults)
        except ValueError as error:
            raise bad_request(error) from None
        if params.structured_outputs is not None:  # compiled here so that an error names the field sent
            field, compiler = body.structured_output_field, self.engine.engine.grammar_compiler
            try:
                grammar = await asyncio.get_running_loop().run_in_executor(
                    self._grammar_thread, lambda: compiler.compile(params.structured_outputs, field))
                params._set("compiled_grammar", grammar)
            except ValueError as error:
                raise APIError(400, str(error), field) from None
        return params

    def check_cost(self, params: SamplingParams | BeamSearchParams | PoolingParams, prompt_lengths: list[int]) -> None:
        """A 400 naming the field to lower when a request (its prompts, of these token counts) would cost more
        than the server allows one request: tokens generated (or embedded), prompt tokens scored, grammar rows."""
        config = self.config
        if isinstance(params, PoolingParams):  # all the work is the inputs' tokens
            if sum(prompt_lengths) > config.max_request_tokens:
                raise APIError(400, f"input: {len(prompt_lengths)} inputs of {sum(prompt_lengths)} tokens in all are "
                               f"more than this server's limit of {config.max_request_tokens} tokens per request; "
                               "send fewer or shorter inputs", "input")
            return
        if isinstance(params, BeamSearchParams):  # beam_width beams, each up to max_tokens; nothing else costs
            params = SamplingParams(n=params.beam_width, max_tokens=params.max_tokens)
        n = params.n
        generated = n * sum(min(params.max_tokens or self.max_model_len, self.max_model_len - length)
                            for length in prompt_lengths)
        if generated > config.max_request_tokens:
            raise APIError(400, f"max_tokens: {len(prompt_lengths)} prompts x n={n} x up to "
                           f"{params.max_tokens or 'max_model_len'} tokens is {generated} tokens, more than this "
                           f"server's limit of {config.max_request_tokens} per request; lower max_tokens, n or "
                           "the number of prompts", "max_tokens")
        scored = sum(prompt_lengths) if params.prompt_logprobs is not None else 0
        if scored > config.max_scored_prompt_tokens:
            raise APIError(400, f"prompt_logprobs: scoring {scored} prompt tokens is more than this server's limit "
                           f"of {config.max_scored_prompt_tokens} per request", "prompt_logprobs")
        rows = n * len(prompt_lengths) if params.structured_outputs is not None else 0
        if rows > config.max_structured_rows:
            raise APIError(400, f"n: {len(prompt_lengths)} prompts x n={n} is {rows} sequences under a grammar, "
                           f"more than this server's limit of {config.max_structured_rows} per request", "n")

    def require_tokenizer(self, field: str, what: str) -> None:
        """A 400 naming `field` when the server runs without a tokenizer (--skip-tokenizer-init)."""
        if self.tokenizer is None:
            raise APIError(400, f"{field}: {what} needs the model's tokenizer, and this server was started with "
                           "--skip-tokenizer-init: send token ids (return_token_ids gives them back)", field)

    def check_text_fits(self, text: str, field: str) -> None:
        """A 400 naming `field` if `text` is too long to fit max_model_len tokens, before it is tokenized (4 MB of
        text kept the tokenizer's thread, which every request waits for, 1.9 s)."""
        try:
            self.engine.engine.input_processor.check_text_fits(text, field)
        except ValueError as error:
            raise APIError(400, str(error), field) from None

    def check_n(self, n: int) -> None:
        if n > self.config.max_n:
            raise APIError(400, f"n must be <= {self.config.max_n}, got {n}", "n")

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"{param} must be token ids in [0, {self.vocab_size}), got {bad[:5]}", param)
