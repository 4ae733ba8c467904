"""Our GGUF reader (loader/gguf_file.py) against gguf's own GGUFReader: the same metadata values and the same tensor
bytes, on the default model's file and on files of random metadata and tensors written by gguf's GGUFWriter; and the
loader dequantizes only the tensors it is asked for."""

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter
from hypothesis import given, settings, strategies as st

from jax_engine.loader.gguf_file import GGUFFile
from jax_engine.loader.gguf_loader import GGUFWeights
from jax_engine.loader.load import default_model_path, load_checkpoint

_INTEGERS = {GGUFValueType.UINT8: (0, 255), GGUFValueType.INT8: (-128, 127), GGUFValueType.UINT16: (0, 65535),
             GGUFValueType.INT16: (-32768, 32767), GGUFValueType.UINT32: (0, 2**32 - 1),
             GGUFValueType.INT32: (-2**31, 2**31 - 1), GGUFValueType.UINT64: (0, 2**64 - 1),
             GGUFValueType.INT64: (-2**63, 2**63 - 1)}
_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)  # any UTF-8 but lone surrogates


def _values(value_type: GGUFValueType) -> st.SearchStrategy:
    if value_type in _INTEGERS:
        return st.integers(*_INTEGERS[value_type])
    if value_type == GGUFValueType.FLOAT32:
        return st.floats(width=32, allow_nan=False)
    if value_type == GGUFValueType.FLOAT64:
        return st.floats(allow_nan=False)
    return st.booleans() if value_type == GGUFValueType.BOOL else _TEXT


_SCALAR_TYPES = [*_INTEGERS, GGUFValueType.FLOAT32, GGUFValueType.FLOAT64, GGUFValueType.BOOL, GGUFValueType.STRING]
# (type, item type, value): a scalar or an array (GGUFWriter refuses empty arrays)
_FIELD = st.sampled_from(_SCALAR_TYPES).flatmap(lambda t: st.one_of(
    st.tuples(st.just(t), st.none(), _values(t)),
    st.tuples(st.just(GGUFValueType.ARRAY), st.just(t), st.lists(_values(t), min_size=1, max_size=20))))
# Tensor types stored element by element, and block formats (rows of whole 32- or 256-blocks).
_TENSOR_TYPES = [GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.Q8_0,
                 GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q6_K]


def assert_same_as_gguf_reader(path: str) -> None:
    ours, theirs = GGUFFile(path), GGUFReader(path)
    assert list(ours.fields) == [key for key in theirs.fields if not key.startswith("GGUF.")]
    for key, value in ours.fields.items():
        assert value == theirs.fields[key].contents(), key
        assert type(value) is type(theirs.fields[key].contents()), key
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert (mine.name, mine.tensor_type, mine.shape) == (reference.name, reference.tensor_type,
                                                             tuple(reference.shape.tolist()))
        assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape, mine.name
        assert np.array_equal(mine.data, reference.data), mine.name


def test_the_default_model_reads_as_gguf_reader_reads_it():
    assert_same_as_gguf_reader(default_model_path())


@settings(max_examples=25, deadline=None)
@given(fields=st.dictionaries(st.text(st.characters(min_codepoint=97, max_codepoint=122), min_size=1, max_size=8),
                              _FIELD, max_size=8),
       tensors=st.lists(st.tuples(st.sampled_from(_TENSOR_TYPES), st.integers(1, 3), st.integers(1, 2)), max_size=4),
       seed=st.integers(0, 2**32 - 1), alignment=st.sampled_from([None, 8, 64]),
       endianness=st.sampled_from(GGUFEndian))
def test_random_files_read_as_gguf_reader_reads_them(tmp_path_factory, fields, tensors, seed, alignment, endianness):
    path = str(tmp_path_factory.mktemp("gguf") / "random.gguf")
    writer = GGUFWriter(path, "llama", endianess=endianness)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (value_type, item_type, value) in fields.items():
        writer.add_key_value(f"test.{key}", value, value_type, sub_type=item_type)
    rng = np.random.default_rng(seed)
    for i, (tensor_type, rows, blocks) in enumerate(tensors):
        if tensor_type == GGMLQuantizationType.F16:
            writer.add_tensor(f"t{i}", rng.normal(size=(rows, 32 * blocks)).astype(np.float16))
        elif tensor_type == GGMLQuantizationType.F32:
            writer.add_tensor(f"t{i}", rng.normal(size=(rows, 32 * blocks)).astype(np.float32))
        else:  # random block bytes: a reader copies them, whatever they mean
            row_bytes = blocks * GGML_QUANT_SIZES[tensor_type][1]
            writer.add_tensor(f"t{i}", rng.integers(0, 256, (rows, row_bytes), np.uint8), raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_as_gguf_reader(path)


def test_a_file_that_is_not_gguf_is_refused_with_its_name(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="model.gguf: not a GGUF file"):
        GGUFFile(str(path))
    path.write_bytes(b"GGUF" + (7).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match=r"GGUF version 7 is not supported; supported: \[2, 3\]"):
        GGUFFile(str(path))


class _CountingReads(dict):
    """The checkpoint's weights, counting which were read (dequantized)."""

    def __init__(self, weights: GGUFWeights) -> None:
        super().__init__()
        self.weights, self.read = weights, []

    def __getitem__(self, name):
        self.read.append(name)
        return self.weights[name]

    def __contains__(self, name):
        return name in self.weights

    def shape(self, name):
        return self.weights.shape(name)


def test_gguf_quantization_dequantizes_only_what_it_stores_as_floats():
    """quantization="gguf" keeps the file's blocks: the float32 matrices are never made (they were 2.3 s of the
    default model's start-up), only the norms; and each tensor's shape is known without reading it."""
    from jax_engine.models.causal_lm import CausalLM

    checkpoint = load_checkpoint(skip_tokenizer_init=True)
    weights = checkpoint.weights
    assert isinstance(weights, GGUFWeights)
    assert all(weights.shape(name) == weights[name].shape for name in weights)
    counting = _CountingReads(weights)
    CausalLM.from_hf_weights(checkpoint.config, counting, quantization="gguf", blocks=checkpoint.blocks)
    assert counting.read and all(name.endswith("norm.weight") for name in counting.read)
    assert not set(counting.read) & set(checkpoint.blocks)
