"""The command-line options `jax-engine simulate` and `jax-engine plan` share: what is served, on what, and the
cost model's terms beyond the roofline."""

import argparse
import dataclasses

from simulator.cost_model import PAPER_OVERHEADS, CostModel
from simulator.hardware import PRESETS as HARDWARE, hardware
from simulator.model_spec import PRESETS as MODELS, model_spec

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1}


def add_cost_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help=f"a preset ({', '.join(MODELS)}) or a config.json path "
                                                       "(default: opt-13b; smollm2-135m on this-cpu)")
    parser.add_argument("--hardware", default="a100-40gb",
                        help=f"one of {', '.join(HARDWARE)}, or this-cpu: fitted from --batching-json")
    parser.add_argument("--batching-json", default=None,
                        help="this-cpu: a `jax-engine bench batching --out` file, the engine's measured steps")
    parser.add_argument("--serving-json", default=None,
                        help="this-cpu: a `jax-engine bench serve --max-concurrency N --json-out` file, for the "
                             "server's cost per streamed token (`bench simulation` records one; without it: the "
                             "engine alone)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--dtype", default="float16", choices=sorted(DTYPE_BYTES), help="the weights' dtype")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *sorted(DTYPE_BYTES)],
                        help="the KV cache's dtype (auto: the weights')")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="KV cache bytes per device, instead of what --gpu-memory-utilization leaves (the "
                             "paper's Table 1: 12884901888 for OPT-13B on one A100-40GB)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--step-overhead-ms", type=float, default=PAPER_OVERHEADS["step_overhead_s"] * 1e3,
                        help="time a step takes beyond the roofline (default: fitted to the paper's vLLM)")
    parser.add_argument("--sequence-overhead-ms", type=float, default=PAPER_OVERHEADS["sequence_overhead_s"] * 1e3,
                        help="time each sequence adds to a step beyond the roofline (default: the paper's)")
    parser.add_argument("--seed", type=int, default=0)


def cost_model(args: argparse.Namespace) -> CostModel:
    """The cost model the options describe; ValueError naming a bad option."""
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.kv_cache_memory_bytes is not None and args.kv_cache_memory_bytes <= 0:
        raise ValueError(f"--kv-cache-memory-bytes must be > 0, got {args.kv_cache_memory_bytes}")
    if args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    if args.hardware == "this-cpu":
        return _this_cpu(args)
    if args.batching_json or args.serving_json:
        raise ValueError("--batching-json and --serving-json fit --hardware this-cpu; they mean nothing on "
                         f"{args.hardware}")
    dtype = DTYPE_BYTES[args.dtype]
    kv_dtype = dtype if args.kv_cache_dtype == "auto" else DTYPE_BYTES[args.kv_cache_dtype]
    return CostModel(hardware(args.hardware), model_spec(args.model or "opt-13b"), args.tensor_parallel_size, dtype,
                     kv_dtype, args.gpu_memory_utilization, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                     step_overhead_s=args.step_overhead_ms / 1e3, sequence_overhead_s=args.sequence_overhead_ms / 1e3)


def _this_cpu(args: argparse.Namespace) -> CostModel:
    """This machine's cost model, read off the engine's recorded runs (simulator/cpu_fit.py)."""
    from simulator.cpu_fit import fit_cpu_cost_model

    if not args.batching_json:
        raise ValueError("--hardware this-cpu needs --batching-json: a `jax-engine bench batching --out` file")
    cost = fit_cpu_cost_model(args.batching_json, args.serving_json, args.model or "smollm2-135m")
    if args.kv_cache_memory_bytes is not None:
        cost = dataclasses.replace(cost, kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    return cost
