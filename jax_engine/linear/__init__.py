"""Linear layers: the matmul every projection and the LM head run, and the weight formats it reads."""

from jax_engine.linear.matmul import (FEW_ROWS, GGUF_FEW_ROWS, few_rows_matmul, kernel_unavailable_reason, linear,
                                     uses_few_rows_kernel)
from jax_engine.linear.quantization import QUANTIZATIONS, dequantize, quantize

__all__ = ["FEW_ROWS", "GGUF_FEW_ROWS", "QUANTIZATIONS", "dequantize", "few_rows_matmul", "kernel_unavailable_reason",
           "linear", "quantize", "uses_few_rows_kernel"]
