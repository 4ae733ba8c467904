"""The decode kernel over batch x context, against a contiguous-cache kernel at the same shapes (paper Fig. 18a).

At each shape one cache [1, B, T, K, D] is read three ways: by the paged kernel through scattered block tables
(what a cache hands out after many requests have come and gone), by the paged kernel through tables in order,
and by contiguous_decode_attention as one run per sequence. Bandwidth counts the K, V and Q bytes read. The
paging overhead is paged (scattered) time / contiguous time - 1: 20-26% for vLLM against FasterTransformer in
the paper; the target here is under 15%. The in-order paged output must equal the contiguous kernel's: the same
keys, in the same steps and partitions.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_engine.bench import roofline
from jax_engine.bench.gpu_check_sizes import HEADLINE, Check, target
from jax_engine.bench.kernels import peak_gbps, timed
from pallas_kernels.contiguous_decode_attention import contiguous_decode_attention
from pallas_kernels.paged_decode_attention import BLOCKS_PER_STEP, paged_decode_attention

MIN_SHARE_OF_PEAK = 0.85  # decode kernel at the headline shape on an H100
MAX_OVERHEAD = 0.15  # paged against contiguous, geometric mean over the sweep
MAX_DIFF = 1e-2  # paged in order against contiguous: the same sums (bf16 outputs: ~4e-3 per rounding step)


def _kernels(batch: int, context: int, shape: dict, interpret: bool):
    """(paged(q, k, v, lens, tables), contiguous(q, k, v, lens)), both reading k / v as [1, B, T, K, D]."""
    K, D, bs, P = shape["num_kv_heads"], shape["head_dim"], shape["block_size"], shape["num_partitions"]

    def pages(cache):  # the same buffer as [1, B x T/bs, bs, K, D]: sequence b owns a run of blocks
        return cache.reshape(1, batch * context // bs, bs, K, D)

    paged = jax.jit(lambda q, k, v, lens, tables: paged_decode_attention(
        q, pages(k), pages(v), tables, lens, 0, num_partitions=P, interpret=interpret))
    # As many keys a step as the paged kernel's default blocks_per_step: the same steps and partitions.
    contiguous = jax.jit(lambda q, k, v, lens: contiguous_decode_attention(
        q, k, v, lens, 0, num_partitions=P, keys_per_step=BLOCKS_PER_STEP * bs, interpret=interpret))
    return paged, contiguous


def time_shape(batch: int, context: int, shape: dict, peak: float, repeats: int, interpret: bool) -> dict:
    """One shape's times (us), bandwidth (GB/s, share of peak), paging overhead and in-order agreement."""
    K, G, D, bs = shape["num_kv_heads"], shape["group"], shape["head_dim"], shape["block_size"]
    dtype = jnp.dtype(shape["dtype"])
    key = jax.random.key(batch * 100_003 + context)
    k, v = (jax.random.normal(jax.random.fold_in(key, i), (1, batch, context, K, D), dtype) for i in (0, 1))
    q = jax.random.normal(jax.random.fold_in(key, 2), (batch, K * G, D), dtype)
    lens = jnp.full((batch,), context, jnp.int32)
    per_seq = context // bs
    in_order = jnp.arange(batch * per_seq, dtype=jnp.int32).reshape(batch, per_seq)
    scattered = jax.random.permutation(key, batch * per_seq).reshape(batch, per_seq).astype(jnp.int32)
    paged, contiguous = _kernels(batch, context, shape, interpret)
    seconds = {"paged": timed(paged, q, k, v, lens, scattered, repeats=repeats),
               "paged_in_order": timed(paged, q, k, v, lens, in_order, repeats=repeats),
               "contiguous": timed(contiguous, q, k, v, lens, repeats=repeats)}
    diff = float(jnp.abs(paged(q, k, v, lens, in_order).astype(jnp.float32)
                         - contiguous(q, k, v, lens).astype(jnp.float32)).max())
    nbytes = 2 * k.size * dtype.itemsize + q.size * dtype.itemsize
    row = {"batch": batch, "context": context, **{f"{name}_us": s * 1e6 for name, s in seconds.items()},
           "gbps": nbytes / seconds["paged"] / 1e9, "contiguous_gbps": nbytes / seconds["contiguous"] / 1e9,
           "overhead": seconds["paged"] / seconds["contiguous"] - 1,
           "in_order_overhead": seconds["paged_in_order"] / seconds["contiguous"] - 1, "max_diff": diff}
    row["of_peak"], row["contiguous_of_peak"] = row["gbps"] / peak, row["contiguous_gbps"] / peak
    print(f"{batch:>6}{context:>8}{row['paged_us']:>11.1f}{row['gbps']:>8.0f}{row['of_peak']:>8.1%}"
          f"{row['paged_in_order_us']:>11.1f}{row['contiguous_us']:>11.1f}{row['contiguous_of_peak']:>8.1%}"
          f"{row['overhead']:>10.1%}{diff:>10.1e}", flush=True)
    return row


def _targets(rows: list[dict], on_gpu: bool, peak_known: bool) -> list[dict]:
    """Bandwidth at the headline shape (judged where the GPU's peak is known) and the paging overhead (on any
    GPU); the in-order paged output against the contiguous kernel's everywhere."""
    headline = next((r for r in rows if (r["batch"], r["context"]) == HEADLINE), None)
    share = headline and headline["of_peak"]
    judge_share = on_gpu and peak_known and headline is not None
    overhead = math.exp(np.mean([math.log1p(r["overhead"]) for r in rows])) - 1
    diff = max(r["max_diff"] for r in rows)
    return [
        target(f"decode kernel at batch {HEADLINE[0]}, context {HEADLINE[1]}: share of HBM peak", share,
               f">= {MIN_SHARE_OF_PEAK:.0%}", share >= MIN_SHARE_OF_PEAK if judge_share else None),
        target("paging overhead against the contiguous kernel (geometric mean over the sweep)", overhead,
               f"< {MAX_OVERHEAD:.0%} (paper: 20-26%)", overhead < MAX_OVERHEAD if on_gpu else None),
        target("paged kernel (blocks in order) equals the contiguous kernel", diff, f"largest difference < {MAX_DIFF}",
               diff < MAX_DIFF),
    ]


def kernel_sweep(check: Check) -> dict:
    """Every batch x context of the check's sizes; performance targets judged on a GPU only."""
    sizes, shape = check.sizes, check.sizes.kernel_shape
    vendor_peak = peak_gbps(check.peak_gbps)
    peak = vendor_peak or roofline.bandwidth_gbps()
    print(f"{jax.devices()[0].device_kind}: {shape['num_kv_heads']} KV heads x {shape['group']} queries, head dim "
          f"{shape['head_dim']}, block size {shape['block_size']}, {shape['num_partitions']} partitions, "
          f"{shape['dtype']}; peak {peak:.0f} GB/s ({'vendor figure' if vendor_peak else 'probed'})")
    print(f"{'batch':>6}{'context':>8}{'paged us':>11}{'GB/s':>8}{'of peak':>8}{'in order':>11}{'contig us':>11}"
          f"{'of peak':>8}{'overhead':>10}{'max diff':>10}")
    rows = [time_shape(b, t, shape, peak, sizes.repeats, sizes.interpret) for b in sizes.batches
            for t in sizes.contexts]
    figures = {"shape": shape, "peak_gbps": peak, "peak_source": "vendor figure" if vendor_peak else "probed",
               "rows": rows}
    return {"figures": figures, "targets": _targets(rows, not check.smoke, vendor_peak is not None),
            "ok": True}
