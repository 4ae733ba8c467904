"""Multi-LoRA serving: decode throughput at a batch and batch-1 latency with 0, 1, 4 and 16 distinct adapters.

    jax-engine bench lora [--adapters 0 1 4 16] [--batch-size 32] [--rank 16] [--prompt-len 16] [--decode-steps 16]
        [--rounds 3] [--out docs/figures/data/lora.json]

For each count k, one engine: k = 0 is the base model without LoRA; otherwise enable_lora with max_loras = k and
max_lora_rank = --rank, serving k random adapters of that rank on every projection (q, k, v, o, gate, up, down),
written in PEFT's format. The batch's requests take the adapters in turn (request i runs adapter i mod k), so
every step mixes all k; the batch-1 row runs one adapter. Steps are timed as `bench batching` times them: full
decode steps only, the median, compiles apart (start-up compiles every step shape; its seconds are printed).
Every engine is built first, then they take turns, --rounds times, and each keeps the median of its rounds.

Beside each row, the bound of that step: every weight and the A and B of every adapter the batch uses read
once per step, and the matmul peak for 2 x (params + one adapter's A and B) FLOPs per token (each row's own
adapter: what the CPU kernel computes, jax_engine/linear/lora_bgmv.py), from the better of two probes of this
machine.
"""

import argparse
import json
import pathlib
import tempfile
import time

import numpy as np

from jax_engine.bench import roofline
from jax_engine.bench.batching import _machine, output_len, time_batch
from jax_engine.config import EngineArgs
from jax_engine.lora.layout import LoRALayout
from jax_engine.lora.random_adapter import write_random_adapter

FIXED_ENGINE_ARGS = ("max_model_len", "max_num_seqs", "enable_prefix_caching", "enable_lora", "max_loras",
                     "max_lora_rank", "max_cpu_loras", "kv_cache_memory_bytes")


def adapter_params(layout: LoRALayout) -> int:
    """One adapter's A and B numbers at the layout's rank, every layer: its multiply-adds per token."""
    return sum(int(np.prod(shape)) for shape in layout.stack_shapes().values()) // layout.max_loras


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4, 16],
                        help="counts of distinct adapters in the batch (0: the base model, LoRA off)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16, help="the adapters' rank, and max_lora_rank")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--decode-steps", type=int, default=16, help="timed decode steps per batch")
    parser.add_argument("--rounds", type=int, default=3, help="turns over the engines; each row keeps its medians")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="write the report as JSON to this file")
    EngineArgs.add_cli_args(parser, exclude=FIXED_ENGINE_ARGS)


def _bound(probe: roofline.Roofline, row: dict, batch_size: int) -> float:
    """Decode tokens/s no step can beat: the weights and the adapters the batch uses read once a step, or the
    matmul peak for 2 x (params + one adapter) FLOPs a token."""
    used = min(row["adapters"], batch_size)
    weight_bytes = row["weight_bytes"] + used * row["adapter_bytes"]
    flops = 2 * (row["num_params"] + (row["adapter_params"] if row["adapters"] else 0))
    return min(batch_size * probe.bandwidth_gbps * 1e9 / weight_bytes, probe.matmul_gflops * 1e9 / flops)


def build(args, checkpoint, count: int, adapter_dirs: list[pathlib.Path]) -> dict:
    """The engine for `count` adapters (its start-up timed), its LoRARequests, and the step's bytes and FLOPs."""
    from jax_engine import LLMEngine, LoRARequest
    from jax_engine.kv_cache_plan import bytes_per_block

    max_model_len = args.prompt_len + output_len(args.batch_size, args.prompt_len, args.decode_steps)
    lora = dict(enable_lora=True, max_loras=count, max_lora_rank=args.rank) if count else {}
    cache_bytes = args.batch_size * (max_model_len + 128) * bytes_per_block(checkpoint.config, 1, "float32")
    engine_args = EngineArgs.from_cli_args(args, max_model_len=max_model_len, max_num_seqs=args.batch_size,
                                           enable_prefix_caching=False, kv_cache_memory_bytes=cache_bytes, **lora)
    started = time.perf_counter()
    engine = LLMEngine(engine_args, checkpoint=checkpoint)
    start_up = time.perf_counter() - started
    layout, itemsize = engine.runner.model.lora_layout, np.dtype(engine.dtype).itemsize
    return dict(engine=engine, adapters=count, start_up_s=start_up, num_params=checkpoint.config.num_params,
                requests=[LoRARequest(f"adapter{i}", i + 1, str(d)) for i, d in enumerate(adapter_dirs[:count])],
                weight_bytes=checkpoint.config.num_params * itemsize,
                adapter_params=0 if layout is None else adapter_params(layout),
                adapter_bytes=0 if layout is None else layout.slot_bytes(engine.dtype))


