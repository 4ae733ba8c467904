"""Grammars and matchers, on llguidance (why this library: docs/structured-output.md).

A request's StructuredOutputsParams becomes one llguidance grammar, compiled and checked against the model's
tokenizer before the request is admitted (a bad schema is a ValueError naming the field, never a failure in the
middle of a batch). Each sequence then owns a GrammarMatcher: the parser state after its output so far. Every
step, the matchers of the rows being sampled write the bitmask of the tokens they allow next (32 tokens per
int32 word, bit t % 32 of word t // 32); the jitted sampler sends every other token's logit to -inf.

The matcher lives on the host beside the sequence's tokens, so it survives preemption: recompute and swap
rebuild the KV cache of tokens the matcher has already consumed, and sample nothing it has not seen.
"""

import json

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np

from jax_engine.structured_output.params import StructuredOutputsParams

# Bits of a row that no grammar constrains: every token allowed.
ALL_ALLOWED = -1


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask."""
    return (vocab_size + 31) // 32


def _json_schema_options(schema_text: str, compact: bool) -> str:
    """llguidance's JSON grammar with vLLM's whitespace rule: any whitespace, or none (compact)."""
    schema = json.loads(schema_text)
    if compact and isinstance(schema, dict):
        schema = {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ",",
                                           "key_separator": ":"}}
    return json.dumps(schema)


class GrammarCompiler:
    """Turns StructuredOutputsParams into llguidance grammars and matchers for one model's tokenizer."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~0.25 s for 49k tokens)
        self._executor = llguidance.LLExecutor()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                           eos_token=list(self.eos_token_ids))
        return self._tokenizer

    def compile(self, params: StructuredOutputsParams, field: str | None = None) -> str:
        """The llguidance grammar for `params`; ValueError naming `field` (default: structured_outputs.<kind>)
        if it does not compile."""
        field = field or f"structured_outputs.{params.kind}"
        try:
            grammar = self._grammar(params)
        except (ValueError, TypeError) as error:  # JSON text that does not parse, an unknown format
            raise ValueError(f"{field} is invalid: {error}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(f"{field} is invalid: {error.strip()}")
        return grammar

    @staticmethod
    def _grammar(params: StructuredOutputsParams) -> str:
        kind = params.kind
        if kind in ("json", "json_object"):
            return llguidance.grammar_from("json_schema",
                                           _json_schema_options(params.json_text, params.disable_any_whitespace))
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(list(params.choice)))
        if kind == "regex":
            return llguidance.grammar_from("regex", params.regex)
        return llguidance.grammar_from("grammar", params.grammar)  # Lark or GBNF, told apart by llguidance

    def matcher(self, grammar: str) -> "GrammarMatcher":
        return GrammarMatcher(llguidance.LLMatcher(self.tokenizer, grammar))

    def fill_bitmask(self, matchers: list["GrammarMatcher | None"]) -> np.ndarray:
        """[len(matchers), bitmask_width] int32: row i holds what matchers[i] allows next (all for None)."""
        bitmask = np.full((len(matchers), bitmask_width(self.vocab_size)), ALL_ALLOWED, np.int32)
        rows = [(m.state, i) for i, m in enumerate(matchers) if m is not None]
        if rows:  # the rows in parallel, outside the GIL
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, rows, bitmask)
        return bitmask


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, state: llguidance.LLMatcher) -> None:
        self.state = state

    def accept(self, token: int) -> None:
        """Advance past a sampled token; after the grammar has ended (an EOS was accepted) tokens are ignored,
        since only EOS tokens can follow (they repeat only with ignore_eos)."""
        if self.state.is_stopped():
            return
        if not self.state.consume_token(token):
            raise RuntimeError(f"the grammar rejected token {token}: {self.state.get_error()}")
