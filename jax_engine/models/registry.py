"""Every model family the engine runs, by HF `model_type` (config.json), and the one lookup of them."""

from jax_engine.models.architecture import Architecture
from jax_engine.models.bloom import BLOOM
from jax_engine.models.falcon import FALCON
from jax_engine.models.gemma import GEMMA
from jax_engine.models.gemma2 import GEMMA2
from jax_engine.models.gemma3 import GEMMA3
from jax_engine.models.gpt2 import GPT2, GPT_BIGCODE
from jax_engine.models.gpt_neox import GPT_NEOX
from jax_engine.models.gptj import GPTJ
from jax_engine.models.llama import LLAMA, MISTRAL, QWEN2, QWEN3
from jax_engine.models.mpt import MPT
from jax_engine.models.opt import OPT
from jax_engine.models.phi3 import PHI3

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    LLAMA, MISTRAL, QWEN2, QWEN3, OPT, GPT2, GPT_BIGCODE, GPT_NEOX, GPTJ, FALCON, BLOOM, MPT, PHI3, GEMMA, GEMMA2, GEMMA3)}


def architecture(model_type: str | None) -> Architecture:
    """The family of HF `model_type`; a ValueError naming the supported ones for any other."""
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type={model_type!r} is not supported; supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[model_type]
