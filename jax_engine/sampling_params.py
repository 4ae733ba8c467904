"""vLLM's SamplingParams: the reference's sampling fields plus the rest of vLLM's API."""

import copy
from dataclasses import dataclass, field

from jax_engine.input_checks import (FLOAT32_MAX, INT32_MAX, MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORDS,
                                     MAX_STOP_TOKEN_IDS, check, check_bool, check_int, check_real, is_int,
                                     is_unicode, logit_bias, token_id_tuple)
from jax_engine.structured_output import StructuredOutputsParams
from reference.request import SamplingParams as _ReferenceSamplingParams

MAX_LOGPROBS = 20
# Stop strings are searched for after every token of every sequence: bound the work one request can ask for.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LENGTH = 1024


def _stop_strings(stop) -> tuple[str, ...]:
    stop = [stop] if isinstance(stop, str) else stop
    check(isinstance(stop, (list, tuple)) and len(stop) <= MAX_STOP_STRINGS
          and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_LENGTH for s in stop), "stop",
          f"a string or a list of at most {MAX_STOP_STRINGS} non-empty strings of at most "
          f"{MAX_STOP_STRING_LENGTH} characters", stop)
    return tuple(stop)


@dataclass(frozen=True)
class SamplingParams(_ReferenceSamplingParams):
    """Sampling parameters for text generation, with vLLM's names and defaults.

    Validated on construction: a bad value raises ValueError naming the field and its limit.

    Args:
        n: number of completions per prompt (the engine allows at most max_num_seqs).
        temperature: 0 is greedy; higher flattens the distribution.
        top_p: keep the smallest set of tokens whose probability reaches top_p.
        top_k: keep the k most likely tokens (0 or -1: all; the engine allows at most the vocabulary size).
        min_p: keep tokens at least min_p times as likely as the most likely one.
        presence_penalty: subtracted from the logits of tokens already generated.
        frequency_penalty: subtracted once per earlier occurrence in the output.
        repetition_penalty: divides positive (multiplies negative) logits of tokens in prompt or output;
            in [0.01, 100].
        seed: per-request seed (64 bits, signed or not); the token at position p depends only on (seed, p).
        stop: strings that end generation (not included in the text unless include_stop_str_in_output);
            at most MAX_STOP_STRINGS of at most MAX_STOP_STRING_LENGTH characters.
        stop_token_ids: tokens that end generation (included in token_ids); at most 256.
        ignore_eos: keep generating after the end-of-sequence token.
        max_tokens: most tokens to generate; None means until max_model_len.
        min_tokens: stop tokens are suppressed until this many tokens were generated (<= max_tokens).
        logprobs: return this many top log-probabilities per generated token (plus the sampled one), <= 20.
        prompt_logprobs: the same for every prompt token.
        skip_special_tokens: leave special tokens out of the text.
        include_stop_str_in_output: keep the matched stop string in the text.
        logit_bias: {token id: bias in [-100, 100]} added to the logits (at most 300 entries).
        allowed_token_ids: sample only among these tokens.
        bad_words: words never generated: the last token of a word is banned wherever the output ends with
            its other tokens (each word tokenized alone and after a space, as vLLM does).
        truncate_prompt_tokens: keep only the prompt's last k tokens (left truncation); -1 keeps what
            max_model_len allows.
        structured_outputs: constrain the output to a JSON schema, a regex, a choice or a grammar
            (StructuredOutputsParams, or a dict of its fields).
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
    bad_words: tuple[str, ...] = ()
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Not fields (no user sets them), and never set on the user's object: the input processor sets them on the
    # engine's copy (`derived`). compiled_grammar is the llguidance grammar compiled from structured_outputs
    # (jax_engine/structured_output/grammar.py; the server compiles it into the params it builds itself);
    # allowed_mask is allowed_token_ids as a vocabulary-wide bitmask (sample/allowed_tokens.py).
    compiled_grammar = None
    allowed_mask = None

    def __post_init__(self) -> None:
        self._check_reference_fields()
        super().__post_init__()  # the oracle's range check, and vLLM's minimum temperature
        self._set("stop", _stop_strings(self.stop if self.stop is not None else ()))
        self._set("n", check_int(self.n, "n", 1))
        for name in ("presence_penalty", "frequency_penalty"):
            self._set(name, check_real(getattr(self, name), name, -2, 2))
        # Outside [0.01, 100], float32 logits divided or multiplied by the penalty overflow or vanish.
        self._set("repetition_penalty", check_real(self.repetition_penalty, "repetition_penalty", 0.01, 100))
        self._set("min_tokens", check_int(self.min_tokens, "min_tokens", 0))
        if self.max_tokens is not None:
            check(self.min_tokens <= self.max_tokens, "min_tokens", f"<= max_tokens ({self.max_tokens})",
                  self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            self._set(name, check_int(getattr(self, name), name, 0, MAX_LOGPROBS, optional=True))
        for name in ("skip_special_tokens", "include_stop_str_in_output"):
            self._set(name, check_bool(getattr(self, name), name))
        words = self.bad_words if self.bad_words is not None else ()
        check(isinstance(words, (list, tuple)) and len(words) <= MAX_BAD_WORDS
              and all(isinstance(w, str) and 0 < len(w) <= MAX_STOP_STRING_LENGTH and is_unicode(w) for w in words),
              "bad_words", f"a list of at most {MAX_BAD_WORDS} non-empty strings (valid Unicode) of at most "
              f"{MAX_STOP_STRING_LENGTH} characters", words)
        self._set("bad_words", tuple(words))
        if isinstance(self.structured_outputs, dict):
            self._set("structured_outputs", StructuredOutputsParams.from_dict(self.structured_outputs))
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "a StructuredOutputsParams, a dict of its fields, or None", self.structured_outputs)
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            self._set("truncate_prompt_tokens", check_int(self.truncate_prompt_tokens, "truncate_prompt_tokens", 1))

    def _check_reference_fields(self) -> None:
        """The fields the oracle's SamplingParams has, checked as hostile input and stored in their normal form
        (Python ints and floats, tuples), before the oracle's plain range check sees them."""
        self._set("temperature", check_real(self.temperature, "temperature", 0, FLOAT32_MAX))
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
        self._set("logit_bias", logit_bias(self.logit_bias))
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

    def bad_words_tokens(self, tokenizer) -> tuple[tuple[int, ...], ...]:
        """bad_words as token-id sequences in the model's tokenizer (vLLM's rule: each word alone and after a
        space, without special tokens)."""
        words = {tuple(tokenizer.encode(text, add_special_tokens=False))
                 for word in self.bad_words for text in (word, " " + word.lstrip())}
        return tuple(sorted(w for w in words if w))

    def derived(self, **values) -> "SamplingParams":
        """A copy carrying what one engine derived from these params (compiled_grammar, bad_words_token_ids): the
        caller's object stays as it was made, and may be sent to other engines, with other tokenizers."""
        params = copy.copy(self)  # the fields are checked already: no __post_init__ again
        for name, value in values.items():
            params._set(name, value)
        return params

    def clone(self) -> "SamplingParams":
        """A deep copy, as vLLM's clone: its lists, dicts and structured_outputs are its own (what an engine
        derived, a compiled grammar or a mask, is shared: it is never changed)."""
        derived = {id(v): v for v in (self.compiled_grammar, self.allowed_mask) if v is not None}
        return copy.deepcopy(self, derived)

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


# generation_config.json name -> SamplingParams field; vLLM's ModelConfig.get_diff_sampling_param reads these.
GENERATION_CONFIG_FIELDS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature",
                            "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}


def generation_config_fields(config: dict) -> dict:
    """The SamplingParams fields a generation config (or EngineArgs.override_generation_config) sets."""
    return {field: config[name] for name, field in GENERATION_CONFIG_FIELDS.items() if config.get(name) is not None}


def check_generation_overrides(overrides: dict | None) -> None:
    """EngineArgs.override_generation_config: None, or a dict of GENERATION_CONFIG_FIELDS' names whose values
    SamplingParams takes (here, not in jax_engine.loader: checking flags must not import the tokenizers)."""
    if overrides is None:
        return
    check(isinstance(overrides, dict) and set(overrides) <= GENERATION_CONFIG_FIELDS.keys(),
          "override_generation_config", f"None or a dict of {sorted(GENERATION_CONFIG_FIELDS)}", overrides)
    try:
        SamplingParams(**generation_config_fields(overrides))
    except ValueError as error:
        raise ValueError(f"override_generation_config: {error}") from None
