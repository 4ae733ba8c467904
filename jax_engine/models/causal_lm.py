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

With tensor parallelism (distributed/tensor_parallel.py) the weights and the cache are split over a mesh and
the same step runs on every device's slices under `shard_map`, with a psum after each row-parallel projection.
"""

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from jax_engine.attention.metadata import NO_WINDOW, AttentionFn, AttentionMetadata
from jax_engine.distributed.tensor_parallel import AXIS, TensorParallel
from jax_engine.linear.matmul import linear
from jax_engine.linear.quantization import dequantize
from jax_engine.models.lora import LoRABatch
from jax_engine.model_config import ModelConfig
from jax_engine.models.layers import ACTIVATIONS, StepContext, normalize
from jax_engine.models.registry import architecture
from jax_engine.models.rope import rope_frequencies, rope_tables
from jax_engine.models.weights import StoredWeights

if TYPE_CHECKING:  # the layout reads the family registry, which is built from this package's modules
    from jax_engine.lora.layout import LoRALayout


class CausalLM(nnx.Module):
    """Decoder-only transformer; `__call__` runs a step's tokens through it over the paged cache."""

    def __init__(self, cfg: ModelConfig, layers: dict[str, jax.Array], top: dict[str, jax.Array],
                 parallel: TensorParallel | None = None, block_formats: dict[str, tuple[str, ...]] | None = None) -> None:
        """`layers`: every layer's weights stacked [L, ...] by name; `top`: embed, final_norm, lm_head, ...;
        `parallel`: how they are split over a mesh (already laid out and placed by it), or None;
        `block_formats`: the GGUF block format of each layer of the weights kept as raw blocks (StoredWeights)."""
        self.cfg = cfg
        self.parallel = parallel
        self.block_formats = tuple(sorted((block_formats or {}).items()))  # static: part of the compiled program
        self.layers = nnx.Dict({name: nnx.Param(a) for name, a in layers.items()})
        self.top = nnx.Dict({name: nnx.Param(a) for name, a in top.items()})
        self.lora_layout: "LoRALayout | None" = None
        self.lora = nnx.Dict({})  # the adapter slots' stacks, once add_lora_slots made them

    @property
    def activation_dtype(self):
        """The hidden states' dtype (EngineArgs.dtype; the KV cache may differ: kv_cache_dtype)."""
        return self.layers["attn_norm"][...].dtype

    def add_lora_slots(self, layout: "LoRALayout") -> None:
        """Make room for layout.max_loras adapters (all slots empty: zeros), in the activations' dtype. A slot is
        filled by placing its stacks' new values (write_lora_stacks): same shapes, no compile."""
        self.lora_layout = layout
        zeros = {name: np.zeros(shape, self.activation_dtype) for name, shape in layout.stack_shapes().items()}
        self.lora = nnx.Dict({name: nnx.Param(a) for name, a in self._placed(zeros).items()})

    def write_lora_stacks(self, stacks: dict[str, np.ndarray]) -> None:
        """Replace the adapter slots' stacks with these host arrays (the whole model's layout, split here)."""
        for name, array in self._placed(stacks).items():
            self.lora[name].set_value(array)

    def _placed(self, stacks: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        if self.parallel is None:
            return {name: jnp.asarray(a) for name, a in stacks.items()}
        return self.parallel.shard(self.cfg, stacks, stacked=True)

    def _lora_rows(self) -> dict[str, tuple[tuple[int, int], ...]]:
        """Each adapted projection's pieces' output rows, as one device's step sees them."""
        rows = {t.projection: t.rows for t in self.lora_layout.targets}
        if self.parallel is None:
            return rows
        return {name: self.parallel.lora_rows(self.cfg, name, pieces) for name, pieces in rows.items()}

    @classmethod
    def from_hf_weights(cls, cfg: ModelConfig, weights, dtype=jnp.float32, quantization: str | None = None,
                        blocks: dict[str, np.ndarray] | None = None, mesh: Mesh | None = None) -> "CausalLM":
        """Build the model from HF-named NumPy weights (Checkpoint.weights and .blocks).

        `quantization` ("bf16", "int8", "gguf" or None) is how the projections, the embedding and the LM head
        are stored; norms and biases keep `dtype`. "gguf" keeps the matrices found in `blocks` (a GGUF file's
        raw rows in the formats of linear/gguf_format.py) as they are, and the rest in `dtype`. `mesh`: a "tp" mesh of more than one
        device splits the model over it (tensor parallelism).
        """
        if quantization == "gguf" and not blocks:
            raise ValueError("quantization='gguf' keeps a GGUF file's Q8_0/Q4_0/Q4_1/Q5_0/Q4_K/Q5_K/Q6_K blocks, and "
                             "this model has none (Checkpoint.blocks is empty): pass a .gguf file with such tensors")
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={cfg.hidden_act!r} is not supported; supported: {sorted(ACTIVATIONS)}")
        spec = architecture(cfg.architecture).weights(cfg)
        stored = StoredWeights(weights, blocks or {}, quantization, dtype)
        layers, top = stored.layers(spec, cfg.num_layers), stored.top(spec)
        if mesh is None or mesh.shape[AXIS] == 1:
            return cls(cfg, layers, top, block_formats=stored.block_formats)
        parallel = TensorParallel.create(cfg, mesh)
        return cls(cfg, parallel.shard(cfg, layers, stacked=True), parallel.shard(cfg, top, stacked=False), parallel,
                   stored.block_formats)

    @property
    def kv_heads_per_device(self) -> int:
        return self.cfg.num_kv_heads if self.parallel is None else self.parallel.kv_heads_per_device

    @property
    def cache_heads_per_device(self) -> int:
        """KV heads each device's cache holds: its own, or two copies of a single one. A cache whose head axis has
        length 1 is copied whole into and out of every step by XLA (its reshape to slots is then no bitcast: 2 GiB
        a step for Gemma 3 270M on a CPU, 20x its weights), so a single KV head (multi-query attention) is cached
        twice, both copies written alike (StepContext.attend), and the block budget counts both. Each copy serves
        half the query heads, so an odd number of them (Falcon-7B's 71) keeps one copy, and the cache copies."""
        heads = self.kv_heads_per_device
        queries = self.cfg.num_heads if self.parallel is None else self.parallel.local_config(self.cfg).num_heads
        return 2 if heads == 1 and queries % 2 == 0 else heads

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """[L, blocks, block_size, K, D]; under tensor parallelism K counts every device's cached heads (padding
        and replicas included), so that each device's share is its own heads."""
        devices = 1 if self.parallel is None else self.parallel.size
        return (self.cfg.num_layers, num_blocks, block_size, devices * self.cache_heads_per_device, self.cfg.head_dim)

    def kv_cache_sharding(self):
        """Where the KV cache lives: split on KV heads over the mesh, or None (the default device)."""
        return None if self.parallel is None else self.parallel.cache_sharding()

    # ---------------------------------------------------------------------------------- forward
    def __call__(self, token_ids: jax.Array, k_cache: jax.Array, v_cache: jax.Array, metadata: AttentionMetadata,
                 attention: AttentionFn, lora_slots: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Run a step's tokens; write their K/V; return final hidden states and the updated caches.

        Args:
            token_ids: [T] the step's new tokens (padding included).
            k_cache: [L, num_blocks, block_size, K, D] keys (donated by the caller).
            v_cache: [L, num_blocks, block_size, K, D] values.
            metadata: the batch layout shared by every attention backend.
            attention: the backend's paged-attention function.
            lora_slots: [T] the adapter slot of each token, -1 for none; ignored without add_lora_slots.

        Returns:
            (hidden [T, H] after the final norm, k_cache, v_cache).
        """
        layers = {name: p[...] for name, p in self.layers.items()}  # [L, ...] each
        top = {name: p[...] for name, p in self.top.items()}
        lora_rows = None
        if self.lora_layout is not None and lora_slots is not None:
            layers |= {name: p[...] for name, p in self.lora.items()}
            lora_rows = self._lora_rows()
        formats = dict(self.block_formats)
        if self.parallel is None:
            return _step(self.cfg, None, attention, lora_rows, formats, layers, top, token_ids, k_cache, v_cache,
                         metadata, lora_slots)
        parallel, cache = self.parallel, self.parallel.cache_sharding().spec
        step = functools.partial(_step, parallel.local_config(self.cfg), self.parallel, attention, lora_rows, formats)
        return jax.shard_map(step, mesh=parallel.mesh, check_vma=False,
                             in_specs=(parallel.specs(layers, stacked=True), parallel.specs(top, stacked=False),
                                       P(), cache, cache, P(), P()),
                             out_specs=(P(), cache, cache))(layers, top, token_ids, k_cache, v_cache, metadata,
                                                            lora_slots)

    def logits(self, hidden: jax.Array, live_rows: jax.Array | None = None) -> jax.Array:
        """[S, H] -> [S, V] float32 logits (under tensor parallelism, every device's vocabulary rows gathered),
        soft-capped where the model caps them (Gemma 2). `live_rows`: the rows past it are padding, which the
        matmul kernel skips on one device (linear)."""
        name = "embed" if self.cfg.tie_word_embeddings else "lm_head"
        head = {n: self.top[n][...] for n in (name, f"{name}_scale", "lm_head_bias") if n in self.top}
        formats = dict(self.block_formats).get(name)
        if self.parallel is None:
            logits = _logits(name, head, hidden, formats, live_rows)
        else:
            def gathered(head, hidden):
                return jax.lax.all_gather(_logits(name, head, hidden, formats), AXIS, axis=1, tiled=True)

            logits = jax.shard_map(gathered, mesh=self.parallel.mesh, check_vma=False,
                                   in_specs=(self.parallel.specs(head, stacked=False), P()),
                                   out_specs=P())(head, hidden)
            logits = logits[:, : self.cfg.vocab_size]  # the padding rows of the last device's share
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)


def _logits(name: str, head: dict, hidden: jax.Array, formats: tuple[str, ...] | None,
            live_rows: jax.Array | None = None) -> jax.Array:
    logits = linear(hidden, head[name], head.get(f"{name}_scale"), out_dtype=jnp.float32, formats=formats,
                    live_rows=live_rows)
    return logits if "lm_head_bias" not in head else logits + head["lm_head_bias"].astype(jnp.float32)


def _step(cfg: ModelConfig, parallel: TensorParallel | None, attention: AttentionFn, lora_rows: dict | None,
          formats: dict[str, tuple[str, ...]], layers: dict, top: dict, token_ids: jax.Array, k_cache: jax.Array,
          v_cache: jax.Array, metadata: AttentionMetadata, lora_slots: jax.Array | None):
    """CausalLM.__call__ on whole arrays, or on one device's slices (`cfg` then has its head counts; `lora_rows`
    the pieces of its share of each adapted projection). lora_rows None: no adapter updates. `formats`: the
    block formats of the weights kept as GGUF blocks."""
    L, num_blocks, block_size = k_cache.shape[:3]
    k_flat = k_cache.reshape(L, num_blocks * block_size, *k_cache.shape[3:])  # [L, S, K, D]
    rope_and_window = _per_layer(cfg, metadata.positions)
    all_reduce = None if parallel is None else functools.partial(jax.lax.psum, axis_name=AXIS)
    slopes = cfg.alibi_slopes if parallel is None else parallel.alibi_slopes
    if slopes is not None:  # [N], or [devices, N] of which this device takes its row
        slopes = jnp.asarray(slopes, jnp.float32)
        slopes = slopes if parallel is None else slopes[jax.lax.axis_index(AXIS)]
    layer_fn = architecture(cfg.architecture).layer
    lora = None
    if lora_rows is not None:
        num_slots = layers[f"lora_a_{next(iter(lora_rows))}"].shape[1]
        lora = LoRABatch.of(lora_slots, num_slots, lora_rows, layers["attn_norm"].dtype)

    def layer_step(carry, layer):
        x, k_flat, v_flat = carry
        rope, window = rope_and_window(layer)
        ctx = StepContext(metadata, attention, block_size, rope, k_flat, v_flat, slopes, all_reduce, lora, window,
                          formats)
        x = layer_fn(cfg, layers, layer, x, ctx)
        return (x, ctx.k_flat, ctx.v_flat), None

    x = _embed(cfg, top, formats, token_ids, metadata.positions, layers["attn_norm"].dtype, all_reduce)
    (x, k_flat, v_flat), _ = jax.lax.scan(layer_step, (x, k_flat, v_cache.reshape(k_flat.shape)),
                                          jnp.arange(L, dtype=jnp.int32))
    if "final_norm" in top:  # OPT's post-norm variants end without one
        x = normalize(cfg, x, top["final_norm"], top.get("final_norm_bias"))
    if "project_out" in top:  # OPT-350m: hidden -> the embedding's width
        x = linear(x, top["project_out"], None, formats=formats.get("project_out"))
    return x, k_flat.reshape(k_cache.shape), v_flat.reshape(v_cache.shape)


def _per_layer(cfg: ModelConfig, positions: jax.Array):
    """layer -> (its RoPE tables (cos, sin) or None, its sliding window): the model's own, or for a model whose
    layers are of two kinds (Gemma 3: windowed layers with their own RoPE base, and global ones) its kind's,
    picked inside the scan by the traced layer index (the global layers' window is NO_WINDOW)."""
    def tables(theta: float, scaling) -> tuple[jax.Array, jax.Array]:
        inv_freq, factor = rope_frequencies(cfg.rotary_dim or cfg.head_dim, theta, scaling, cfg.rope_freq_factors)
        return rope_tables(positions, inv_freq, factor)

    rope = tables(cfg.rope_theta, cfg.rope_scaling) if cfg.position_embedding == "rope" else None
    if cfg.sliding_window_layers is None:
        return lambda layer: (rope, cfg.sliding_window)
    windowed = jnp.asarray(cfg.sliding_window_layers)
    local_rope = rope if cfg.rope_local_theta is None or rope is None else tables(cfg.rope_local_theta, None)

    def of(layer: jax.Array):
        local = windowed[layer]
        window = jnp.where(local, cfg.sliding_window, NO_WINDOW).astype(jnp.int32)
        return None if rope is None else tuple(jnp.where(local, a, b) for a, b in zip(local_rope, rope)), window

    return of


def _embed(cfg: ModelConfig, top: dict, formats: dict, token_ids: jax.Array, positions: jax.Array, dtype,
           all_reduce) -> jax.Array:
    """The tokens' embeddings [T, E]. Split by vocabulary, each device looks up the tokens in its rows, zeros
    for the others, and `all_reduce` adds the devices' lookups up."""
    rows, ours = token_ids, None
    if all_reduce is not None:
        share = top["embed"].shape[0]
        rows = token_ids - jax.lax.axis_index(AXIS) * share
        ours = (rows >= 0) & (rows < share)
        rows = jnp.where(ours, rows, 0)
    scale = top.get("embed_scale")
    x = dequantize(top["embed"][rows], None if scale is None else scale[rows], dtype,
                   cfg.embedding_size or cfg.hidden_size, formats.get("embed", (None,))[0])  # [T, E]
    if all_reduce is not None:
        x = all_reduce(jnp.where(ours[:, None], x, jnp.zeros_like(x)))
    if cfg.embedding_multiplier != 1.0:  # Gemma; in the activations' dtype, as HF does
        x = x * jnp.asarray(cfg.embedding_multiplier, dtype)
    if "project_in" in top:
        x = linear(x, top["project_in"], None, formats=formats.get("project_in")).astype(dtype)
    if "positions" in top:  # learned absolute positions (OPT's table starts at position_offset)
        x = x + top["positions"][positions + cfg.position_offset]
    if "embed_norm" in top:  # BLOOM normalises the embeddings
        x = normalize(cfg, x, top["embed_norm"], top.get("embed_norm_bias"))
    return x
