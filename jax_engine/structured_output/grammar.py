"""Grammars and matchers, on llguidance (why this library: docs/structured-output.md).

A request's StructuredOutputsParams becomes one llguidance grammar before the request is admitted (a bad or
too costly schema is a ValueError naming the field, never a failure in the middle of a batch): its size and
nesting are checked first (limits.py), then it is compiled and tried in a separate process (worker.py), then
compiled here once more into a prototype matcher. Each sequence owns a copy of the prototype: the parser state
after its output so far. Every step, the matchers of the rows being sampled write the bitmask of the tokens
they allow next (32 tokens per int32 word, bit t % 32 of word t // 32); the jitted sampler sends every other
token's logit to -inf. A matcher that passes one of the library's limits (LIMITS) mid-output ends its request with
an error whose stop_reason says why (GrammarError: a 400 naming the field over HTTP); the others go on.

The matcher lives on the host beside the sequence's tokens, so it survives preemption: recompute and swap
rebuild the KV cache of tokens the matcher has already consumed, and sample nothing it has not seen.
"""

import copy
import functools
import json
from dataclasses import dataclass

import llguidance
import numpy as np

from jax_engine.structured_output.limits import check_spec
from jax_engine.structured_output.mask_budget import MaskBudget
from jax_engine.structured_output.params import StructuredOutputsParams
from jax_engine.structured_output.worker import GrammarWorker, parser_limits

# Bits of a row that no grammar constrains: every token allowed.
ALL_ALLOWED = -1
# How llguidance says that a token is not in the grammar (its other errors are its limits).
REJECTED = "doesn't satisfy the grammar"


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask."""
    return (vocab_size + 31) // 32


def tokenizer_json(hf_tokenizer) -> str:
    """The fast tokenizer as JSON, without padding or truncation (as llguidance.hf.from_tokenizer reads it)."""
    backend = copy.copy(hf_tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


@dataclass(frozen=True)
class CompiledGrammar:
    """A request's grammar: its llguidance text, a matcher at its start that sequences copy (None in an API server
    whose engine core builds its own from the text), and the request field it came from (errors name it)."""

    text: str
    prototype: llguidance.LLMatcher | None
    field: str = "structured_outputs"


class GrammarError(RuntimeError):
    """A sequence's grammar stopped its output: its parser passed one of the library's limits (LIMITS; a row of
    more than 2,000 items, say) on a path that the check before admission could not reach. The request's grammar
    caused it, not the engine: a server answers 400 naming the grammar's field."""


