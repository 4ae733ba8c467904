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

_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(.+)")
# Llama 3.1+ files: the llama3 rope scaling as one divisor per rotating pair (ModelConfig.rope_freq_factors).
_ROPE_FREQS = "rope_freqs.weight"


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _hf_name(gguf_name: str, family: GGUFFamily) -> str:
    module, _, kind = gguf_name.rpartition(".")  # kind: weight or bias
    if module in family.global_names:
        return f"{family.global_names[module]}.{kind}"
    match = _LAYER_PATTERN.fullmatch(module)
    if match is None or match.group(2) not in family.layer_names:
        raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF file")
    return f"{family.layer_prefix.format(i=match.group(1))}{family.layer_names[match.group(2)]}.{kind}"


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
    fields = dict(
        architecture=family.model_type,
        vocab_size=int(get("vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=int(get("attention.key_length", hidden // num_heads)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        norm_eps=float(get(family.norm_eps_key)),
        max_position_embeddings=max_positions,
        tie_word_embeddings="output.weight" not in {t.name for t in reader.tensors},
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(() if eos is None else (int(eos),)) + end_of_turn,
        rope_scaling=_rope_scaling(reader, arch, max_positions),
        rope_freq_factors=_rope_freq_factors(reader),
    )
    return ModelConfig(**{**fields, **family.config(get, hidden, num_layers)})


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
    family = gguf_family(_field(reader, "general.architecture"), [t.name for t in reader.tensors])
    config = _read_config(reader, family)
    weights, blocks = {}, {}
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:  # read into config.rope_freq_factors
            continue
        name = _hf_name(tensor.name, family)
        weights[name], kept = _in_hf_layout(tensor, name, family, config)
        if kept is not None:
            blocks[name] = kept
    return Checkpoint(config, weights, tokenizer_from_gguf(reader, family.chat_template) if tokenizer else None,
                      blocks)


def _in_hf_layout(tensor, name: str, family: GGUFFamily, config: ModelConfig) -> tuple[np.ndarray, BlockRows | None]:
    """A tensor as the family's HF checkpoint has it (`name`), and its raw block rows alike where the engine keeps
    its format."""
    match = _LAYER_PATTERN.fullmatch(tensor.name)
    within_layer = tensor.name if match is None else match.group(2)  # "attn_qkv.weight"
    if within_layer in family.transposed:  # a transpose mixes the blocks of rows: no raw rows kept
        return _dequantized(tensor).T, None
    block_format = tensor.tensor_type.name.lower()
    kept = [tensor.data] if block_format in FORMATS else []  # raw rows [out, row bytes]
    arrays = [_dequantized(tensor), *kept]
    if within_layer in family.row_order:  # a permutation of rows: the raw ones permute alike
        arrays = [family.row_order[within_layer](a, config) for a in arrays]
    weight = arrays[0] - 1.0 if family.norms_plus_one and name.endswith("norm.weight") else arrays[0]
    return weight, BlockRows(block_format, arrays[1]) if kept else None