def time_rounds(args, rows: list[dict], rng) -> None:
    """Batch 1 and the batch on every engine in turn, `--rounds` times; each row keeps its medians. Taking turns
    spreads the machine's drift (tens of percent over minutes here) over every engine alike."""
    samples = {id(row): ([], []) for row in rows}
    for _ in range(args.rounds):
        for row in rows:
            requests = row["requests"] or [None]
            one = time_batch(row["engine"], 1, args.prompt_len, args.decode_steps, rng, lora_requests=requests[:1])
            batch = time_batch(row["engine"], args.batch_size, args.prompt_len, args.decode_steps, rng,
                               lora_requests=requests)
            samples[id(row)][0].append(one["median_step_s"] * 1e3)
            samples[id(row)][1].append(batch["tokens_per_s"])
    for row in rows:
        ones, batches = samples[id(row)]
        row.update(batch_1_ms=float(np.median(ones)), tokens_per_s=float(np.median(batches)))


def main(args: argparse.Namespace) -> dict:
    from jax_engine.loader import load_checkpoint

    checkpoint = load_checkpoint(args.model)
    layout = LoRALayout.of(checkpoint.config, checkpoint.weights, max_loras=1, max_rank=args.rank)
    probe_before = roofline.measure(checkpoint.config.num_params)
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        adapter_dirs = [pathlib.Path(tmp) / f"adapter{i}" for i in range(max(args.adapters))]
        for i, directory in enumerate(adapter_dirs):
            write_random_adapter(directory, layout, args.rank, seed=i)
        rows = [build(args, checkpoint, count, adapter_dirs) for count in args.adapters]
        time_rounds(args, rows, rng)
    probe = roofline.best(probe_before, roofline.measure(checkpoint.config.num_params))
    base = next((r for r in rows if r["adapters"] == 0), None)
    print(f"\nbatch {args.batch_size}, rank {args.rank}, prompts of {args.prompt_len}; probe: matmul "
          f"{probe.matmul_gflops:.0f} GFLOP/s, memory {probe.bandwidth_gbps:.1f} GB/s")
    print(f"{'adapters':>8} {'tokens/s':>9} {'of base':>8} {'bound':>7} {'of bound':>9} {'batch 1 ms':>11} "
          f"{'bound ms':>9} {'start-up s':>11}")
    for r in rows:
        r["bound_tokens_per_s"] = _bound(probe, r, args.batch_size)
        r["batch_1_bound_ms"] = 1e3 / _bound(probe, r, 1)
        of_base = f"{r['tokens_per_s'] / base['tokens_per_s']:.0%}" if base else "-"
        print(f"{r['adapters']:>8} {r['tokens_per_s']:>9.0f} {of_base:>8} {r['bound_tokens_per_s']:>7.0f} "
              f"{r['tokens_per_s'] / r['bound_tokens_per_s']:>9.0%} {r['batch_1_ms']:>11.1f} "
              f"{r['batch_1_bound_ms']:>9.1f} {r['start_up_s']:>11.1f}")
    report = dict(machine=_machine(), batch_size=args.batch_size, rank=args.rank, prompt_len=args.prompt_len,
                  rounds=args.rounds, roofline=probe.__dict__,
                  rows=[{k: v for k, v in r.items() if k not in ("engine", "requests")} for r in rows])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report
