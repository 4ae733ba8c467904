"""From what a user sends to token ids the engine can run: tokenize, then check every limit.

Reads only the tokenizer and the configuration, so a server may call it while a step runs. Every refusal
is a ValueError that names the field and its limit.
"""

import functools
from typing import NamedTuple

from jax_engine.beam_search import BeamSearchParams
from jax_engine.input_checks import check, is_int, is_unicode
from jax_engine.model_config import ModelConfig
from jax_engine.pooling_params import PoolingParams
from jax_engine.sample.allowed_tokens import allowed_token_mask
from jax_engine.sampling_params import MAX_LOGPROBS, SamplingParams
from jax_engine.structured_output.grammar import GrammarCompiler
from reference.scheduler import SchedulerConfig

Prompt = str | list[int] | dict
RequestParams = SamplingParams | BeamSearchParams | PoolingParams


class ProcessedRequest(NamedTuple):
    """A request as the engine runs it. `params` is the engine's own copy of the caller's SamplingParams, with
    what it derived (compiled grammar, tokenized bad words, allowed-token mask): the caller's object is never
    changed, so it can be reused, or sent to another engine with another tokenizer."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: RequestParams


def cache_salt(prompt: Prompt) -> str | None:
    """vLLM's `cache_salt` prompt field: prefix-cache hits only between prompts with the same salt."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    check(salt is None or (isinstance(salt, str) and salt != ""), "cache_salt", "a non-empty string or None", salt)
    return salt


def most_characters_that_fit(tokenizer, max_model_len: int) -> int:
    """No text longer than this is max_model_len tokens or fewer: a token covers at most as many characters as the
    longest entry of its vocabulary (a byte-level entry holds a character per byte), and twice that leaves room
    for normalizers that join characters. Longer text is refused before the tokenizer spends time on it: 4 MB
    took 1.9 s, on the thread that every request's tokenization waits for."""
    return 2 * max_model_len * max(map(len, tokenizer.get_vocab()))


def _check_needs_no_tokenizer(params: SamplingParams | BeamSearchParams) -> None:
    """Without a tokenizer (skip_tokenizer_init) there is no text: a ValueError naming the first field that
    needs one."""
    if isinstance(params, BeamSearchParams):
        return
    needs = (("stop", "stop strings are found in the text; use stop_token_ids"),
             ("bad_words", "words are tokenized by it"),
             ("structured_outputs", "grammars are matched against its tokens"))
    for name, why in needs:
        if getattr(params, name):
            raise ValueError(f"{name} needs the tokenizer, which skip_tokenizer_init=True does not load: {why}")


