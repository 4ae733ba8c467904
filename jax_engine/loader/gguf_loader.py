"""Load a llama.cpp GGUF file: config, dequantized weights and tokenizer, with NumPy only."""

import re

import numpy as np
from gguf import GGUFReader, GGMLQuantizationType
from gguf.quants import dequantize

from jax_engine.linear.gguf_blocks import FORMATS, BlockRows
from jax_engine.loader.checkpoint import Checkpoint
from jax_engine.loader.gguf_families import GGUFFamily, gguf_family
from jax_engine.loader.gguf_tokenizer import tokenizer_from_gguf
from jax_engine.model_config import ModelConfig
from jax_engine.models.rope import RopeScaling

# GGUF tensor name -> HF parameter name ({i} is the layer index).
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(.+)")
# Llama 3.1+ files: the llama3 rope scaling as one divisor per rotating pair (ModelConfig.rope_freq_factors).
_ROPE_FREQS = "rope_freqs.weight"


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _hf_name(gguf_name: str, family: GGUFFamily) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_PATTERN.fullmatch(gguf_name)
    names = {**_LAYER_NAMES, **family.layer_names}
    if match is None or match.group(2) not in names:
        raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF file")
    return f"model.layers.{match.group(1)}.{names[match.group(2)]}"


def _undo_rope_permutation(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation.

    llama.cpp's converter reorders each head's rows from HF's "rotate half" layout
    [x0..x31 | x32..x63] to interleaved pairs (x0, x32, x1, x33, ...); we put them back.
    """
    out_features = weight.shape[0]
    per_head = out_features // num_heads
    return (
        weight.reshape(num_heads, per_head // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _rope_freq_factors(reader: GGUFReader) -> tuple[float, ...] | None:
    # NOTE: llama.cpp's converter writes no rope.scaling.type for llama3 scaling: these factors are all of it.
    tensor = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    return None if tensor is None else tuple(float(f) for f in _dequantized(tensor).reshape(-1))


def _rope_scaling(reader: GGUFReader, arch: str, max_positions: int) -> RopeScaling | None:
    """llama.cpp's linear scaling: every frequency times 1 / rope.scaling.factor (rope.scale_linear in older files).

    NOTE: llama.cpp applies that factor whether rope.scaling.type says "linear" or "none" (the default is
    "linear"); yarn and longrope take more than it, which we do not read.
    """
    kind = _field(reader, f"{arch}.rope.scaling.type", "linear")
    if kind not in ("none", "linear"):
        raise ValueError(f"{arch}.rope.scaling.type={kind!r} is not supported; supported: ['none', 'linear']")
    factor = _field(reader, f"{arch}.rope.scaling.factor") or _field(reader, f"{arch}.rope.scale_linear")
    return None if factor in (None, 0.0, 1.0) else RopeScaling("linear", float(factor), max_positions)


def _read_config(reader: GGUFReader, family: GGUFFamily) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    get = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    hidden, num_layers = int(get("embedding_length")), int(get("block_count"))
    num_heads = int(get("attention.head_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    end_of_turn = tuple(tokens.index(name) for name in family.end_of_turn_tokens if name in tokens)
    max_positions = int(get("context_length"))
    return ModelConfig(
        architecture=family.model_type,
        vocab_size=int(get("vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=int(get("attention.key_length", hidden // num_heads)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=max_positions,
        tie_word_embeddings="output.weight" not in {t.name for t in reader.tensors},
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(() if eos is None else (int(eos),)) + end_of_turn,
        rope_scaling=_rope_scaling(reader, arch, max_positions),
        rope_freq_factors=_rope_freq_factors(reader),
        **family.config(get, hidden, num_layers),
    )


def _dequantized(tensor) -> np.ndarray:
    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        array = np.asarray(tensor.data, dtype=np.float32)
    else:
        array = dequantize(tensor.data, tensor.tensor_type)
    # GGUF lists dimensions fastest-first; NumPy's order is the reverse, which is HF's [out, in].
    return array.reshape(tuple(reversed([int(d) for d in tensor.shape]))).astype(np.float32)


class _Reader(GGUFReader):
    """gguf's reader over a plain ndarray view of the mapped file instead of an np.memmap.

    The reader slices its data twice per metadata string; each memmap slice runs memmap's Python
    `__array_finalize__`, and a 49k-token vocabulary took ~3.7 s to parse. A plain view of the same mapping
    slices in C.
    """

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = np.asarray(value)  # a base-class view; it keeps the memmap (and so the mapping) alive


def load_gguf(path: str, tokenizer: bool = True) -> Checkpoint:
    """Load a GGUF file into float32 NumPy weights under HF names, its tokenizer (unless not `tokenizer`), and
    the raw blocks of its matrices in the formats the engine keeps (linear/gguf_blocks.py: Q8_0, Q4_0, Q4_1,
    Q5_0, Q4_K, Q5_K, Q6_K)."""
    reader = _Reader(path)
    family = gguf_family(_field(reader, "general.architecture"))
    config = _read_config(reader, family)
    weights, blocks = {}, {}
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:  # read into config.rope_freq_factors
            continue
        name = _hf_name(tensor.name, family)
        block_format = tensor.tensor_type.name.lower()
        kept = [tensor.data] if block_format in FORMATS else []  # raw rows [out, row bytes]
        arrays = [_dequantized(tensor), *kept]
        if family.permuted_qk and name.endswith("q_proj.weight"):  # a permutation of rows: the raw ones permute alike
            arrays = [_undo_rope_permutation(a, config.num_heads) for a in arrays]
        elif family.permuted_qk and name.endswith("k_proj.weight"):
            arrays = [_undo_rope_permutation(a, config.num_kv_heads) for a in arrays]
        weights[name] = arrays[0] - 1.0 if family.norms_plus_one and name.endswith("norm.weight") else arrays[0]
        if kept:
            blocks[name] = BlockRows(block_format, arrays[1])
    return Checkpoint(config, weights, tokenizer_from_gguf(reader, family.chat_template) if tokenizer else None,
                      blocks)
