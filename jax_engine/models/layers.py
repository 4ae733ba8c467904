"""The pieces every decoder family is built from: norms, activations, the attention block and the MLP.

A family's layer function (models/llama.py, opt.py, ...) says in a few lines how its pieces connect
(pre- or post-norm, sequential or parallel residual); the pieces read the layer's stacked weights by our
common names:

    w_qkv [(N + 2K) D, H]   q, k and v projections fused into one matmul (rows: all q, then k, then v)
    w_o   [H, N D]          attention output projection
    w_gate_up [2 I, H]      gated MLPs (gate rows, then up rows); w_up [I, H] in plain MLPs
    w_down [H, I]
    b_<name>                the bias of w_<name>, where the checkpoint has one
    attn_norm, mlp_norm     norm weights; <norm>_bias for LayerNorm's bias

Projections stay [out, in], the checkpoint's layout, so the few-rows matmul kernel streams each output
feature's weights together and int8 keeps one scale per output feature (see linear/).
Dimension names: T tokens, H hidden, N query heads, K KV heads, D head dim, I MLP width.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from jax_engine.attention.metadata import AttentionFn, AttentionMetadata
from jax_engine.linear.matmul import linear
from jax_engine.models.lora import LoRABatch
from jax_engine.model_config import ModelConfig
from jax_engine.models.rope import apply_rope

# HF `hidden_act` names -> the function. "gelu" is the exact (erf) GELU; the others are its tanh form.
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_fast": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)  # normalise in float32 like HF, whatever the weights' dtype
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array | None, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * weight.astype(jnp.float32)
    return (x32 if bias is None else x32 + bias.astype(jnp.float32)).astype(x.dtype)


def normalize(cfg: ModelConfig, x: jax.Array, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """The family's norm (cfg.norm: "rms" or "layer") with these weights."""
    return rms_norm(x, weight, cfg.norm_eps) if cfg.norm == "rms" else layer_norm(x, weight, bias, cfg.norm_eps)


def norm(cfg: ModelConfig, w: dict, name: str, layer: jax.Array, x: jax.Array) -> jax.Array:
    """The layer's norm `name` (its bias from `<name>_bias` where the checkpoint has one)."""
    bias = w.get(f"{name}_bias")
    return normalize(cfg, x, w[name][layer], None if bias is None else bias[layer])


def project(x: jax.Array, w: dict, name: str, layer: jax.Array, ctx: "StepContext",
            row_parallel: bool = False) -> jax.Array:
    """x @ the layer's projection w_<name>, transposed (scaled when int8), plus each row's LoRA update where the
    engine serves adapters (lora_a_<name> and lora_b_<name>, see jax_engine/lora/), plus its bias if it has one.

    A `row_parallel` projection's partial products are summed across devices (ctx.all_reduce), before the bias
    is added once.
    """
    y = linear(x, w[f"w_{name}"], w.get(f"w_{name}_scale"), layer=layer, formats=ctx.block_formats.get(f"w_{name}"),
               live_rows=ctx.live_rows)
    if ctx.lora is not None and f"lora_a_{name}" in w:
        y = y + ctx.lora.delta(name, x, w[f"lora_a_{name}"], w[f"lora_b_{name}"], layer).astype(y.dtype)
    y = ctx.all_reduce(y) if row_parallel and ctx.all_reduce is not None else y
    bias = w.get(f"b_{name}")
    return y if bias is None else y + bias[layer].astype(y.dtype)


