"""How the tests have XLA compile their CPU programs: the quick way, except where a test reads a compiled program.

The suite compiles far more than it runs (CI starts with an empty compilation cache), so tests/conftest.py sets
QUICK_COMPILES before JAX starts, and the processes the tests start inherit it: LLVM at -O0 and the older
fusion emitters. The default model's start-up at small sizes takes 5.7 s instead of 14.2 s, its steps run ~25%
slower, and its logprobs differ by at most 2.1e-5 (-O0 rounds some sums differently; the older emitters alone
give the same bits). But the older emitters do not update the KV cache in place, nor read the stacked weights
without a copy: a test that checks what users' programs compile to compiles with USERS_COMPILE, XLA's
defaults for those two options (users_compiled_text). Users, benchmarks and the tests
`make gpu-check` runs (with jax's CUDA plugin) compile with XLA's defaults throughout.
"""

QUICK_COMPILES = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
USERS_COMPILE = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}


def users_compiled_text(lowered) -> str:
    """The optimized HLO of a lowered program compiled as users' engines compile it."""
    return lowered.compile(compiler_options=USERS_COMPILE).as_text()
