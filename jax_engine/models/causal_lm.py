"""A decoder-only language model in Flax NNX, for every family: embed, a `lax.scan` over the stacked
layers, final norm, LM head. The family (models/registry.py) supplies its config translation, where each
weight comes from, and its decoder layer.

    token ids -> embed (+ learned positions) (-> embedding norm) -> L x family.layer -> final norm -> LM head

The scan compiles one layer body instead of L: 0.5 s per step shape instead of ~2.2 s for SmolLM2 on a
2-core CPU, so a cold start compiles the default 33 step shapes in ~20 s instead of ~75 s. Unrolled layers
also cost at run time, once per shape: XLA:CPU builds each matmul's YNNPACK pipeline on a program's first
call, ~3 ms per matmul, so every unrolled step shape's first step ran ~0.8 s late (210 matmuls), in the
middle of someone's stream. What the scan costs: XLA's dot reads a layer's weights through a copy sliced out
of the stack, 10-20% on float32 steps of 20-128 tokens; the few-rows kernel (small decode batches) and
16-bit and int8 weights (widened on the way anyway) read the stack in place. The paged KV cache is one array
for all layers, donated by the caller and updated in place by every layer in turn.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_engine.attention.metadata import AttentionFn, AttentionMetadata
from jax_engine.linear import dequantize, linear
from jax_engine.model_config import ModelConfig
from jax_engine.models.layers import ACTIVATIONS, StepContext, normalize
from jax_engine.models.registry import architecture
from jax_engine.models.rope import rope_frequencies, rope_tables
from jax_engine.models.weights import StoredWeights


class CausalLM(nnx.Module):
    """Decoder-only transformer; `__call__` runs a step's tokens through it over the paged cache."""

    def __init__(self, cfg: ModelConfig, layers: dict[str, jax.Array], top: dict[str, jax.Array]) -> None:
        """`layers`: every layer's weights stacked [L, ...] by name; `top`: embed, final_norm, lm_head, ..."""
        self.cfg = cfg
        self.layers = nnx.Dict({name: nnx.Param(a) for name, a in layers.items()})
        self.top = nnx.Dict({name: nnx.Param(a) for name, a in top.items()})

    @classmethod
    def from_hf_weights(cls, cfg: ModelConfig, weights, dtype=jnp.float32, quantization: str | None = None,
                        blocks: dict[str, np.ndarray] | None = None) -> "CausalLM":
        """Build the model from HF-named NumPy weights (Checkpoint.weights and .blocks).

        `quantization` ("bf16", "int8", "gguf" or None) is how the projections, the embedding and the LM head
        are stored; norms and biases keep `dtype`. "gguf" keeps the matrices found in `blocks` (a GGUF file's
        raw Q8_0 / Q4_0 / Q4_1 rows) as they are, and the rest in `dtype`.
        """
        if quantization == "gguf" and not blocks:
            raise ValueError("quantization='gguf' keeps a GGUF file's Q8_0 / Q4_0 / Q4_1 blocks, and this model has "
                             "none (Checkpoint.blocks is empty): pass a .gguf file with such tensors")
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={cfg.hidden_act!r} is not supported; supported: {sorted(ACTIVATIONS)}")
        spec = architecture(cfg.architecture).weights(cfg)
        stored = StoredWeights(weights, blocks or {}, quantization, dtype)
        return cls(cfg, stored.layers(spec, cfg.num_layers), stored.top(spec))

    # ---------------------------------------------------------------------------------- forward
    def __call__(self, token_ids: jax.Array, k_cache: jax.Array, v_cache: jax.Array, metadata: AttentionMetadata,
                 attention: AttentionFn) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Run a step's tokens; write their K/V; return final hidden states and the updated caches.

        Args:
            token_ids: [T] the step's new tokens (padding included).
            k_cache: [L, num_blocks, block_size, K, D] keys (donated by the caller).
            v_cache: [L, num_blocks, block_size, K, D] values.
            metadata: the batch layout shared by every attention backend.
            attention: the backend's paged-attention function.

        Returns:
            (hidden [T, H] after the final norm, k_cache, v_cache).
        """
        cfg, top = self.cfg, {name: p[...] for name, p in self.top.items()}
        L, num_blocks, block_size = k_cache.shape[:3]
        k_flat = k_cache.reshape(L, num_blocks * block_size, *k_cache.shape[3:])  # [L, S, K, D]
        rope = None
        if cfg.position_embedding == "rope":
            inv_freq, attention_factor = rope_frequencies(cfg.rotary_dim or cfg.head_dim, cfg.rope_theta,
                                                          cfg.rope_scaling, cfg.rope_freq_factors)
            rope = rope_tables(metadata.positions, inv_freq, attention_factor)
        layers = {name: p[...] for name, p in self.layers.items()}  # [L, ...] each
        layer_fn = architecture(cfg.architecture).layer

        def layer_step(carry, layer):
            x, k_flat, v_flat = carry
            ctx = StepContext(metadata, attention, block_size, rope, k_flat, v_flat)
            x = layer_fn(cfg, layers, layer, x, ctx)
            return (x, ctx.k_flat, ctx.v_flat), None

        carry = (self._embed(top, token_ids, metadata.positions, layers["attn_norm"].dtype), k_flat,
                 v_cache.reshape(k_flat.shape))
        (x, k_flat, v_flat), _ = jax.lax.scan(layer_step, carry, jnp.arange(L, dtype=jnp.int32))
        if "final_norm" in top:  # OPT's post-norm variants end without one
            x = normalize(cfg, x, top["final_norm"], top.get("final_norm_bias"))
        if "project_out" in top:  # OPT-350m: hidden -> the embedding's width
            x = linear(x, top["project_out"], None)
        return x, k_flat.reshape(k_cache.shape), v_flat.reshape(v_cache.shape)

    def _embed(self, top: dict, token_ids: jax.Array, positions: jax.Array, dtype) -> jax.Array:
        cfg = self.cfg
        scale = top.get("embed_scale")
        x = dequantize(top["embed"][token_ids], None if scale is None else scale[token_ids], dtype,
                       cfg.embedding_size or cfg.hidden_size)  # [T, E]
        if cfg.embedding_multiplier != 1.0:  # Gemma; in the activations' dtype, as HF does
            x = x * jnp.asarray(cfg.embedding_multiplier, dtype)
        if "project_in" in top:
            x = linear(x, top["project_in"], None).astype(dtype)
        if "positions" in top:  # learned absolute positions (OPT's table starts at position_offset)
            x = x + top["positions"][positions + cfg.position_offset]
        if "embed_norm" in top:  # BLOOM normalises the embeddings
            x = normalize(cfg, x, top["embed_norm"], top.get("embed_norm_bias"))
        return x

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[S, H] -> [S, V] float32 logits."""
        top = self.top
        name = "embed" if self.cfg.tie_word_embeddings else "lm_head"
        scale = top.get(f"{name}_scale")
        logits = linear(hidden, top[name][...], None if scale is None else scale[...], out_dtype=jnp.float32)
        return logits if "lm_head_bias" not in top else logits + top["lm_head_bias"][...].astype(jnp.float32)