@dataclass
class StepContext:
    """What every layer's attention needs in a step, and the paged KV cache it carries from layer to layer.

    One is made per layer inside the scan (see CausalLM.__call__); `attend` replaces the caches it holds with
    the updated ones, so a family's layer function never threads caches by hand. Under tensor parallelism
    (distributed/tensor_parallel.py) the arrays are one device's heads, and `all_reduce` sums the partial
    products of the row-parallel projections across devices; alone, it is the identity.
    """

    metadata: AttentionMetadata
    attention: AttentionFn
    block_size: int
    rope: tuple[jax.Array, jax.Array] | None  # (cos, sin) of the step's positions, or None without RoPE
    k_flat: jax.Array  # [L, S, K, D]
    v_flat: jax.Array
    alibi_slopes: jax.Array | None = None  # [N] of this device's query heads
    all_reduce: Callable[[jax.Array], jax.Array] | None = None
    lora: LoRABatch | None = None  # each token's adapter slot, where the engine serves LoRA adapters
    sliding_window: int | jax.Array | None = None  # this layer's (traced when the layers differ: Gemma 3)
    block_formats: dict[str, tuple[str, ...]] = field(default_factory=dict)  # GGUF blocks' formats, by weight

    @property
    def live_rows(self) -> jax.Array:
        """The step's tokens before its bucket's padding: query_start_loc ends at their count. The projections
        skip the padding rows (the kernel's outputs for them are zeros), ~5% of a long run's rows."""
        return self.metadata.query_start_loc[-1]

    def attend(self, cfg: ModelConfig, q: jax.Array, k: jax.Array, v: jax.Array, layer: jax.Array) -> jax.Array:
        """Write k, v into the cache and attend q over every sequence's context. q [T, N, D] -> [T, N, D]."""
        copies = self.k_flat.shape[2] // k.shape[1]  # a single KV head is cached twice (CausalLM.kv_cache_shape)
        if copies > 1:
            k, v = jnp.repeat(k, copies, axis=1), jnp.repeat(v, copies, axis=1)
        out, self.k_flat, self.v_flat = self.attention(
            q, k, v, self.k_flat, self.v_flat, layer, self.metadata, self.block_size, cfg.attention_scale,
            sliding_window=self.sliding_window, alibi_slopes=self.alibi_slopes,
            logits_soft_cap=cfg.attn_logit_softcapping)
        return out


def self_attention(cfg: ModelConfig, w: dict, layer: jax.Array, h: jax.Array, ctx: StepContext) -> jax.Array:
    """The attention block: fused q/k/v projection, (RoPE), paged attention, output projection. [T, H] -> [T, H]."""
    tokens, N, K, D = h.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = project(h, w, "qkv", layer, ctx)  # [T, (N + 2K) D]
    q = qkv[:, :N * D].reshape(tokens, N, D)
    k = qkv[:, N * D:(N + K) * D].reshape(tokens, K, D)
    v = qkv[:, (N + K) * D:].reshape(tokens, K, D)
    if "q_norm" in w:  # Qwen3 RMS-normalises each query and key head before RoPE
        q, k = rms_norm(q, w["q_norm"][layer], cfg.norm_eps), rms_norm(k, w["k_norm"][layer], cfg.norm_eps)
    if ctx.rope is not None:
        cos, sin = ctx.rope
        q = apply_rope(q, cos, sin, interleaved=cfg.rope_interleaved)
        k = apply_rope(k, cos, sin, interleaved=cfg.rope_interleaved)
    out = ctx.attend(cfg, q, k, v, layer)
    return project(out.reshape(tokens, N * D), w, "o", layer, ctx, row_parallel=True)


def mlp(cfg: ModelConfig, w: dict, layer: jax.Array, h: jax.Array, ctx: StepContext) -> jax.Array:
    """Gated (act(gate) * up, Llama's SwiGLU) when the layer has w_gate_up, else act(up); then down."""
    act = ACTIVATIONS[cfg.hidden_act]
    if "w_gate_up" in w:
        gate_up = project(h, w, "gate_up", layer, ctx)
        gate, up = jnp.split(gate_up, 2, axis=-1)
        return project(act(gate) * up, w, "down", layer, ctx, row_parallel=True)
    return project(act(project(h, w, "up", layer, ctx)), w, "down", layer, ctx, row_parallel=True)


def pre_norm_layer(cfg: ModelConfig, w: dict, layer: jax.Array, x: jax.Array, ctx: StepContext) -> jax.Array:
    """The block most families use (Llama, GPT-2, BLOOM, MPT, OPT): x + attn(norm(x)), then x + mlp(norm(x))."""
    x = x + self_attention(cfg, w, layer, norm(cfg, w, "attn_norm", layer, x), ctx)
    return x + mlp(cfg, w, layer, norm(cfg, w, "mlp_norm", layer, x), ctx)
