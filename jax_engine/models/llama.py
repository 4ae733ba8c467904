"""Llama-family decoder in Flax NNX: every layer's weights stacked, the layers a `lax.scan` in the step's graph.

The scan compiles one layer body instead of 30: 0.5 s per step shape instead of ~2.2 s for SmolLM2 on a
2-core CPU, so a cold start compiles the default 33 step shapes in ~20 s instead of ~75 s. Unrolled layers
also cost at run time, once per shape: XLA:CPU builds each matmul's YNNPACK pipeline on a program's first
call, ~3 ms per matmul, so every unrolled step shape's first step ran ~0.8 s late (210 matmuls), in the
middle of someone's stream. What the scan costs: XLA's dot reads a layer's weights through a copy sliced out
of the stack, 10-20% on float32 steps of 20-128 tokens; the few-rows kernel (small decode batches) and
16-bit and int8 weights (widened on the way anyway) read the stack in place. The paged KV cache is one array
for all layers, donated by the caller and updated in place by every layer in turn.

Dimension names: T tokens, H hidden, N query heads, K KV heads, D head dim, I MLP width, V vocab, L layers.
"""


import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_engine.attention.metadata import AttentionFn, AttentionMetadata
from jax_engine.linear import dequantize, linear, quantize
from jax_engine.model_config import ModelConfig


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)  # normalise in float32 like HF, whatever the weights' dtype
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x [T, heads, D]; cos, sin [T, 1, D/2] (float32)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = positions.astype(jnp.float32)[:, None, None] * inv_freq[None, None, :]  # [T, 1, D/2]
    return jnp.cos(angles), jnp.sin(angles)


# HF projection (per layer) -> our name. Projections stay 2-D [out, in] matrices, the checkpoint's own layout,
# with the heads split after the matmul: each output feature's weights lie together, which is how the
# few-rows matmul kernel streams them, and how int8 weights keep one scale per output feature.
PROJECTIONS = {"self_attn.q_proj": "wq", "self_attn.k_proj": "wk", "self_attn.v_proj": "wv", "self_attn.o_proj": "wo",
               "mlp.gate_proj": "w_gate", "mlp.up_proj": "w_up", "mlp.down_proj": "w_down"}


# HF parameter name (per layer) -> (our name, how to reshape the HF array; None for a projection).
def _layer_weight_map(cfg: ModelConfig) -> dict[str, tuple[str, callable]]:
    N, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    m = {
        "input_layernorm.weight": ("attn_norm", lambda w: w),
        "post_attention_layernorm.weight": ("mlp_norm", lambda w: w),
    }
    m |= {f"{hf}.weight": (name, None) for hf, name in PROJECTIONS.items()}  # kept [out, in]: see linear/
    if cfg.attention_bias:
        m |= {
            "self_attn.q_proj.bias": ("bq", lambda w: w.reshape(N, D)),
            "self_attn.k_proj.bias": ("bk", lambda w: w.reshape(K, D)),
            "self_attn.v_proj.bias": ("bv", lambda w: w.reshape(K, D)),
        }
    if cfg.qk_norm:
        m |= {"self_attn.q_norm.weight": ("q_norm", lambda w: w), "self_attn.k_norm.weight": ("k_norm", lambda w: w)}
    return m


