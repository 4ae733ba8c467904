"""Kernel benchmark: Pallas decode and ragged paged attention against the jnp (xla) path and jax's own
Pallas paged attention, with achieved memory bandwidth as a fraction of the device's peak.

    jax-engine bench kernels [--batch 8] [--context 4096] [--peak-gbps 3350]

The Pallas kernels need a CUDA GPU: on CPU they only run in the (slow) interpreter, which says nothing about
speed. On CPU the command times the cpu backend's C++ kernel instead, decode rows in every layer of a cache
larger than the CPU's caches, with each sequence's blocks in order and scattered (see cpu_main).
"""

import argparse
import json
import os
import pathlib
import platform
import shlex
import sys
import time

import jax
import jax.numpy as jnp

from reference.block_manager import cdiv

# Peak HBM bandwidth in GB/s by device kind (vendor figures).
PEAK_GBPS = {"H100": 3350, "H200": 4800, "A100": 2039, "L4": 300, "A10": 600}


def timed(fn, *args, repeats: int = 20) -> float:
    jax.block_until_ready(fn(*args))  # compile
    started = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - started) / repeats


def peak_gbps(override: float | None) -> float | None:
    if override:
        return override
    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_GBPS.items() if k in kind), None)


def machine() -> dict:
    """What a recorded measurement ran on: CPU model and count, Python, jax and its backend."""
    cpu = next((line.split(":", 1)[1].strip() for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if os.path.exists("/proc/cpuinfo") else ""
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "python": platform.python_version(), "jax": jax.__version__,
            "backend": jax.default_backend(), "device": jax.devices()[0].device_kind}


def record_run(path: str, results: dict) -> None:
    """Append one run (its command line, the machine, its results) to the JSON file at `path`.

    The file holds {"runs": [...]}, so a shell loop over settings collects one file, for a figure to read.
    """
    file = pathlib.Path(path)
    runs = json.loads(file.read_text())["runs"] if file.exists() else []
    argv = sys.argv[sys.argv.index("bench"):] if "bench" in sys.argv else sys.argv[1:]
    command = shlex.join(["jax-engine", *argv])
    runs.append({"command": command, "machine": machine(), **results})
    file.write_text(json.dumps({"runs": runs}, indent=1) + "\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-partitions", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk length for the ragged kernel")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--peak-gbps", type=float, default=None)
    parser.add_argument("--layers", type=int, default=1, help="cpu kernel: layers attended per step")
    parser.add_argument("--cache-gb", type=float, default=2.0, help="cpu kernel: KV cache size, GB")
    parser.add_argument("--json-out", default=None, help="cpu kernel: also append this run's figures to this JSON file")


def cpu_main(args: argparse.Namespace) -> None:
    """The cpu backend's kernel: every sequence's decode row over `--layers` layers of a `--cache-gb` cache.

    Blocks in order are what a fresh cache hands out; scattered ones (a random draw) what it hands out after
    many requests have come and gone. Bandwidth counts the K and V bytes read, against the machine's probe.
    """
    from jax_engine.attention.cpu import attend_rows, kernel_unavailable_reason
    from jax_engine.bench.roofline import bandwidth_gbps

    reason = kernel_unavailable_reason()
    if reason:
        print(f"bench kernels on CPU times the cpu backend's kernel, which is unavailable: {reason}")
        return
    B, T, K, G, D, bs, L = (args.batch, args.context, args.num_kv_heads, args.group, args.head_dim, args.block_size,
                            args.layers)
    dtype = jnp.dtype(args.dtype)
    blocks_per_seq = cdiv(T, bs)
    num_blocks = max(int(args.cache_gb * 1e9) // (2 * L * bs * K * D * dtype.itemsize), B * blocks_per_seq)
    k_cache = jnp.full((L, num_blocks * bs, K, D), 0.01, dtype)
    v_cache = jnp.full((L, num_blocks * bs, K, D), 0.02, dtype)
    key = jax.random.key(0)
    q = jax.random.normal(key, (B, K * G, D), jnp.float32)
    rows, lens = jnp.arange(B, dtype=jnp.int32), jnp.full((B,), T, jnp.int32)
    tables = {"in order": jnp.arange(B * blocks_per_seq, dtype=jnp.int32).reshape(B, blocks_per_seq),
              "scattered": jax.random.permutation(key, num_blocks)[: B * blocks_per_seq].reshape(B, -1).astype(jnp.int32)}

    @jax.jit
    def every_layer(q, k_cache, v_cache, table):
        def layer(i, total):
            return total + attend_rows(q, k_cache, v_cache, i, table, rows, lens, bs, D**-0.5)
        return jax.lax.fori_loop(0, L, layer, jnp.zeros_like(q))

    kv_bytes = 2 * L * B * T * K * D * dtype.itemsize
    peak = args.peak_gbps or bandwidth_gbps()
    print(f"cpu kernel: {B} decode rows x {T} tokens of context, {L} layers, {K} KV heads x {G} queries, head dim "
          f"{D}, block size {bs}, {args.dtype}, {(k_cache.nbytes + v_cache.nbytes) / 1e9:.1f} GB "
          f"cache; K/V read per step {kv_bytes / 1e6:.1f} MB; probed bandwidth {peak:.1f} GB/s")
    print(f"{'blocks':<30}{'time (ms)':>12}{'GB/s':>10}{'of probe':>10}")
    results = []
    for name, table in tables.items():
        seconds = timed(every_layer, q, k_cache, v_cache, table, repeats=5)
        gbps = kv_bytes / seconds / 1e9
        print(f"{name:<30}{seconds * 1e3:>12.1f}{gbps:>10.1f}{gbps / peak:>10.1%}")
        results.append({"blocks": name, "ms": seconds * 1e3, "gbps": gbps})
    if args.json_out:
        settings = {"batch": B, "context": T, "num_kv_heads": K, "group": G, "head_dim": D, "block_size": bs,
                    "layers": L, "dtype": args.dtype, "cache_gb": args.cache_gb}
        record_run(args.json_out, {"settings": settings, "probed_gbps": peak, "kv_bytes_per_step": kv_bytes,
                                   "results": results})


def main(args: argparse.Namespace) -> None:
    if jax.default_backend() == "cpu":
        return cpu_main(args)
    if jax.default_backend() != "gpu":
        print("bench kernels needs a CUDA GPU or a CPU; this machine has neither "
              f"(jax backend: {jax.default_backend()}).")
        return
    gpu_main(args)


def gpu_main(args: argparse.Namespace) -> None:
    """The Pallas decode kernel against the jnp path and jax's own Pallas kernel; then the ragged kernel."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as jax_paged_attention

    from jax_engine.attention.metadata import AttentionMetadata
    from jax_engine.attention.xla import paged_attention as xla_attention
    from pallas_kernels.paged_decode_attention import paged_decode_attention

    dtype = jnp.dtype(args.dtype)
    B, T, K, G, D, bs = args.batch, args.context, args.num_kv_heads, args.group, args.head_dim, args.block_size
    blocks_per_seq = T // bs
    num_blocks = B * blocks_per_seq
    key = jax.random.key(0)
    k_cache = jax.random.normal(key, (1, num_blocks, bs, K, D), dtype)
    v_cache = jax.random.normal(jax.random.fold_in(key, 1), (1, num_blocks, bs, K, D), dtype)
    tables = jax.random.permutation(key, num_blocks).reshape(B, blocks_per_seq).astype(jnp.int32)
    lens = jnp.full((B,), T, jnp.int32)
    q = jax.random.normal(jax.random.fold_in(key, 2), (B, K * G, D), dtype)
    kv_bytes = 2 * B * T * K * D * dtype.itemsize + q.size * dtype.itemsize
    peak = peak_gbps(args.peak_gbps)
    print(f"{jax.devices()[0].device_kind}: batch {B}, context {T}, {K} KV heads x {G} queries, head dim {D}, "
          f"block size {bs}, {args.dtype}; K/V read per decode step {kv_bytes / 1e6:.1f} MB; peak {peak} GB/s")

    flat = lambda c: c.reshape(1, num_blocks * bs, K, D)  # noqa: E731
    # Slots past the cache: the xla path's write of the new token is dropped, so only attention is timed.
    md = AttentionMetadata(jnp.full((B,), T - 1, jnp.int32), jnp.full((B,), num_blocks * bs, jnp.int32), tables, lens,
                           jnp.arange(B + 1, dtype=jnp.int32), jnp.arange(B, dtype=jnp.int32), jnp.zeros((0, 1), jnp.int32))
    pages = lambda c: c[0].transpose(2, 0, 1, 3)  # noqa: E731
    new_kv = jnp.zeros((B, K, D), dtype)
    candidates = {
        "pallas decode (ours)": (jax.jit(lambda q, k, v: paged_decode_attention(
            q, k, v, tables, lens, 0, num_partitions=args.num_partitions)), (q, k_cache, v_cache)),
        "jnp / xla path": (jax.jit(lambda q, k, v: xla_attention(q, new_kv, new_kv, flat(k), flat(v), 0, md, bs,
                                                                D**-0.5)[0]), (q, k_cache, v_cache)),
        "jax pallas paged_attention": (jax.jit(lambda q, k, v: jax_paged_attention(
            q, k, v, tables, lens, k_splits=args.num_partitions)), (q, pages(k_cache), pages(v_cache))),
    }
    print(f"{'decode kernel':<30}{'time (us)':>12}{'GB/s':>10}{'of peak':>10}")
    for name, (fn, fn_args) in candidates.items():
        seconds = timed(fn, *fn_args)
        gbps = kv_bytes / seconds / 1e9
        print(f"{name:<30}{seconds * 1e6:>12.1f}{gbps:>10.0f}{(gbps / peak if peak else float('nan')):>10.1%}")

    _time_ragged_kernel(args, k_cache, v_cache, tables, lens)


def _time_ragged_kernel(args: argparse.Namespace, k_cache, v_cache, tables, lens) -> None:
    """A prefill chunk of --chunk tokens per sequence, over the whole context of each."""
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    B, T, K, G, D, chunk = args.batch, args.context, args.num_kv_heads, args.group, args.head_dim, args.chunk
    q_ragged = jax.random.normal(jax.random.key(0), (B * chunk, K * G, D), k_cache.dtype)
    starts = jnp.arange(B + 1, dtype=jnp.int32) * chunk
    ragged = jax.jit(lambda q, k, v: ragged_paged_attention(q, k, v, tables, lens, starts, 0, max_q_len=chunk))
    seconds = timed(ragged, q_ragged, k_cache, v_cache)
    flops = 4 * B * chunk * T * K * G * D  # causal upper bound: QK^T and PV over the whole context
    print(f"ragged kernel, {B} chunks of {chunk} over {T} context: {seconds * 1e3:.2f} ms, "
          f"{flops / seconds / 1e12:.1f} TFLOP/s (upper-bound count)")

