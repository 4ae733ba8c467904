"""Load a llama.cpp GGUF file: config, weights (dequantized when read) and tokenizer, with NumPy only."""

import re
from collections.abc import Iterator, Mapping

import numpy as np
from gguf import GGMLQuantizationType

from jax_engine.linear.gguf_format import FORMATS, BlockRows
from jax_engine.loader.checkpoint import Checkpoint
from jax_engine.loader.gguf_dequantize import dequantize
from jax_engine.loader.gguf_file import GGUFFile, GGUFTensor
from jax_engine.loader.gguf_families import GGUFFamily, gguf_family
from jax_engine.model_config import ModelConfig
from jax_engine.models.rope_scaling import RopeScaling

_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(.+)")
# Llama 3.1+ files: the llama3 rope scaling as one divisor per rotating pair (ModelConfig.rope_freq_factors).
_ROPE_FREQS = "rope_freqs.weight"


def _hf_name(gguf_name: str, family: GGUFFamily) -> str:
    module, _, kind = gguf_name.rpartition(".")  # kind: weight or bias
    if module in family.global_names:
        return f"{family.global_names[module]}.{kind}"
    match = _LAYER_PATTERN.fullmatch(module)
    if match is None or match.group(2) not in family.layer_names:
        raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF file")
    return f"{family.layer_prefix.format(i=match.group(1))}{family.layer_names[match.group(2)]}.{kind}"


def _rope_freq_factors(gguf_file: GGUFFile) -> tuple[float, ...] | None:
    # NOTE: llama.cpp's converter writes no rope.scaling.type for llama3 scaling: these factors are all of it.
    tensor = next((t for t in gguf_file.tensors if t.name == _ROPE_FREQS), None)
    return None if tensor is None else tuple(float(f) for f in _dequantized(tensor).reshape(-1))


def _rope_scaling(gguf_file: GGUFFile, arch: str, max_positions: int) -> RopeScaling | None:
    """llama.cpp's linear scaling: every frequency times 1 / rope.scaling.factor (rope.scale_linear in older files).

    NOTE: llama.cpp applies that factor whether rope.scaling.type says "linear" or "none" (the default is
    "linear"); yarn and longrope take more than it, which we do not read.
    """
    kind = gguf_file.fields.get(f"{arch}.rope.scaling.type", "linear")
    if kind not in ("none", "linear"):
        raise ValueError(f"{arch}.rope.scaling.type={kind!r} is not supported; supported: ['none', 'linear']")
    factor = gguf_file.fields.get(f"{arch}.rope.scaling.factor") or gguf_file.fields.get(f"{arch}.rope.scale_linear")
    return None if factor in (None, 0.0, 1.0) else RopeScaling("linear", float(factor), max_positions)


def _read_config(gguf_file: GGUFFile, family: GGUFFamily) -> ModelConfig:
    arch = gguf_file.fields.get("general.architecture")
    get = lambda key, default=None: gguf_file.fields.get(f"{arch}.{key}", default)  # noqa: E731
    hidden, num_layers = int(get("embedding_length")), int(get("block_count"))
    num_heads = int(get("attention.head_count"))
    tokens = gguf_file.fields.get("tokenizer.ggml.tokens")
    eos = gguf_file.fields.get("tokenizer.ggml.eos_token_id")
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
        tie_word_embeddings="output.weight" not in {t.name for t in gguf_file.tensors},
        bos_token_id=gguf_file.fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(() if eos is None else (int(eos),)) + end_of_turn,
        rope_scaling=_rope_scaling(gguf_file, arch, max_positions),
        rope_freq_factors=_rope_freq_factors(gguf_file),
    )
    return ModelConfig(**{**fields, **family.config(get, hidden, num_layers)})


def _dequantized(tensor: GGUFTensor) -> np.ndarray:
    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        array = np.array(tensor.data, dtype=np.float32)  # a copy: the file's bytes are mapped read-only
    else:
        array = dequantize(tensor.data, tensor.tensor_type)  # a float32 array of its own
    # GGUF lists dimensions fastest-first; NumPy's order is the reverse, which is HF's [out, in].
    return array.reshape(tuple(reversed(tensor.shape)))