class InputProcessor:
    def __init__(self, tokenizer, model_config: ModelConfig, scheduler_config: SchedulerConfig,
                 grammar_compiler: GrammarCompiler, max_logprobs: int = MAX_LOGPROBS,
                 tokenized_elsewhere: bool = False) -> None:
        """`tokenized_elsewhere`: requests come checked and tokenized by an API server, which holds the tokenizer
        (an engine core's, which has none): what needs the tokenizer (stop strings, bad words) was done there."""
        self.tokenizer = tokenizer
        self.tokenized_elsewhere = tokenized_elsewhere
        self.max_logprobs = max_logprobs
        self.grammar_compiler = grammar_compiler
        self.vocab_size = model_config.vocab_size
        self.hidden_size = model_config.hidden_size
        self.max_model_len = scheduler_config.max_model_len
        self.max_num_seqs = scheduler_config.max_num_seqs

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """The longest prompt text worth tokenizing (most_characters_that_fit)."""
        return most_characters_that_fit(self.tokenizer, self.max_model_len)

    def check_text_fits(self, text: str, field: str) -> None:
        """A ValueError naming `field` if `text` is too long to fit max_model_len tokens, before tokenizing it."""
        check(len(text) <= self.max_prompt_chars, field, f"text of at most {self.max_prompt_chars} characters (no "
              f"longer text fits max_model_len={self.max_model_len} tokens)", len(text))

    def process(self, prompt: Prompt, params: RequestParams) -> ProcessedRequest:
        """Tokenize and check a request; returns its prompt text (or None), token ids and the engine's params."""
        cache_salt(prompt)
        keep = getattr(params, "truncate_prompt_tokens", None)
        text, token_ids = self._prompt_token_ids(prompt, truncating=keep is not None)
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if keep is not None:  # vLLM's left truncation: the prompt's last tokens (-1: as many as fit)
            token_ids = token_ids[-(self.max_model_len - 1 if keep == -1 else keep):]
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, vocab_size={self.vocab_size}), got {bad[:5]}")
        limit = self.max_model_len
        if isinstance(params, PoolingParams):  # no output: the prompt may fill max_model_len
            check(len(token_ids) <= limit, "prompt", f"at most max_model_len={limit} tokens", len(token_ids))
            check(params.dimensions is None or params.dimensions <= self.hidden_size, "dimensions",
                  f"at most the model's hidden size ({self.hidden_size})", params.dimensions)
            return ProcessedRequest(text, token_ids, params)
        room = limit - len(token_ids)
        if room < 1:
            raise ValueError(f"prompt ({len(token_ids)} tokens) leaves no room for output: it exceeds "
                             f"max_model_len={limit} - 1")
        if params.max_tokens is not None and params.max_tokens > room:  # the message names the field to lower
            raise ValueError(f"max_tokens ({params.max_tokens}) + prompt ({len(token_ids)} tokens) exceeds "
                             f"max_model_len={limit}")
        self._check_params_fit(params, room)
        if self.tokenizer is None and not self.tokenized_elsewhere:
            _check_needs_no_tokenizer(params)
        return ProcessedRequest(text, token_ids, self._engine_params(params))

    def _prompt_token_ids(self, prompt: Prompt, truncating: bool = False) -> tuple[str | None, list[int]]:
        """The prompt's text (None if only ids were given) and ids. `truncating` (truncate_prompt_tokens): text too
        long to fit is cut to its last max_prompt_chars characters before it is tokenized, which leaves more tokens
        than are kept; those are the whole text's unless merges would run differently across the cut (a run of one
        repeated character spanning it)."""
        if isinstance(prompt, dict):  # vLLM's TextPrompt / TokensPrompt (which may carry its text too)
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._prompt_token_ids(prompt["prompt_token_ids"])[1]
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            check(is_unicode(prompt), "prompt", "valid Unicode (no lone surrogates)", prompt)
            if self.tokenizer is None:
                raise ValueError("prompt must be token ids with skip_tokenizer_init=True (no tokenizer is loaded): a "
                                 "list of ints, or {'prompt_token_ids': [...]}")
            if not truncating:
                self.check_text_fits(prompt, "prompt")
            return prompt, self.tokenizer.encode(prompt[-self.max_prompt_chars:])
        if isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
            return None, [int(t) for t in prompt]
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def _check_params_fit(self, params: SamplingParams | BeamSearchParams, room: int) -> None:
        """The limits that depend on this engine: vocabulary, batch size, room left for output."""
        vocab, max_seqs = self.vocab_size, self.max_num_seqs
        if isinstance(params, BeamSearchParams):
            check(params.beam_width <= max_seqs, "beam_width", f"<= max_num_seqs ({max_seqs})", params.beam_width)
            return
        check(params.n <= max_seqs, "n", f"<= max_num_seqs ({max_seqs})", params.n)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            check(value is None or value <= self.max_logprobs, name, f"<= max_logprobs ({self.max_logprobs})", value)
        check(params.top_k <= vocab, "top_k", f"-1, 0 (disabled) or at most vocab_size ({vocab})", params.top_k)
        check(all(t < vocab for t in params.stop_token_ids), "stop_token_ids",
              f"token ids below vocab_size ({vocab})", params.stop_token_ids)
        check(params.min_tokens <= room, "min_tokens", f"<= the room left under max_model_len ({room} tokens)",
              params.min_tokens)
        check(all(t < vocab for t in params.allowed_token_ids or ()), "allowed_token_ids",
              f"token ids below vocab_size ({vocab})", params.allowed_token_ids)
        check(all(t < vocab for t in params.logit_bias or {}), "logit_bias", f"keyed by token ids below vocab_size "
              f"({vocab})", params.logit_bias)
        check(all(t < vocab for w in params.bad_words_token_ids for t in w), "bad_words_token_ids",
              f"token ids below vocab_size ({vocab})", params.bad_words_token_ids)

    def _engine_params(self, params: SamplingParams | BeamSearchParams) -> SamplingParams | BeamSearchParams:
        """The engine's copy of checked params, with what it derives once per request: the compiled grammar, the
        bad words in this tokenizer's ids, and the allowed-token bitmask (here, off the engine loop: up to 2^20
        ids to set bits for)."""
        if isinstance(params, BeamSearchParams):
            return params  # nothing to derive
        derived = {}
        if params.structured_outputs is not None and params.compiled_grammar is None:
            derived["compiled_grammar"] = self.grammar_compiler.compile(params.structured_outputs)
        if params.bad_words and not self.tokenized_elsewhere:  # else the API server's copy carries their ids
            words = params.bad_words_tokens(self.tokenizer)
            check(all(t < self.vocab_size for w in words for t in w), "bad_words",
                  f"words whose token ids are below vocab_size ({self.vocab_size})", params.bad_words)
            derived["bad_words_token_ids"] = words
        params = params.derived(**derived)
        if params.allowed_token_ids is not None:
            allowed_token_mask(params, self.vocab_size)  # kept on the engine's copy
        return params
