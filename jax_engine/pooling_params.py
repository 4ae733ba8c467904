"""Embeddings: what an engine started with task="embed" does with a prompt (vLLM's pooling runner).

A pooling request is a prompt without output: the engine computes its tokens as it computes any prompt (paged,
batched, in chunks) and its pooler (jax_engine/pooler.py) turns the final hidden states of the prompt's tokens
into one vector instead of sampling a token.
"""

from dataclasses import dataclass

from jax_engine.input_checks import check, check_bool, check_int

TASKS = ("generate", "embed")
POOLING_TYPES = ("LAST", "MEAN")


@dataclass(frozen=True)
class PoolerConfig:
    """How an embedding engine pools (vLLM's PoolerConfig; EngineArgs.pooler_config, --pooler-config JSON).

    Args:
        pooling_type: "LAST", the hidden state of the prompt's last token (vLLM's default for decoder models,
            which see the whole prompt only there), or "MEAN", the average over every prompt token.
        normalize: scale each vector to unit length, unless a request's PoolingParams says otherwise.
    """

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config.pooling_type must be one of {list(POOLING_TYPES)}, got "
                             f"{self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config.normalize must be a bool, got {self.normalize!r}")

    @classmethod
    def of(cls, value: "PoolerConfig | dict | None") -> "PoolerConfig":
        """EngineArgs.pooler_config as given (a PoolerConfig, a dict of its fields, or None for the defaults)."""
        if isinstance(value, PoolerConfig):
            return value
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"pooler_config must be None or a dict (pooling_type, normalize), got {value!r}")
        unknown = set(value or {}) - {"pooling_type", "normalize"}
        if unknown:
            raise ValueError(f"pooler_config has unknown keys {sorted(unknown)}; known: pooling_type, normalize")
        return cls(**(value or {}))


def check_task_args(task: str, pooler_config, speculative_config) -> None:
    """EngineArgs' task and pooler_config (and what a task excludes), or a ValueError naming the argument."""
    check(task in TASKS, "task", f"one of {list(TASKS)}", task)
    PoolerConfig.of(pooler_config)  # raises naming the bad key
    if pooler_config is not None and task != "embed":
        raise ValueError(f"pooler_config is for task='embed', got task={task!r}")
    if task == "embed" and speculative_config is not None:
        raise ValueError("speculative_config speeds up generating; task='embed' generates nothing: leave it None")


@dataclass(frozen=True)
class PoolingParams:
    """Per-request settings of an embedding (vLLM's PoolingParams).

    Args:
        normalize: unit length or not; None takes the engine's PoolerConfig.normalize.
        dimensions: keep the first `dimensions` of the hidden size's values (Matryoshka truncation, OpenAI's
            field), before normalizing; None keeps them all.
        truncate_prompt_tokens: keep only the prompt's last this many tokens (-1: as many as max_model_len
            holds), as SamplingParams' field.
    """

    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.normalize is not None:
            check_bool(self.normalize, "normalize")
        check_int(self.dimensions, "dimensions", 1, optional=True)
        if self.truncate_prompt_tokens != -1:
            check_int(self.truncate_prompt_tokens, "truncate_prompt_tokens", 1, optional=True)


def check_task(embeds: bool, params) -> None:
    """A ValueError unless the request fits the engine (`embeds`: started with task "embed"): PoolingParams for
    task "embed", others for "generate"."""
    if isinstance(params, PoolingParams) == embeds:
        return
    if embeds:
        raise ValueError("task: this engine was started with task='embed', for embeddings (LLM.embed, /v1/embeddings),"
                         " not text; start one with task='generate' to generate")
    raise ValueError("task: embeddings need an engine started with task='embed' (--task embed); this one "
                     "generates text")
