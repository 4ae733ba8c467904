"""`speculative_config`: vLLM's dictionary, checked when the engine starts (a bad one never reaches a request)."""

from dataclasses import dataclass

from jax_engine.arg_choices import QUANTIZATIONS

# Drafts verified per sequence and step. Each is one more logits row through the sampler and one more token
# through the step, and the sampler's row buckets are compiled at start-up up to max_num_seqs x (1 + k).
MAX_SPECULATIVE_TOKENS = 8
METHODS = ("ngram", "draft_model")
# Drafting stops from this many running sequences when the config does not say (vLLM's default is never), by
# method. Measured on the 2-core CPU (docs/benchmarks.md, bench latency --speculative-config): n-gram drafts pay
# 2.2x at batch 1 on copy-heavy work, break even at batch 8, and cost up to a third of the decode rate at 8 and 32
# with GGUF weights; the default model drafting for itself in int8 pays 1.8-1.9x at batch 1 and 2, 1.24x at 4,
# and costs a tenth at 8.
DEFAULT_DISABLE_BY_BATCH_SIZE = {"ngram": 8, "draft_model": 5}
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size", "model",
        "quantization")


@dataclass(frozen=True)
class SpeculativeConfig:
    """What to draft, and how much.

    method: "ngram" (prompt lookup: copy what followed an earlier occurrence of the last n tokens), or
        "draft_model" (a smaller model with the target's vocabulary drafts its greedy tokens; the method a
        config with a "model" gets, as in vLLM).
    num_speculative_tokens: k, the most drafts verified per sequence and step.
    prompt_lookup_min, prompt_lookup_max: the n-gram lengths tried, longest first (vLLM: both 5 when neither is
        given, else the missing one equals the other).
    disable_by_batch_size: no drafts while this many sequences or more are running, where verifying them costs
        more than it saves (the method's DEFAULT_DISABLE_BY_BATCH_SIZE when the config leaves it out; None:
        never disabled).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE["ngram"]
    model: str | None = None
    quantization: str | None = None

    @classmethod
    def from_dict(cls, config: "dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """The config a user's dictionary asks for; ValueError naming the key and its limit if it is bad."""
        if config is None or isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict (JSON object), got {type(config).__name__}")
        unknown = sorted(set(config) - set(KEYS))
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {list(KEYS)}")
        method = config.get("method") or ("draft_model" if config.get("model") is not None else None)
        method = "ngram" if method == "[ngram]" else method  # vLLM's older spelling
        if method not in METHODS:
            raise ValueError(f"speculative_config['method'] must be one of {list(METHODS)}, got {method!r}")
        lookup_min, lookup_max = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
        lookup_min, lookup_max = lookup_min or lookup_max or 5, lookup_max or lookup_min or 5
        return cls(method, config.get("num_speculative_tokens"), lookup_min, lookup_max,
                   config.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE[method]), config.get("model"),
                   config.get("quantization"))

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, limit: str) -> None:
            if not ok:
                raise ValueError(f"speculative_config['{name}'] must be {limit}, got {getattr(self, name)!r}")

        k = self.num_speculative_tokens
        check(isinstance(k, int) and 1 <= k <= MAX_SPECULATIVE_TOKENS, "num_speculative_tokens",
              f"an int in [1, {MAX_SPECULATIVE_TOKENS}]")
        check(isinstance(self.prompt_lookup_min, int) and self.prompt_lookup_min >= 1, "prompt_lookup_min", ">= 1")
        check(isinstance(self.prompt_lookup_max, int) and self.prompt_lookup_max >= self.prompt_lookup_min,
              "prompt_lookup_max", f">= prompt_lookup_min ({self.prompt_lookup_min})")
        check(self.disable_by_batch_size is None or (isinstance(self.disable_by_batch_size, int)
                                                     and self.disable_by_batch_size >= 1),
              "disable_by_batch_size", "None or an int >= 1")
        drafting = self.method == "draft_model"
        check((self.model is not None) == drafting, "model",
              "a checkpoint or 'self' with method 'draft_model'" if drafting else "left out with method 'ngram'")
        check(self.model is None or isinstance(self.model, str), "model", "a checkpoint path or 'self'")
        check(self.quantization is None or (drafting and self.quantization in QUANTIZATIONS), "quantization",
              f"None or, with a draft model, one of {list(QUANTIZATIONS)}")
