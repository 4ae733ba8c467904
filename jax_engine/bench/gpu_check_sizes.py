"""What `make gpu-check` runs at which sizes (GPU: the check; SMOKE: its code on CPU in seconds), what every step
is given (Check), and how a step states a target."""

import dataclasses
import pathlib

BUDGET_S = 20 * 60  # the whole check on one H100, installs aside
HEADLINE = (64, 2048)  # batch, context where the decode kernel's bandwidth target is judged


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How much each step does: GPU (the check) or SMOKE (CPU, interpret mode, seconds)."""

    kernel_tests: tuple[str, ...]  # pytest paths or node ids
    families: tuple[str, ...]  # tiny checkpoints' model types (tests/tiny_checkpoints.py)
    default_model: bool  # also compare the default model
    max_tokens: int  # greedy tokens per prompt
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    kernel_shape: dict  # num_kv_heads, group, head_dim, block_size, num_partitions, dtype
    repeats: int  # timed calls per kernel
    bench_kernels: tuple[str, ...]  # each benchmark's command line; {tiny}: a tiny llama checkpoint
    latency: tuple[str, ...]
    throughput: tuple[str, ...]
    interpret: bool  # Pallas interpreter (CPU)


# Every family but Gemma 2 and 3, whose layers have two sliding windows: the Pallas kernels take one static window,
# so they serve on xla (worker.py) and have no Pallas run to compare.
PALLAS_FAMILIES_LEFT_OUT = ("gemma2", "gemma3_text")
ALL_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "opt", "gpt2", "gpt_bigcode", "gpt_neox", "gptj", "falcon",
                "bloom", "phi3", "gemma", "mpt")
GPU = Sizes(
    kernel_tests=("tests/test_pallas_kernels.py", "tests/test_attention_backends.py",
                  "tests/test_contiguous_kernel.py"),
    families=ALL_FAMILIES, default_model=True, max_tokens=16,
    batches=(8, 64, 256), contexts=(512, 1024, 2048, 4096, 8192),
    # The decode kernel's own defaults (4 partitions, BLOCKS_PER_STEP), which the engine runs.
    kernel_shape=dict(num_kv_heads=8, group=4, head_dim=128, block_size=16, num_partitions=4, dtype="bfloat16"),
    repeats=20,
    bench_kernels=("--batch", "64", "--context", "2048"),
    # Pallas's padded layout compiles its step shapes on first use: a warm-up run of each batch meets them first.
    # Async scheduling beside lockstep: on a GPU the host work between steps is what it hides.
    latency=("--batch-sizes", "1", "8", "32", "--input-len", "128", "--output-len", "64", "--quantizations", "none",
             "--max-num-batched-tokens", "512", "--kv-cache-memory-bytes", str(8 << 30), "--num-iters-warmup", "1",
             "--async-scheduling"),
    # Throughput compiles the shapes it meets (reported apart from its run time), not every bucket at start-up.
    throughput=("--num-requests", "128", "--length-mode", "sharegpt-like", "--max-model-len", "1024",
                "--kv-cache-memory-bytes", str(8 << 30), "--enforce-eager"),
    interpret=False,
)
SMOKE = Sizes(
    kernel_tests=("tests/test_contiguous_kernel.py::test_shape_errors_name_the_shapes",),
    families=("llama",), default_model=False, max_tokens=3,
    batches=(2,), contexts=(128,),  # two steps a partition: a partition mix-up shows in the in-order check
    kernel_shape=dict(num_kv_heads=1, group=2, head_dim=64, block_size=16, num_partitions=2, dtype="float32"),
    repeats=1,
    bench_kernels=("--batch", "2", "--context", "32", "--layers", "1", "--cache-gb", "0.001", "--dtype", "float32"),
    latency=("--model", "{tiny}", "--batch-sizes", "1", "--input-len", "8", "--output-len", "4", "--quantizations",
             "none", "--block-size", "4", "--max-num-batched-tokens", "16", "--enforce-eager"),
    throughput=("--model", "{tiny}", "--num-requests", "2", "--length-mode", "fixed", "--input-len", "8",
                "--output-len", "3", "--max-model-len", "16", "--block-size", "4", "--max-num-seqs", "2",
                "--max-num-batched-tokens", "16", "--enforce-eager"),
    interpret=True,
)


@dataclasses.dataclass(frozen=True)
class Check:
    """What every step is given: its sizes, where to write, the GPU's peak bandwidth if known, and the checkpoint
    to run in the default model's place (None: the default model)."""

    sizes: Sizes
    out: pathlib.Path
    smoke: bool
    peak_gbps: float | None = None
    model: str | None = None


def engine_label(dtype: str, kv_cache_dtype: str) -> str:
    """An engine_greedy row's dtype as printed and reported: the model's, and the KV cache's where it differs."""
    return dtype if kv_cache_dtype == "auto" else f"{dtype}, {kv_cache_dtype} cache"


def target(name: str, value, wanted: str, met: bool | None) -> dict:
    """One target beside its figure; met is None where it is not judged (the CPU smoke run)."""
    return {"name": name, "value": value, "target": wanted, "met": met}
