"""Multi-LoRA serving: decode throughput at a batch and batch-1 latency with 0, 1, 4 and 16 distinct adapters.

    jax-engine bench lora [--adapters 0 1 4 16] [--batch-size 32] [--rank 16] [--prompt-len 16] [--decode-steps 16]

For each count k, one engine: k = 0 is the base model without LoRA; otherwise enable_lora with max_loras = k and
max_lora_rank = --rank, serving k random adapters of that rank on every projection (q, k, v, o, gate, up, down),
written in PEFT's format. The batch's requests take the adapters in turn (request i runs adapter i mod k), so
every step mixes all k; the batch-1 row runs one adapter. Steps are timed as `bench batching` times them: full
decode steps only, the median, compiles apart (start-up compiles every step shape; its seconds are printed).

Beside each row, the bound of that step: every weight and every slot's A and B read once per step, and the
matmul peak for 2 x (params + the slots' shrink and expand) FLOPs per token (the slots are computed for every
row: jax_engine/models/lora.py says why), from the better of two probes of this machine.
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
                     "max_lora_rank", "max_cpu_loras")


def slot_flops_per_token(layout: LoRALayout) -> int:
    """2 x the multiply-adds every token spends on the slots: every slot's shrink and expand, every layer."""
    return 2 * sum(int(np.prod(shape)) for shape in layout.stack_shapes().values())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4, 16],
                        help="counts of distinct adapters in the batch (0: the base model, LoRA off)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16, help="the adapters' rank, and max_lora_rank")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--decode-steps", type=int, default=16, help="timed decode steps per batch")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="write the report as JSON to this file")
    EngineArgs.add_cli_args(parser, exclude=FIXED_ENGINE_ARGS)


def _bound(probe: roofline.Roofline, weight_bytes: int, flops_per_token: int, batch_size: int) -> float:
    """Decode tokens/s no step can beat: the weights (slots included) read once a step, or the matmul peak."""
    return min(batch_size * probe.bandwidth_gbps * 1e9 / weight_bytes, probe.matmul_gflops * 1e9 / flops_per_token)


def run_one(args, checkpoint, count: int, adapter_dirs: list[pathlib.Path], rng) -> dict:
    """Build the engine for `count` adapters and time batch 1 and the batch; the step's bytes and FLOPs with it."""
    from jax_engine import LLMEngine, LoRARequest

    max_model_len = args.prompt_len + output_len(args.batch_size, args.prompt_len, args.decode_steps)
    lora = dict(enable_lora=True, max_loras=count, max_lora_rank=args.rank) if count else {}
    engine_args = EngineArgs.from_cli_args(args, max_model_len=max_model_len, max_num_seqs=args.batch_size,
                                           enable_prefix_caching=False, **lora)
    started = time.perf_counter()
    engine = LLMEngine(engine_args, checkpoint=checkpoint)
    start_up = time.perf_counter() - started
    requests = [LoRARequest(f"adapter{i}", i + 1, str(d)) for i, d in enumerate(adapter_dirs[:count])] or [None]
    one = time_batch(engine, 1, args.prompt_len, args.decode_steps, rng, lora_requests=requests[:1])
    batch = time_batch(engine, args.batch_size, args.prompt_len, args.decode_steps, rng, lora_requests=requests)
    cfg, itemsize = checkpoint.config, np.dtype(engine.dtype).itemsize
    layout = engine.runner.model.lora_layout
    slot_bytes = 0 if layout is None else count * layout.slot_bytes(engine.dtype)
    flops = 2 * cfg.num_params + (0 if layout is None else slot_flops_per_token(layout))
    return dict(adapters=count, start_up_s=start_up, batch_1_ms=one["median_step_s"] * 1e3,
                tokens_per_s=batch["tokens_per_s"], weight_bytes=cfg.num_params * itemsize + slot_bytes,
                flops_per_token=flops, compile_s=one["compile_s"] + batch["compile_s"])


def main(args: argparse.Namespace) -> dict:
    from jax_engine.loader import load_checkpoint

    checkpoint = load_checkpoint(args.model)
    layout = LoRALayout.of(checkpoint.config, checkpoint.weights, max_loras=1, max_rank=args.rank)
    probe_before = roofline.measure(checkpoint.config.num_params)
    rng = np.random.default_rng(args.seed)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        adapter_dirs = [pathlib.Path(tmp) / f"adapter{i}" for i in range(max(args.adapters))]
        for i, directory in enumerate(adapter_dirs):
            write_random_adapter(directory, layout, args.rank, seed=i)
        for count in args.adapters:
            rows.append(run_one(args, checkpoint, count, adapter_dirs, rng))
            print(f"{count:>2} adapters: start-up {rows[-1]['start_up_s']:.1f} s, batch 1 "
                  f"{rows[-1]['batch_1_ms']:.1f} ms/token, batch {args.batch_size} "
                  f"{rows[-1]['tokens_per_s']:.0f} tokens/s", flush=True)
    probe = roofline.best(probe_before, roofline.measure(checkpoint.config.num_params))
    base = next((r for r in rows if r["adapters"] == 0), None)
    print(f"\nbatch {args.batch_size}, rank {args.rank}, prompts of {args.prompt_len}; probe: matmul "
          f"{probe.matmul_gflops:.0f} GFLOP/s, memory {probe.bandwidth_gbps:.1f} GB/s")
    print(f"{'adapters':>8} {'tokens/s':>9} {'of base':>8} {'bound':>7} {'of bound':>9} {'batch 1 ms':>11} "
          f"{'bound ms':>9} {'start-up s':>11}")
    for r in rows:
        r["bound_tokens_per_s"] = _bound(probe, r["weight_bytes"], r["flops_per_token"], args.batch_size)
        r["batch_1_bound_ms"] = 1e3 / _bound(probe, r["weight_bytes"], r["flops_per_token"], 1)
        of_base = f"{r['tokens_per_s'] / base['tokens_per_s']:.0%}" if base else "-"
        print(f"{r['adapters']:>8} {r['tokens_per_s']:>9.0f} {of_base:>8} {r['bound_tokens_per_s']:>7.0f} "
              f"{r['tokens_per_s'] / r['bound_tokens_per_s']:>9.0%} {r['batch_1_ms']:>11.1f} "
              f"{r['batch_1_bound_ms']:>9.1f} {r['start_up_s']:>11.1f}")
    report = dict(machine=_machine(), batch_size=args.batch_size, rank=args.rank, prompt_len=args.prompt_len,
                  roofline=probe.__dict__, rows=rows)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report
