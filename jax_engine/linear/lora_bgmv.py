"""The CPU kernel for each row's LoRA update (cpu_kernel/lora_bgmv.cc): BGMV, each row reading its own slot.

XLA's masked form (jax_engine/models/lora.py) computes every slot for every row; the kernel computes the row's
own, reading A and B in place from the stacks. Past KERNEL_ROWS rows (prefill chunks) the masked form's one
large matmul per piece is faster again.
"""

import functools
import logging
from pathlib import Path

import jax
import jax.numpy as jnp

from jax_engine import native
from jax_engine.target_platform import platform

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "cpu_kernel" / "lora_bgmv.cc"
_TARGET = "jax_engine_lora_bgmv"
KERNEL_ROWS = 64


@functools.cache
def kernel_unavailable_reason() -> str | None:
    """Build (once per machine) and register the kernel. None when it is ready, else why it is not."""
    return native.register_kernel(_SOURCE, "LoRABgmv", _TARGET, logger)


def uses_lora_kernel(rows: int, a: jax.Array) -> bool:
    return (rows <= KERNEL_ROWS and a.dtype == jnp.float32 and platform() == "cpu"
            and kernel_unavailable_reason() is None)


def lora_bgmv(x: jax.Array, a: jax.Array, b: jax.Array, token_slots: jax.Array, layer: jax.Array,
              starts: list[int]) -> jax.Array:
    """x [T, in], stacks a [L, S, P, r, in] and b [L, S, r, out], token_slots [T] (-1: none), `layer`, and each
    piece's first output feature then out -> [T, out] float32."""
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((x.shape[0], b.shape[-1]), jnp.float32))
    return call(x, a, b, token_slots.astype(jnp.int32), jnp.asarray(layer, jnp.int32),
                jnp.asarray(starts, jnp.int32))
