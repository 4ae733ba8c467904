"""The loader's whole-tensor dequantizers give the gguf package's float32 weights bit for bit, over random blocks
(every byte random, the float16 scales too: infinities and NaNs included), and other formats go to the package."""

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_engine.loader.gguf_dequantize import dequantize

WHOLE_TENSOR = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]
OTHERS = [GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q6_K]


def random_blocks(fmt: GGMLQuantizationType, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Raw bytes as the gguf package reads a tensor: [rows, bytes per row]."""
    block_bytes = GGML_QUANT_SIZES[fmt][1]
    return np.random.default_rng(seed).integers(0, 256, (rows, blocks_per_row * block_bytes), dtype=np.uint8)


@settings(max_examples=60)
@given(fmt=st.sampled_from(WHOLE_TENSOR), rows=st.integers(1, 9), blocks_per_row=st.integers(1, 5),
       seed=st.integers(0, 2**32 - 1))
def test_whole_tensor_dequantizing_gives_the_gguf_packages_bits(fmt, rows, blocks_per_row, seed):
    raw = random_blocks(fmt, rows, blocks_per_row, seed)
    got, expected = dequantize(raw, fmt), gguf_dequantize(raw, fmt).reshape(-1)
    assert got.dtype == np.float32 and got.shape == expected.shape
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))  # the bits, NaNs' included


def test_other_formats_are_the_gguf_packages():
    for fmt in OTHERS:
        raw = random_blocks(fmt, 3, 2, seed=0)
        np.testing.assert_array_equal(dequantize(raw, fmt), gguf_dequantize(raw, fmt).reshape(-1))
