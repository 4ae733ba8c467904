"""The CPU backend: the XLA backend, with decode attention done by a C++ kernel over the paged cache in place.

XLA can only attend over a paged cache by gathering each sequence's blocks into a dense copy first; on a
CPU that copy, not the arithmetic, is most of a long-context decode step. The kernel
(cpu_kernel/paged_decode.cc) follows the block table instead and stops at each sequence's length. Prefill
chunks stay on the XLA path, where batched matmuls do the work.

The kernel is compiled with the system C++ compiler on first use and cached per source, jaxlib and CPU;
without a compiler the "auto" backend falls back to "xla" (and says why in the log).
"""

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jax_engine.attention import xla

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "cpu_kernel" / "paged_decode.cc"
_TARGET = "jax_engine_paged_decode"
# -ffast-math lets the dot products vectorize; it is a compile flag only: linking with it would add
# crtfastmath.o, which flushes denormals to zero for the whole process the moment the library loads.
_COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-std=c++17", "-fPIC")
_KERNEL_DTYPES = (jnp.float32, jnp.bfloat16)


def _cpu_signature() -> str:
    """-march=native code must not run on another CPU: the cache key includes this one's feature flags."""
    try:
        flags = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")]
        return flags[0] if flags else ""
    except OSError:
        return ""


def _library_path() -> Path:
    cache = Path(os.environ.get("JAX_ENGINE_CACHE_DIR") or Path.home() / ".cache" / "jax_engine")
    parts = [_SOURCE.read_bytes(), " ".join(_COMPILE_FLAGS).encode(), jaxlib.__version__.encode(),
             _cpu_signature().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return cache / f"paged_decode-{key}.so"


def _compile(library: Path) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get("CXX", "c++")
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:  # build aside, then rename: atomic for others
        built, obj = Path(tmp) / library.name, Path(tmp) / "paged_decode.o"
        for command in ([compiler, *_COMPILE_FLAGS, "-I", jax.ffi.include_dir(), "-c", str(_SOURCE), "-o", str(obj)],
                        [compiler, "-shared", str(obj), "-o", str(built)]):
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode:
                raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
        os.replace(built, library)


@functools.cache
def kernel_unavailable_reason() -> str | None:
    """Build (once per machine) and register the kernel. None when it is ready, else why it is not."""
    try:
        library = _library_path()
        if not library.exists():
            logger.info("compiling the CPU paged-attention kernel into %s", library)
            _compile(library)
        handler = ctypes.cdll.LoadLibrary(str(library)).PagedDecode
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(handler), platform="cpu")
    except (OSError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def paged_decode(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array, tables: jax.Array,
                 seq_lens: jax.Array, block_size: int, scale: float) -> jax.Array:
    """q [B, K, G, D] -> [B, K, G, D]: each sequence's one query over its context, read through its table.

    Same contract as the XLA decode; float16 caches (which the kernel does not read) take that path.
    """
    if k_cache.dtype not in _KERNEL_DTYPES:
        return xla.decode(q, k_cache, v_cache, layer, tables, seq_lens, block_size, scale)
    num_seqs, num_kv_heads, group, head_dim = q.shape
    heads = q.reshape(num_seqs, num_kv_heads * group, head_dim).astype(jnp.float32)
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(heads.shape, jnp.float32))
    out = call(heads, k_cache, v_cache, jnp.asarray(layer, jnp.int32), tables, seq_lens,
               block_size=np.int64(block_size), scale=np.float32(scale))
    return out.reshape(q.shape).astype(q.dtype)


paged_attention = functools.partial(xla.paged_attention, decode=paged_decode)
