"""A checkpoint's generation_config.json: the sampling defaults its authors recommend, applied as vLLM does.

vLLM's `generation_config` engine argument:
- "auto" (the default): the model directory's generation_config.json sets the default temperature, top_p,
  top_k, min_p, repetition_penalty and max_tokens of requests that do not set their own;
- "vllm": vLLM's neutral defaults (SamplingParams()) instead;
- a directory: its generation_config.json instead of the model's.
`override_generation_config` (vLLM's, a dict of the same names) goes on top of the choice: merged into the
model's defaults under "auto", the only defaults under "vllm".
The file's `eos_token_id` (often a list, e.g. Llama 3's <|eot_id|> beside <|end_of_text|>) ends generation
whatever the choice, as in vLLM.
"""

import json
import logging
import os

from jax_engine.input_checks import check
from jax_engine.sampling_params import SamplingParams, generation_config_fields

logger = logging.getLogger(__name__)

FILE_NAME = "generation_config.json"


def read_generation_config(directory: str) -> dict:
    """The directory's generation_config.json as a dict; {} when it has none."""
    path = os.path.join(directory, FILE_NAME)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"{path!r} must hold a JSON object")
    return config


def resolve_generation_config(choice: str, model_generation_config: dict) -> dict:
    """The generation config the `generation_config` engine argument picks ("auto", "vllm" or a directory)."""
    check(isinstance(choice, str) and choice != "", "generation_config", "'auto', 'vllm' or a directory", choice)
    if choice in ("auto", "vllm"):
        return model_generation_config
    if not os.path.isfile(os.path.join(choice, FILE_NAME)):
        raise FileNotFoundError(f"generation_config={choice!r} is not 'auto', 'vllm' or a directory with {FILE_NAME}")
    return read_generation_config(choice)


def default_sampling_fields(args, generation_config: dict) -> dict:
    """SamplingParams fields that replace vLLM's defaults under EngineArgs `args`: those the generation config
    sets (none under generation_config "vllm"), then override_generation_config's. They are checked here, once:
    a bad value fails the engine's start, not every request that takes the defaults."""
    chosen = {} if args.generation_config == "vllm" else generation_config
    fields = generation_config_fields({**chosen, **(args.override_generation_config or {})})
    if fields:
        try:
            SamplingParams(**fields)
        except ValueError as error:
            raise ValueError(f"the generation config's sampling defaults: {error}") from None
        logger.info("default sampling parameters %s come from the model's generation config (and "
                    "override_generation_config); generation_config='vllm' ignores the model's", fields)
    return fields

