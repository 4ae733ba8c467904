"""The shape of a decoder-only model, read from a checkpoint: sizes, and how its family builds its layers.

The NumPy reference (`reference/llama.py`, Llama family only) and the JAX engine read these fields; the
loaders in `jax_engine/loader/` fill them in, each family's translation of config.json in models/<family>.py.
Defaults are Llama's.
"""

from __future__ import annotations

from dataclasses import dataclass

from jax_engine.models.rope_scaling import RopeScaling


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer (the families are listed in models/registry.py)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    rope_scaling: RopeScaling | None = None  # None: plain RoPE (see jax_engine/models/rope.py)
    rotary_dim: int | None = None  # features of a head that rotate; None: all of them (head_dim)
    rope_interleaved: bool = False  # GPT-J's pairs (x[2i], x[2i+1]) instead of rotate-half's (x[i], x[i+D/2])
    # llama.cpp's rope_freqs tensor (Llama 3.1+ GGUFs: llama3 scaling as data): each rotating pair's inverse
    # frequency is divided by its factor. None: no factors.
    rope_freq_factors: tuple[float, ...] | None = None
    # How the family builds its layers (biases, Qwen3's q/k norms and the like follow the weights present).
    norm: str = "rms"  # "rms" (RMSNorm) or "layer" (LayerNorm)
    hidden_act: str = "silu"  # HF's name of the MLP's activation (models/layers.py ACTIVATIONS)
    gated_mlp: bool = True  # act(gate) * up, as Llama; False: act(up), as GPT-2 and OPT
    position_embedding: str = "rope"  # "rope", "learned" (a table of positions) or "alibi" (attention biases)
    position_offset: int = 0  # OPT's learned position table starts at row 2
    embedding_size: int | None = None  # OPT-350m's word_embed_proj_dim where it differs from hidden_size
    embedding_multiplier: float = 1.0  # Gemma scales the embeddings by sqrt(hidden_size)
    parallel_residual: bool = False  # x + attn(norm(x)) + mlp(norm'(x)): GPT-NeoX, GPT-J, Falcon
    norm_before: bool = True  # pre-norm; False: OPT-350m's post-norm layers (norm after each residual add)
    sliding_window: int | None = None  # Mistral: a token attends to the last sliding_window tokens only
    # Gemma 3: which layers have the sliding window (the others see every token); None: all of them, as Mistral
    sliding_window_layers: tuple[bool, ...] | None = None
    rope_local_theta: float | None = None  # Gemma 3: the RoPE base of the sliding-window layers (no scaling)
    alibi_slopes: tuple[float, ...] | None = None  # BLOOM, MPT: one slope per query head (models/alibi.py)
    softmax_scale: float | None = None  # None: 1 / sqrt(head_dim)
    # Gemma 2: scaled attention scores and the final logits squashed to (-cap, cap) by cap * tanh(x / cap)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim={self.rotary_dim} must be even and in 1..head_dim={self.head_dim}")
        layers = self.sliding_window_layers
        if layers is not None and (len(layers) != self.num_layers or self.sliding_window is None):
            raise ValueError(f"sliding_window_layers needs sliding_window and one entry per layer ({self.num_layers}), "
                             f"got {len(layers)} with sliding_window={self.sliding_window}")
        pairs = (self.rotary_dim or self.head_dim) // 2
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != pairs:
            raise ValueError(f"rope_freq_factors has {len(self.rope_freq_factors)} factors; the heads rotate {pairs} "
                             f"pairs of features")

    @property
    def attention_scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else self.head_dim**-0.5

    @property
    def num_params(self) -> int:
        """Parameter count, counting tied embeddings once."""
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size
        per_layer = attn + mlp + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + self.hidden_size


def token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """An HF config's token-id field (`eos_token_id` may be one id, a list or null) as a tuple."""
    return () if value is None else tuple(value) if isinstance(value, list) else (value,)
