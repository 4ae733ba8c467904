"""Tensor parallelism (Megatron-style, as vLLM's workers split a model) on a JAX mesh axis named "tp".

Each of the `tp` devices holds a slice of every layer, and runs the unchanged layer code on it under
`shard_map` (models/causal_lm.py), so every attention backend, the C++ kernels included, sees only its
device's arrays:

    w_qkv (+ bias, int8 scales)      rows of the device's query heads and of the KV heads they read
    w_gate_up / w_up (+ ...)         rows of the device's share of the MLP's intermediate features
    w_o, w_down                      the matching input columns: each device's product is a partial sum,
                                     which one all-reduce (psum) per block adds up on every device
    embed, lm_head (+ ...)           rows of the device's share of the vocabulary: the lookup is a psum
                                     (the other devices contribute zeros), the logits an all-gather
    norms, other biases, positions   replicated
    KV cache [L, blocks, bs, K, D]   split on K: each device keeps the K/V of its own KV heads
    LoRA stacks (jax_engine/lora/)   as their projection: B of w_qkv / w_gate_up / w_up split on its output
                                     features like the weight's rows, A of w_o / w_down on its input features
                                     like the weight's columns (a partial shrink, summed by the same psum);
                                     the other A and B replicated

The scheduler, the block manager and the sampler stay single: a block id means the same tokens on every
device, so one block table serves them all.

Splits that do not divide. SmolLM2 has 9 query heads reading 3 KV heads; tp = 2 and 4 divide neither. The
layout (`HeadLayout`) gives every device the same number of heads by padding with empty ones (-1): an
empty head's weights are zero rows and its output projection's columns zero, so it adds nothing. With
more devices than KV heads and tp a multiple of them, each KV head is replicated on tp / K devices that
share its query heads, as vLLM does; otherwise KV groups are padded to a multiple of tp. The MLP width and
the vocabulary are padded to multiples of tp the same way (padded logits are cut off after the gather).
"""

import dataclasses
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_engine.model_config import ModelConfig
from reference.block_manager import cdiv

AXIS = "tp"
EMPTY = -1  # a padding head, feature or vocabulary row: zeros

# Weights split by output rows (axis 1 of a layer stack), by input columns (axis 2), or by vocabulary rows.
_ROW_SPLIT = ("w_qkv", "b_qkv", "w_qkv_scale", "w_gate_up", "b_gate_up", "w_gate_up_scale", "w_up", "b_up",
              "w_up_scale")
_COLUMN_SPLIT = ("w_o", "w_down")
_VOCAB_SPLIT = ("embed", "embed_scale", "lm_head", "lm_head_scale", "lm_head_bias")
# LoRA stacks ([L, S, r, out] B, [L, S, pieces, r, in] A) split on their last axis as the weight named.
_LORA_SPLIT = {"lora_b_qkv": "w_qkv", "lora_b_gate_up": "w_gate_up", "lora_b_up": "w_up", "lora_a_o": "w_o",
               "lora_a_down": "w_down"}


@dataclass(frozen=True)
class HeadLayout:
    """Which of the model's heads each device holds: q[d] its query heads, kv[d] its KV heads (EMPTY pads).

    Local query head j of a device reads its local KV head j // (len(q[d]) // len(kv[d])), the usual GQA rule.
    """

    q: tuple[tuple[int, ...], ...]
    kv: tuple[tuple[int, ...], ...]


def head_layout(num_heads: int, num_kv_heads: int, tp: int) -> HeadLayout:
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads < tp and tp % num_kv_heads == 0:
        copies = tp // num_kv_heads  # devices sharing one KV head, each with a share of its query heads
        per_device = cdiv(group, copies)
        q, kv = [], []
        for device in range(tp):
            head, share = divmod(device, copies)
            js = range(share * per_device, (share + 1) * per_device)
            q.append(tuple(head * group + j if j < group else EMPTY for j in js))
            kv.append((head,))
        return HeadLayout(tuple(q), tuple(kv))
    per_device = cdiv(num_kv_heads, tp)  # whole KV groups per device, padded with empty groups
    kv = [tuple(h if h < num_kv_heads else EMPTY for h in range(d * per_device, (d + 1) * per_device))
          for d in range(tp)]
    q = [tuple(h * group + j if h != EMPTY else EMPTY for h in heads for j in range(group)) for heads in kv]
    return HeadLayout(tuple(q), tuple(kv))


def _features(index: list[int], width: int) -> list[int]:
    """Feature rows of heads (or single features, width 1) `index`, EMPTY kept EMPTY."""
    return [EMPTY if i == EMPTY else i * width + f for i in index for f in range(width)]


def _even_split(size: int, tp: int) -> list[list[int]]:
    per = cdiv(size, tp)
    return [[i if i < size else EMPTY for i in range(d * per, (d + 1) * per)] for d in range(tp)]


def _take(a, index: list[int], axis: int) -> np.ndarray:
    """a's slices `index` along `axis`, zeros where EMPTY."""
    a = np.asarray(a)
    index = np.asarray(index)
    zero = np.zeros_like(np.take(a, [0], axis=axis))
    return np.take(np.concatenate([a, zero], axis=axis), np.where(index == EMPTY, a.shape[axis], index), axis=axis)