def _within_layer(tensor: GGUFTensor) -> str:
    match = _LAYER_PATTERN.fullmatch(tensor.name)
    return tensor.name if match is None else match.group(2)  # "attn_qkv.weight"


class GGUFWeights(Mapping):
    """A GGUF file's tensors under HF names, as the family's HF checkpoint has them, each dequantized to float32
    when asked for: quantization="gguf" keeps most matrices as the file's blocks (Checkpoint.blocks) and never
    asks for them, and dequantizing them all took 2.3 s of the default model's start-up."""

    def __init__(self, tensors: dict[str, GGUFTensor], family: GGUFFamily, config: ModelConfig) -> None:
        self._tensors, self._family, self._config = tensors, family, config

    def __getitem__(self, name: str) -> np.ndarray:
        tensor, family = self._tensors[name], self._family
        within_layer = _within_layer(tensor)
        weight = _dequantized(tensor)
        if within_layer in family.transposed:
            return weight.T
        if within_layer in family.row_order:
            weight = family.row_order[within_layer](weight, self._config)
        return weight - 1.0 if family.norms_plus_one and name.endswith("norm.weight") else weight

    def shape(self, name: str) -> tuple[int, ...]:
        tensor = self._tensors[name]
        hf_order = tuple(reversed(tensor.shape))  # a row permutation keeps the shape
        return hf_order[::-1] if _within_layer(tensor) in self._family.transposed else hf_order

    def __contains__(self, name) -> bool:  # Mapping's own would dequantize the tensor to find it
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def _kept_blocks(tensor: GGUFTensor, family: GGUFFamily, config: ModelConfig) -> BlockRows | None:
    """The tensor's raw block rows (uint8 [out, row bytes]) in the HF row order, where the engine keeps its format."""
    within_layer, block_format = _within_layer(tensor), tensor.tensor_type.name.lower()
    if block_format not in FORMATS or within_layer in family.transposed:  # a transpose mixes the blocks of rows
        return None
    rows = tensor.data
    if within_layer in family.row_order:  # a permutation of rows: the raw ones permute alike
        rows = family.row_order[within_layer](rows, config)
    return BlockRows(block_format, rows)


def load_gguf(path: str, tokenizer: bool = True) -> Checkpoint:
    """Load a GGUF file: its config, its weights under HF names (float32, dequantized as they are read), its
    tokenizer (unless not `tokenizer`), and the raw blocks of its matrices in the formats the engine keeps
    (linear/gguf_format.py: Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K)."""
    gguf_file = GGUFFile(path)
    family = _family(gguf_file)
    config = _read_config(gguf_file, family)
    # rope_freqs.weight is read into config.rope_freq_factors
    tensors = {_hf_name(t.name, family): t for t in gguf_file.tensors if t.name != _ROPE_FREQS}
    blocks = {name: kept for name, t in tensors.items() if (kept := _kept_blocks(t, family, config)) is not None}
    hf_tokenizer = _tokenizer(gguf_file, family) if tokenizer else None
    return Checkpoint(config, GGUFWeights(tensors, family, config), hf_tokenizer, blocks)


def gguf_tokenizer(path: str):
    """A GGUF file's tokenizer alone (an API server's, whose engine core loads the weights)."""
    gguf_file = GGUFFile(path)
    return _tokenizer(gguf_file, _family(gguf_file))


def _family(gguf_file: GGUFFile) -> GGUFFamily:
    return gguf_family(gguf_file.fields.get("general.architecture"), [t.name for t in gguf_file.tensors])


def _tokenizer(gguf_file: GGUFFile, family: GGUFFamily):
    # Imported here: transformers takes ~0.6 s to import, which an engine core that loads no tokenizer never needs.
    from jax_engine.loader.gguf_tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(gguf_file, family.chat_template)