class LlamaForCausalLM(nnx.Module):
    """Decoder-only transformer; `__call__` runs a step's tokens through it over the paged cache."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None) -> None:
        """Random weights from `rngs`; with rngs=None, zeros to be replaced (see from_hf_weights)."""
        self.cfg = cfg
        L, H, N, K, D, I, V = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                               cfg.intermediate_size, cfg.vocab_size)
        if rngs is None:
            new = lambda shape: jnp.zeros(shape, dtype)  # noqa: E731
        else:
            new = lambda shape: nnx.initializers.normal(0.02)(rngs.params(), shape, dtype)  # noqa: E731
        shapes = {"attn_norm": (H,), "mlp_norm": (H,), "wq": (N * D, H), "wk": (K * D, H), "wv": (K * D, H),
                  "wo": (H, N * D), "w_gate": (I, H), "w_up": (I, H), "w_down": (H, I)}
        if cfg.attention_bias:
            shapes |= {"bq": (N, D), "bk": (K, D), "bv": (K, D)}
        if cfg.qk_norm:
            shapes |= {"q_norm": (D,), "k_norm": (D,)}
        # Every layer's weights stacked along a leading L axis, by name (the scan in __call__ walks it).
        self.layers = nnx.Dict({name: nnx.Param(new((L, *shape))) for name, shape in shapes.items()})
        self.embed = nnx.Param(new((V, H)))  # [V, H]
        self.final_norm = nnx.Param(jnp.ones((H,), dtype))
        self.lm_head = None if cfg.tie_word_embeddings else nnx.Param(new((V, H)))
        # Scales of int8 weights (see linear/quantization.py), by the weight's name; empty in float.
        self.embed_scale, self.lm_head_scale = nnx.data(None), nnx.data(None)

    # ---------------------------------------------------------------------------------- weights
    @classmethod
    def from_hf_weights(cls, cfg: ModelConfig, weights: dict[str, np.ndarray], dtype=jnp.float32,
                        quantization: str | None = None, blocks: dict[str, np.ndarray] | None = None
                        ) -> "LlamaForCausalLM":
        """Build the model directly from HF-named NumPy weights (no random initialisation).

        `quantization` ("bf16", "int8", "gguf" or None) is how the projections, the embedding and the LM head
        are stored; norms and biases keep `dtype`. "gguf" keeps the matrices found in `blocks` (a GGUF file's
        raw Q8_0 / Q4_0 / Q4_1 rows, Checkpoint.blocks) as they are, and the rest in `dtype`.
        """
        if quantization == "gguf" and not blocks:
            raise ValueError("quantization='gguf' keeps a GGUF file's Q8_0 / Q4_0 / Q4_1 blocks, and this model has "
                             "none (Checkpoint.blocks is empty): pass a .gguf file with such tensors")
        # Shapes only, no values: tracing a random initialiser per weight took ~2 s.
        model = nnx.eval_shape(lambda: cls(cfg, dtype=dtype, rngs=None))
        stored = functools.partial(_stored_matrix, weights=weights, blocks=blocks or {}, quantization=quantization,
                                   dtype=dtype)
        for hf_name, (name, reshape) in _layer_weight_map(cfg).items():
            names = [f"model.layers.{i}.{hf_name}" for i in range(cfg.num_layers)]
            if reshape is None:
                model.layers[name], scale = stored(names)
                if scale is not None:
                    model.layers[f"{name}_scale"] = scale
            else:
                model.layers[name] = nnx.Param(jnp.asarray(np.stack([reshape(weights[n]) for n in names]), dtype))
        model.embed, model.embed_scale = stored("model.embed_tokens.weight")
        model.final_norm = nnx.Param(jnp.asarray(weights["model.norm.weight"], dtype))
        if not cfg.tie_word_embeddings:
            model.lm_head, model.lm_head_scale = stored("lm_head.weight")
        return model

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
        cfg = self.cfg
        L, num_blocks, block_size = k_cache.shape[:3]
        k_flat = k_cache.reshape(L, num_blocks * block_size, *k_cache.shape[3:])  # [L, S, K, D]
        v_flat = v_cache.reshape(k_flat.shape)
        cos, sin = rope_tables(metadata.positions, cfg.head_dim, cfg.rope_theta)
        scale = None if self.embed_scale is None else self.embed_scale[...][token_ids]
        x = dequantize(self.embed[...][token_ids], scale, self.final_norm[...].dtype, cfg.hidden_size)  # [T, H]
        layers = {name: p[...] for name, p in self.layers.items()}  # [L, ...] each

        def layer_step(carry, layer):
            x, k_flat, v_flat = _decoder_layer(cfg, layers, layer, *carry, cos, sin, metadata, attention, block_size)
            return (x, k_flat, v_flat), None

        (x, k_flat, v_flat), _ = jax.lax.scan(layer_step, (x, k_flat, v_flat), jnp.arange(L, dtype=jnp.int32))
        hidden = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
        return hidden, k_flat.reshape(k_cache.shape), v_flat.reshape(v_cache.shape)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[S, H] -> [S, V] float32 logits."""
        head, scale = (self.embed, self.embed_scale) if self.lm_head is None else (self.lm_head, self.lm_head_scale)
        return linear(hidden, head[...], None if scale is None else scale[...], out_dtype=jnp.float32)


def _decoder_layer(cfg: ModelConfig, w: dict, layer: jax.Array, x, k_flat, v_flat, cos, sin,
                   metadata: AttentionMetadata, attention: AttentionFn, block_size: int):
    """Layer `layer` of the stacked weights `w` over the step's hidden states x [T, H]."""
    h = rms_norm(x, w["attn_norm"][layer], cfg.rms_norm_eps)
    tokens, D = x.shape[0], cfg.head_dim
    q = _project(h, w, "wq", layer).reshape(tokens, -1, D)  # [T, N, D]
    k = _project(h, w, "wk", layer).reshape(tokens, -1, D)  # [T, K, D]
    v = _project(h, w, "wv", layer).reshape(tokens, -1, D)
    if cfg.attention_bias:
        q, k, v = q + w["bq"][layer], k + w["bk"][layer], v + w["bv"][layer]
    if cfg.qk_norm:
        q = rms_norm(q, w["q_norm"][layer], cfg.rms_norm_eps)
        k = rms_norm(k, w["k_norm"][layer], cfg.rms_norm_eps)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    # The backend writes this step's K/V into the cache, then attends over it. It reads the stacked
    # cache directly: slicing out k_flat[layer] would copy it.
    attn, k_flat, v_flat = attention(q, k, v, k_flat, v_flat, layer, metadata, block_size, cfg.head_dim**-0.5)
    x = x + _project(attn.reshape(tokens, -1), w, "wo", layer)
    h = rms_norm(x, w["mlp_norm"][layer], cfg.rms_norm_eps)
    x = x + _project(jax.nn.silu(_project(h, w, "w_gate", layer)) * _project(h, w, "w_up", layer), w, "w_down", layer)
    return x, k_flat, v_flat


def _project(x: jax.Array, w: dict, name: str, layer: jax.Array) -> jax.Array:
    """x @ the projection `name` of `layer`, transposed; scaled when its weights are int8."""
    return linear(x, w[name], w.get(f"{name}_scale"), layer=layer)


def _stored_matrix(names: str | list[str], weights: dict, blocks: dict, quantization: str | None,
                   dtype) -> tuple[nnx.Param, nnx.Param | None]:
    """The matrix `names` (or the stack of one per layer) as the model keeps it: (weight, scale per output
    feature or None). quantization="gguf" keeps a GGUF file's blocks when every layer has them in one format."""
    stack = np.stack if isinstance(names, list) else lambda arrays: arrays[0]
    names = names if isinstance(names, list) else [names]
    if quantization == "gguf" and all(n in blocks for n in names) and len({blocks[n].shape for n in names}) == 1:
        return nnx.Param(jnp.asarray(stack([blocks[n] for n in names]))), None
    stored, scale = quantize(stack([weights[n] for n in names]), quantization, dtype)
    return nnx.Param(stored), None if scale is None else nnx.Param(scale)
