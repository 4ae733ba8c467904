"""Every Pallas kernel, and the engine's programs on them, lowered for CUDA on this CPU-only machine.

`jax.export.export(..., platforms=["cuda"])` lowers a jitted function for a platform this process does not run
on: the Pallas kernels go through the Triton lowering a GPU would use, which accepts only what Triton can
compile (every in-kernel array's dimensions powers of two, tl.dot's 16 rows, the dtypes and ops it has), and
the result is the module a GPU would compile. Only serializing a Triton call is refused (its kernels are not
stable across versions), and nothing here is serialized, so that check is turned off. The interpreter
(test_pallas_kernels.py) checks what the kernels compute; this checks that a GPU can compile them, in every
configuration the engine can give them.
"""

import itertools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels.paged_decode_attention import paged_decode_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.write_kv import write_kv

TRITON_CALL = "__gpu$xla.gpu.triton"
CPU_FFI_TARGETS = ("jax_engine_few_rows_matmul", "jax_engine_paged_attention")  # registered for CPU alone


def export_for_cuda(fn, *args, **kwargs) -> export.Exported:
    """fn (jitted) lowered for CUDA at the shapes of args (arrays or ShapeDtypeStructs; others passed as they are)."""
    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))
                         if isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) else x, args)
    disabled = [export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
    return export.export(fn, platforms=["cuda"], disabled_checks=disabled)(*specs, **kwargs)


# --------------------------------------------------------------------------------------------- the kernels
@dataclass(frozen=True)
class KernelConfig:
    dtype: str  # of the queries, and of the cache unless cache_dtype says otherwise
    block_size: int
    group: int  # query heads per KV head
    head_dim: int
    sliding_window: int | None
    alibi: bool
    num_partitions: int  # the decode kernel's context partitions
    cache_dtype: str | None = None  # an 8-bit cache beside wider queries (kv_cache_dtype="fp8", "fp8_e5m2")

    def __str__(self) -> str:
        variant = "-".join(name for name, on in (("window", self.sliding_window), ("alibi", self.alibi)) if on)
        cache = f"-{self.cache_dtype}-cache" if self.cache_dtype else ""
        return (f"{self.dtype}{cache}-block{self.block_size}-group{self.group}-dim{self.head_dim}-"
                f"{variant or 'causal'}-{self.num_partitions}parts")

    @property
    def stored(self) -> str:
        """The cache's dtype, which the keys and values are rounded to before the write kernel."""
        return self.cache_dtype or self.dtype


VARIANTS = [(None, False), (40, False), (None, True), (40, True)]


def kernel_configs() -> list[KernelConfig]:
    """The issue's axes in full (dtypes, block sizes 16 and 32, GQA groups 1/3/4/8, head dims 64/128), each with
    a variant and a partition count taken in turn; then every other block size the engine allows and the head
    dims its families have that are not 64 or 128 (GPT-NeoX 80, Phi-3 96, Gemma 256; BLOOM's tiny 8 in tests);
    then 8-bit caches (both fp8 formats) beside each query dtype, at both head dims and the engine's block size."""
    configs = []
    axes = itertools.product(["float16", "bfloat16", "float32"], [16, 32], [1, 3, 4, 8], [64, 128])
    for i, (dtype, block_size, group, head_dim) in enumerate(axes):
        window, alibi = VARIANTS[i % len(VARIANTS)]
        configs.append(KernelConfig(dtype, block_size, group, head_dim, window, alibi, [1, 4, 16][i % 3]))
    for i, (block_size, head_dim) in enumerate(itertools.product([1, 2, 4, 8, 64, 128], [8, 80, 96, 256])):
        window, alibi = VARIANTS[i % len(VARIANTS)]
        configs.append(KernelConfig("bfloat16", block_size, 3, head_dim, window, alibi, 4))
    axes = itertools.product(["float8_e4m3fn", "float8_e5m2"], ["float16", "bfloat16", "float32"], [64, 128])
    for i, (cache_dtype, dtype, head_dim) in enumerate(axes):
        window, alibi = VARIANTS[i % len(VARIANTS)]
        configs.append(KernelConfig(dtype, 16, 3, head_dim, window, alibi, 4, cache_dtype))
    return configs


NUM_KV_HEADS, BATCH, COLUMNS, TOKENS = 2, 4, 8, 64


def _cache(config: KernelConfig, paged: bool = True) -> jax.ShapeDtypeStruct:
    num_blocks = BATCH * COLUMNS
    blocks = (num_blocks, config.block_size) if paged else (num_blocks * config.block_size,)
    return jax.ShapeDtypeStruct((2, *blocks, NUM_KV_HEADS, config.head_dim), config.stored)


def _specs(config: KernelConfig, tokens: int) -> dict:
    num_heads = NUM_KV_HEADS * config.group
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    return dict(q=jax.ShapeDtypeStruct((tokens, num_heads, config.head_dim), config.dtype), cache=_cache(config),
                tables=i32(BATCH, COLUMNS), lens=i32(BATCH), starts=i32(BATCH + 1),
                slopes=jax.ShapeDtypeStruct((num_heads,), jnp.float32) if config.alibi else None)


@pytest.mark.parametrize("config", kernel_configs(), ids=str)
def test_decode_kernel_lowers_for_cuda(config: KernelConfig):
    s = _specs(config, BATCH)
    decode = jax.jit(lambda q, k, v, tables, lens, slopes: paged_decode_attention(
        q, k, v, tables, lens, 1, sliding_window=config.sliding_window, alibi_slopes=slopes,
        num_partitions=config.num_partitions))
    text = export_for_cuda(decode, s["q"], s["cache"], s["cache"], s["tables"], s["lens"], s["slopes"]).mlir_module()
    assert TRITON_CALL in text and "paged_decode_attention" in text


@pytest.mark.parametrize("config", kernel_configs(), ids=str)
def test_ragged_kernel_lowers_for_cuda(config: KernelConfig):
    s = _specs(config, TOKENS)
    ragged = jax.jit(lambda q, k, v, tables, lens, starts, slopes: ragged_paged_attention(
        q, k, v, tables, lens, starts, 1, max_q_len=TOKENS // 2, sliding_window=config.sliding_window,
        alibi_slopes=slopes))
    text = export_for_cuda(ragged, s["q"], s["cache"], s["cache"], s["tables"], s["lens"], s["starts"],
                           s["slopes"]).mlir_module()
    assert TRITON_CALL in text and "ragged_paged_attention" in text


CONFIGS = kernel_configs()
# The write varies with the cache's dtype and head dim only: every fourth plain config, each 8-bit format at both dims.
WRITES = [c for c in CONFIGS if not c.cache_dtype][::4] + [c for c in CONFIGS if c.cache_dtype][::3]


@pytest.mark.parametrize("config", WRITES, ids=str)
def test_write_kv_kernel_lowers_for_cuda(config: KernelConfig):
    new = jax.ShapeDtypeStruct((TOKENS, NUM_KV_HEADS, config.head_dim), config.stored)
    cache = _cache(config, paged=False)
    write = jax.jit(lambda k, v, k_cache, v_cache, slots: write_kv(k, v, k_cache, v_cache, slots, 1))
    text = export_for_cuda(write, new, new, cache, cache, jax.ShapeDtypeStruct((TOKENS,), jnp.int32)).mlir_module()
    assert TRITON_CALL in text and "write_kv" in text


# ------------------------------------------------------------------------------------ the engine's programs
def gpu_runner(checkpoint, dtype, cache_dtype=None):
    """The default engine's runner as a GPU would build it: the attention backend "auto" picks there (Pallas,
    compiled), a small cache (in the model's dtype, or `cache_dtype`), eight sequences."""
    from jax_engine.attention import get_attention_backend
    from jax_engine.models.causal_lm import CausalLM
    from jax_engine.runner.model_runner import ModelRunner

    model = CausalLM.from_hf_weights(checkpoint.config, checkpoint.weights, dtype, None, checkpoint.blocks, None)
    backend = get_attention_backend("auto", "gpu")
    assert backend.name == "pallas"
    return ModelRunner(model, num_blocks=64, block_size=16, num_host_blocks=8, max_model_len=256, max_num_seqs=8,
                       backend=backend, dtype=cache_dtype or dtype)


def scheduled_steps(runner) -> dict[str, object]:
    """Steps of each kind the scheduler makes, laid out by the runner: a prompt alone, decodes with a prompt's
    chunk, and a full batch of decodes (the decode kernel's step)."""
    from jax_engine.core.scheduler_output import ScheduledSequence, SchedulerOutput
    from tests.engine_helpers import sequence

    prompt = list(range(1, 41))
    seqs = [sequence(f"s{i}", prompt) for i in range(runner.max_num_seqs)]
    tables = [list(range(3 * i, 3 * i + 3)) for i in range(len(seqs))]
    for seq in seqs[1:]:
        seq.num_computed_tokens = len(prompt) - 1  # its last prompt token left: a decode-sized step
    chunk = lambda i, n: ScheduledSequence(seqs[i], n, tables[i])  # noqa: E731
    steps = {"prompt": [chunk(0, 40)], "decodes and a chunk": [chunk(1, 1), chunk(2, 1), chunk(0, 16)],
             "decodes": [chunk(i, 1) for i in range(1, len(seqs))]}
    return {name: runner.prepare(SchedulerOutput(scheduled=step)) for name, step in steps.items()}


def engine_programs(runner) -> list[tuple[str, object, tuple, dict]]:
    """(name, jitted function, arguments, keyword arguments) of every device program: the step at each kind of
    step, and every other program at each shape start-up compiles for eight rows and eight blocks moved."""
    from jax_engine.runner.device_programs import DEVICE_PROGRAMS, STEP, StartupShapes

    programs = [(f"step: {name}", STEP.fn, (runner.flat_model, runner.k_cache, runner.v_cache, inputs.token_ids,
                                            inputs.lora_slots, inputs.metadata, inputs.logits_indices,
                                            runner.backend.attend), {})
                for name, inputs in scheduled_steps(runner).items()]
    shapes = StartupShapes(max_tokens=64, max_rows=8, max_copies=8, max_swaps=8)
    for program in DEVICE_PROGRAMS:
        if program is not STEP:
            programs += [(str(call.key), call.fn, (*call.args, *call.static), call.kwargs)
                         for call in program.startup_calls(runner, shapes)]
    return programs


def check_programs_lower_for_cuda(checkpoint, dtype, cache_dtype=None) -> None:
    """Every program of the engine on `checkpoint` lowers for CUDA, with no CPU kernel in it and, in its steps,
    the Pallas kernels."""
    from jax_engine.target_platform import lowering_for

    with lowering_for("gpu"):
        runner = gpu_runner(checkpoint, dtype, cache_dtype)
        for name, fn, args, kwargs in engine_programs(runner):
            text = export_for_cuda(fn, *args, **kwargs).mlir_module()
            assert not any(target in text for target in CPU_FFI_TARGETS), f"{name}: a CPU kernel in a GPU program"
            if name.startswith("step"):
                assert TRITON_CALL in text, f"{name}: no Pallas kernel in the step"


@pytest.mark.parametrize(("dtype", "cache_dtype"), [(jnp.bfloat16, None), (jnp.float32, None),
                                                    (jnp.bfloat16, jnp.float8_e4m3fn)],
                         ids=["bfloat16", "float32", "bfloat16-fp8-cache"])
def test_default_model_programs_lower_for_cuda(default_checkpoint, dtype, cache_dtype):
    """SmolLM2-135M (9 query heads over 3 KV heads: the group Triton once refused) as a GPU runs it, and with
    an fp8 cache (kv_cache_dtype="fp8"), which the kernels widen as they load each block."""
    check_programs_lower_for_cuda(default_checkpoint, dtype, cache_dtype)


FAMILIES = {  # tiny random checkpoints (tests/tiny_checkpoints.py) with what the default model lacks
    "mistral": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=96, sliding_window=32),  # GQA 4, window
    "bloom": {},  # ALiBi, 6 heads of 8 dims
}


@pytest.mark.parametrize("family", FAMILIES)
def test_family_programs_lower_for_cuda(tmp_path, family):
    from jax_engine.loader import load_checkpoint
    from tests.tiny_checkpoints import make_tiny_checkpoint

    make_tiny_checkpoint(tmp_path, family, **FAMILIES[family])
    check_programs_lower_for_cuda(load_checkpoint(str(tmp_path)), jnp.bfloat16)
