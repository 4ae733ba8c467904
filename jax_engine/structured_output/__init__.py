"""Structured output: constrain what a request may generate to a JSON schema, a regex, a choice or a grammar.

    StructuredOutputsParams (params.py)     what the user asked for (vLLM's names)
    GrammarCompiler (grammar.py)            -> an llguidance grammar, checked before the request is admitted
    GrammarMatcher (grammar.py)             one per sequence: the parser state, advanced by every sampled token,
                                            and the bitmask of the tokens allowed next
    MaskBudget (mask_budget.py)             each mask's time bounded: a matcher whose masks cost too much stops
    sampler.sample                          applies the bitmask inside the jitted sampler, before anything else
"""

from jax_engine.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
