"""A Llama-family decoder forward pass in NumPy, reading and writing a paged KV cache.

    tokens -> embed -> 30 x [ RMSNorm -> attention (RoPE, GQA, paged cache) -> + residual
                              RMSNorm -> SwiGLU MLP                          -> + residual ]
           -> RMSNorm -> lm_head (tied to the embedding for SmolLM2) -> logits

Weights use Hugging Face names and shapes ([out, in]), as `jax_engine.loader` returns them. Qwen2's q/k/v
biases and Qwen3's per-head q/k RMSNorm are applied when the weights contain them.
"""

from collections.abc import Mapping
from typing import Protocol

import numpy as np

from reference.block_manager import cdiv
from reference.kv_cache import KVCache
from reference.lora import LoRAAdapter, lora_delta
from reference.paged_attention import AttentionMetadata, paged_attention, write_kv


class LlamaConfig(Protocol):
    """The fields the forward pass reads (jax_engine.model_config.ModelConfig has them all)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    norm_eps: float
    tie_word_embeddings: bool


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Rotary position embedding of x [num_tokens, num_heads, head_dim], "rotate half" layout: pairs are
    (x[i], x[i + d/2])."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (np.arange(half, dtype=np.float64) * 2 / x.shape[-1])
    angles = (positions[:, None] * inv_freq[None, :])[:, None, :]  # [T, 1, d/2]
    cos, sin = np.cos(angles).astype(x.dtype), np.sin(angles).astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class LlamaModel:
    """Forward pass over a batch of new tokens from many sequences (prefill chunks and decodes mixed)."""

    def __init__(self, config: LlamaConfig, weights: Mapping[str, np.ndarray]) -> None:
        self.config = config
        # Read once: a checkpoint's weights may be a mapping that reads (and dequantizes) a tensor each time it is
        # asked for one (jax_engine.loader's GGUFWeights and SafetensorsWeights), and a step asks for all of them.
        self.weights = dict(weights)
        self.lm_head = weights["model.embed_tokens.weight"] if config.tie_word_embeddings else weights["lm_head.weight"]

    def _w(self, layer: int, name: str) -> np.ndarray | None:
        return self.weights.get(f"model.layers.{layer}.{name}")

    # --8<-- [start:linear]
    def _linear(self, x: np.ndarray, layer: int, name: str, adapters) -> np.ndarray:
        """x @ W.T (+ bias), plus each row's LoRA update (reference/lora.py)."""
        y = x @ self._w(layer, f"{name}.weight").T
        bias = self._w(layer, f"{name}.bias")
        y = y if bias is None else y + bias
        return y + lora_delta(x, f"model.layers.{layer}.{name}", adapters)
    # --8<-- [end:linear]

    def _attention(self, x, layer, positions, cache: KVCache, metadata: AttentionMetadata, adapters=None):
        cfg = self.config
        q, k, v = (self._linear(x, layer, f"self_attn.{name}_proj", adapters).reshape(len(x), heads, cfg.head_dim)
                   for name, heads in (("q", cfg.num_heads), ("k", cfg.num_kv_heads), ("v", cfg.num_kv_heads)))
        if self._w(layer, "self_attn.q_norm.weight") is not None:  # Qwen3
            q = rms_norm(q, self._w(layer, "self_attn.q_norm.weight"), cfg.norm_eps)
            k = rms_norm(k, self._w(layer, "self_attn.k_norm.weight"), cfg.norm_eps)
        q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
        write_kv(cache.k[layer], cache.v[layer], k, v, metadata.slot_mapping)
        out = paged_attention(q, cache.k[layer], cache.v[layer], metadata, scale=cfg.head_dim**-0.5)
        return self._linear(out.reshape(len(x), -1), layer, "self_attn.o_proj", adapters)

    # --8<-- [start:mlp]
    def _mlp(self, x: np.ndarray, layer: int, adapters=None) -> np.ndarray:
        gate = self._linear(x, layer, "mlp.gate_proj", adapters)
        up = self._linear(x, layer, "mlp.up_proj", adapters)
        return self._linear(silu(gate) * up, layer, "mlp.down_proj", adapters)
    # --8<-- [end:mlp]

    def forward(self, token_ids: np.ndarray, positions: np.ndarray, cache: KVCache, metadata: AttentionMetadata,
                logits_indices: np.ndarray | None = None,
                adapters: list[LoRAAdapter | None] | None = None) -> np.ndarray:
        """Run the batch's new tokens through the model, writing their K/V into the cache in place.

        Returns [len(logits_indices), vocab_size] logits: the rows wanted (usually each sequence's last
        token), or every row when logits_indices is None. `adapters`, if given, names each token row's LoRA
        adapter (None: the base model), so one batch can mix them.
        """
        cfg = self.config
        # --8<-- [start:forward]
        x = self.weights["model.embed_tokens.weight"][token_ids]  # [T, hidden]
        for layer in range(cfg.num_layers):
            h = rms_norm(x, self._w(layer, "input_layernorm.weight"), cfg.norm_eps)
            x = x + self._attention(h, layer, positions, cache, metadata, adapters)
            h = rms_norm(x, self._w(layer, "post_attention_layernorm.weight"), cfg.norm_eps)
            x = x + self._mlp(h, layer, adapters)
        if logits_indices is not None:
            x = x[logits_indices]
        return rms_norm(x, self.weights["model.norm.weight"], cfg.norm_eps) @ self.lm_head.T
        # --8<-- [end:forward]

    def last_logits(self, token_ids: list[int], block_size: int = 16, adapter: LoRAAdapter | None = None) -> np.ndarray:
        """Next-token logits after `token_ids`, computed from scratch in a private cache (for oracles), with a
        LoRA adapter if one is given."""
        cfg = self.config
        num_blocks = cdiv(len(token_ids), block_size)
        cache = KVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        positions = np.arange(len(token_ids))
        metadata = AttentionMetadata(positions, np.array([0, len(token_ids)]), np.array([len(token_ids)]),
                                     [list(range(num_blocks))])
        return self.forward(np.asarray(token_ids), positions, cache, metadata, np.array([len(token_ids) - 1]),
                            [adapter] * len(token_ids))[0]