class GrammarCompiler:
    """Turns StructuredOutputsParams into llguidance grammars and matchers for one model's tokenizer."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 builds_matchers: bool = True) -> None:
        """`builds_matchers`=False: compile() checks grammars and gives their text only (an API server whose engine
        core builds the matchers: building them here too would cost as much again, for nothing)."""
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.builds_matchers = builds_matchers
        self._json: str | None = None  # the tokenizer as JSON (tokenizer_json): made from `tokenizer`, or given
        self._worker: GrammarWorker | None = None
        self._executor = llguidance.LLExecutor()
        self._masks = MaskBudget(self._executor)

    @functools.cached_property
    def tokenizer(self) -> llguidance.LLTokenizer:  # built on first use (~0.25 s for 49k tokens)
        return llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids))

    def use_tokenizer_json(self, text: str) -> None:
        """The tokenizer as JSON (tokenizer_json's form), made already (an API server's), or the only form an
        engine core has of it (its API server holds the tokenizer and sends this before any request)."""
        if self._json is None:
            self._json = text

    def prepare(self) -> None:
        """Build the library's tokenizer and the worker's first message now: ~0.4 s that hold the GIL, which the
        first request with a grammar would otherwise make every other request wait (a server calls this at start,
        on its grammar thread). The worker process itself still starts on first use."""
        if self._hf_tokenizer is not None:
            _ = self.worker, self.builds_matchers and self.tokenizer
        elif self._json is not None and self.builds_matchers:  # an engine core, which compiles nothing itself
            _ = self.tokenizer

    @property
    def worker(self) -> GrammarWorker:
        if self._worker is None:
            self._worker = GrammarWorker(self._tokenizer_json, self.vocab_size, list(self.eos_token_ids))
        return self._worker

    @property
    def _tokenizer_json(self) -> str:  # ~0.12 s to make, for the tokenizer and the worker's first message
        if self._json is None:
            self._json = tokenizer_json(self._hf_tokenizer)
        return self._json

    def compile(self, params: StructuredOutputsParams, field: str | None = None) -> CompiledGrammar:
        """The compiled grammar for `params`; ValueError naming `field` (default: structured_outputs.<kind>)
        if it passes a limit or does not compile."""
        field = field or f"structured_outputs.{params.kind}"
        if self._hf_tokenizer is None:
            raise ValueError(f"{field} needs the tokenizer, which skip_tokenizer_init=True does not load: grammars "
                             "are matched against its tokens")
        spec = _spec_text(params)
        try:
            check_spec(params.kind, spec, field)
        except (json.JSONDecodeError, RecursionError) as error:  # JSON text that does not parse
            raise ValueError(f"{field} is invalid: {error}") from None
        text = self.worker.compile(params.kind, spec, params.disable_any_whitespace, field)
        return self.from_text(text, field) if self.builds_matchers else CompiledGrammar(text, None, field)

    def from_text(self, text: str, field: str = "structured_outputs") -> CompiledGrammar:
        """The grammar of llguidance `text` that compile() made and checked (in this process or another: the engine
        core process builds its matchers from the API server's grammars)."""
        prototype = llguidance.LLMatcher(self.tokenizer, text, log_level=0, limits=parser_limits())
        # Its first mask, here: the lexer states it builds are shared with every copy, so that no step builds them
        # (~0.8 s for a 500,000-character const).
        prototype.compute_bitmask()
        return CompiledGrammar(text, prototype, field)

    def matcher(self, grammar: CompiledGrammar) -> "GrammarMatcher":
        """A matcher at the grammar's start: a copy of its prototype (~0.1 ms; compiling again could take long)."""
        return GrammarMatcher(grammar.prototype.deep_copy())

    def fill_bitmask(self, matchers: list["GrammarMatcher | None"],
                     drafts: list[list[int]] | None = None) -> np.ndarray:
        """[len(matchers), bitmask_width] int32: row i holds what matchers[i] allows next (all for None). A
        matcher with drafts (speculative decoding) also fills the len(drafts[i]) rows after its own, each with
        what it allows after the drafts before that row; the matcher itself does not move."""
        bitmask = np.full((len(matchers), bitmask_width(self.vocab_size)), ALL_ALLOWED, np.int32)
        drafts = drafts or [[]] * len(matchers)
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None and not drafts[i]]
        drafted = [(m, i, drafts[i]) for i, m in enumerate(matchers) if m is not None and drafts[i]]
        self._masks.fill(rows, drafted, bitmask)  # in parallel, each mask's time bounded (mask_budget.py)
        return bitmask

    def close(self) -> None:
        """Stop the worker process (it also ends with this process)."""
        if self._worker is not None:
            self._worker.close()


def _spec_text(params: StructuredOutputsParams) -> str:
    """What the worker compiles for `params`: the schema as JSON, the regex, the choices as a JSON list, the
    grammar."""
    if params.kind in ("json", "json_object"):
        return params.json_text
    if params.kind == "choice":
        return json.dumps(list(params.choice))
    return params.regex if params.kind == "regex" else params.grammar


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, state: llguidance.LLMatcher) -> None:
        self.state = state
        self.over_budget: str | None = None  # why its masks cost too much time (mask_budget.py)

    @property
    def error(self) -> str | None:
        """Why the matcher stopped working (a token it rejected, a per-step budget passed), or None."""
        if self.over_budget is not None:
            return self.over_budget
        return self.state.get_error().replace("<non-verbose/>", "").strip() if self.state.is_error() else None

    def valid_prefix(self, tokens: list[int]) -> list[int]:
        """The longest prefix of `tokens` (drafts) the grammar allows from here; the matcher does not move."""
        return [] if self.state.is_stopped() else tokens[: self.state.validate_tokens(tokens)]

    def accept(self, token: int) -> None:
        """Advance past a sampled token; after the grammar has ended (an EOS was accepted) tokens are ignored,
        since only EOS tokens can follow (they repeat only with ignore_eos)."""
        if self.state.is_stopped():
            return
        if not self.state.consume_token(token):
            if REJECTED in self.error:  # the sampler took a token the mask forbade: the engine's fault
                raise RuntimeError(f"the grammar rejected token {token}: {self.error}")
            raise GrammarError(f"the grammar's parser stopped at token {token}, past one of its limits: "
                               f"{self.error[:500]}")
