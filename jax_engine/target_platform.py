"""The platform the engine's programs are traced for: this process's JAX backend, or another while lowering for it.

Code that picks a kernel by platform at trace time (the CPU few-rows matmul, an XLA FFI call that exists only
on CPU) asks `platform()`. `lowering_for("gpu")` makes it answer "gpu" while a program is exported for CUDA on a
machine without one (`jax.export.export(..., platforms=["cuda"])`: tests/test_cuda_lowering.py), so the exported
program is the one a GPU would run. JAX's jit caches key on argument shapes, not on this answer, so entering and
leaving the context clears them: a program traced for one platform is never reused for the other.
"""

import contextlib
import contextvars

import jax

_lowering_for: contextvars.ContextVar[str | None] = contextvars.ContextVar("lowering_for", default=None)


def platform() -> str:
    """"cpu", "gpu" or "tpu": the platform the programs being traced will run on."""
    return _lowering_for.get() or jax.default_backend()


@contextlib.contextmanager
def lowering_for(target: str):
    """Trace for `target` ("gpu", "cpu", "tpu") inside the block, whatever this process's backend."""
    jax.clear_caches()
    token = _lowering_for.set(target)
    try:
        yield
    finally:
        _lowering_for.reset(token)
        jax.clear_caches()