@dataclass(frozen=True)
class TensorParallel:
    """A model's split over the mesh axis "tp": where each weight's rows go, and each device's shapes."""

    mesh: Mesh
    heads: HeadLayout
    mlp: tuple[tuple[int, ...], ...]  # each device's intermediate features
    vocab: tuple[tuple[int, ...], ...]  # each device's vocabulary rows
    alibi_slopes: tuple[tuple[float, ...], ...] | None  # each device's query heads' slopes (0 for empty ones)

    @classmethod
    def create(cls, cfg: ModelConfig, mesh: Mesh) -> "TensorParallel":
        tp = mesh.shape[AXIS]
        heads = head_layout(cfg.num_heads, cfg.num_kv_heads, tp)
        slopes = None if cfg.alibi_slopes is None else tuple(
            tuple(_take(np.asarray(cfg.alibi_slopes, np.float32), list(q), 0).tolist()) for q in heads.q)
        return cls(mesh, heads, tuple(map(tuple, _even_split(cfg.intermediate_size, tp))),
                   tuple(map(tuple, _even_split(cfg.vocab_size, tp))), slopes)

    @property
    def size(self) -> int:
        return self.mesh.shape[AXIS]

    @property
    def kv_heads_per_device(self) -> int:
        return len(self.heads.kv[0])

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config one device's layer code runs with: its head counts and MLP width (its ALiBi slopes are
        a row of self.alibi_slopes)."""
        return dataclasses.replace(cfg, num_heads=len(self.heads.q[0]), num_kv_heads=self.kv_heads_per_device,
                                   intermediate_size=len(self.mlp[0]), alibi_slopes=None)

    # ---------------------------------------------------------------------------------- weights
    def _rows(self, name: str, cfg: ModelConfig) -> list[int]:
        """The new order (EMPTY: zeros) of a split weight's rows or columns, device by device."""
        N, K, D, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        order = []
        for d in range(self.size):
            q, kv, features = list(self.heads.q[d]), list(self.heads.kv[d]), list(self.mlp[d])
            if name.endswith("qkv") or name == "w_qkv_scale":  # [all q | all k | all v] rows
                kv_rows = _features(kv, D)
                shift = lambda offset: [EMPTY if i == EMPTY else i + offset for i in kv_rows]  # noqa: E731
                order += _features(q, D) + shift(N * D) + shift((N + K) * D)
            elif name.endswith("gate_up") or name == "w_gate_up_scale":  # [gate | up] rows
                order += features + [EMPTY if i == EMPTY else i + inter for i in features]
            elif name == "w_o":
                order += _features(q, D)
            elif name in _VOCAB_SPLIT:
                order += list(self.vocab[d])
            else:  # w_up, b_up, w_up_scale, w_down
                order += features
        return order

    def lora_rows(self, cfg: ModelConfig, projection: str, pieces: tuple) -> tuple[tuple[int, int], ...]:
        """Where the pieces of a LoRA projection's output (`pieces`: the whole model's rows) lie on one device:
        q, k and v's shares of w_qkv, gate's and up's of w_gate_up; a projection of one piece is wholly local."""
        local = self.local_config(cfg)
        if projection == "qkv" and len(pieces) == 3:
            sizes = [local.num_heads * cfg.head_dim] + [local.num_kv_heads * cfg.head_dim] * 2
        elif projection == "gate_up" and len(pieces) == 2:
            sizes = [local.intermediate_size] * 2
        elif f"lora_b_{projection}" in _LORA_SPLIT:  # one piece split with its weight's rows
            sizes = [len(self._rows(_LORA_SPLIT[f"lora_b_{projection}"], cfg)) // self.size]
        else:  # w_o, w_down: the output is not split
            return tuple(pieces)
        stops = np.cumsum(sizes).tolist()
        return tuple(zip([0, *stops[:-1]], stops))

    def spec(self, name: str, stacked: bool) -> P:
        lead = (None,) if stacked else ()
        if name in _LORA_SPLIT:  # always layer stacks
            return P(*[None] * (3 if name.startswith("lora_b") else 4), AXIS)
        if name in _ROW_SPLIT or name in _VOCAB_SPLIT:
            return P(*lead, AXIS)
        if name in _COLUMN_SPLIT:
            return P(*lead, None, AXIS)
        return P()

    def specs(self, weights: dict, stacked: bool) -> dict[str, P]:
        return {name: self.spec(name, stacked) for name in weights}

    def shard(self, cfg: ModelConfig, weights: dict, stacked: bool) -> dict[str, jax.Array]:
        """Lay `weights` (a layer stack [L, ...] or the top weights) out device by device and place them."""
        placed = {}
        for name, array in weights.items():
            if array.dtype == np.uint8 and name in _COLUMN_SPLIT:
                raise ValueError("quantization='gguf' with tensor_parallel_size > 1: a GGUF block row cannot be "
                                 "split by input columns; use quantization=None, 'bf16' or 'int8'")
            spec = self.spec(name, stacked)
            if spec != P():
                axis = len(spec) - 1
                order = self._rows(_LORA_SPLIT.get(name, name), cfg)
                if array.shape[axis] != len(set(order) - {EMPTY}):  # the config does not describe this weight
                    raise ValueError(f"{name} {array.shape} does not match the model config's head counts, "
                                     f"MLP width or vocabulary: it cannot be split over {self.size} devices")
                array = _take(array, order, axis)
            placed[name] = put(np.asarray(array), NamedSharding(self.mesh, spec))
        return placed

    def cache_sharding(self) -> NamedSharding:
        """[L, blocks, block_size, K, D] split on K."""
        return NamedSharding(self.mesh, P(None, None, None, AXIS, None))


def put(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array placed with `sharding`; each process supplies its own devices' slices (multi-host safe)."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def make_mesh(tensor_parallel_size: int, devices: list | None = None) -> Mesh:
    """A 1-D mesh "tp" over the first `tensor_parallel_size` devices (of every process, in jax.devices() order)."""
    devices = jax.devices() if devices is None else devices
    if tensor_parallel_size > len(devices):
        raise ValueError(f"tensor_parallel_size must be <= the number of devices ({len(devices)}: "
                         f"{devices[0].platform}), got {tensor_parallel_size}")
    return Mesh(np.array(devices[:tensor_parallel_size]), (AXIS,))
