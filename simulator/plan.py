"""`jax-engine plan`: the capacity planner. How many tokens' KV cache a model leaves on a device, and how many
sequences of a dataset's lengths that holds.

    jax-engine plan --model llama-3-8b --hardware l4 --dataset sharegpt

Every figure comes with its arithmetic; the engine sizes its own cache with the same functions (capacity.py).
(The request rate a plan sustains is issue 45's next part: a finite simulation at an overloaded rate can look
sustainable, since continuous batching admits every request and only the batch grows until memory runs out, so
the search needs a steady-state criterion first.)
"""

import argparse

from simulator.cost_model import CostModel
from simulator.hardware import PRESETS as HARDWARE, hardware
from simulator.model_spec import PRESETS as MODELS, model_spec
from simulator.workload import DATASETS

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="opt-13b", help=f"a preset ({', '.join(MODELS)}) or a config.json path")
    parser.add_argument("--hardware", default="a100-40gb", help=f"one of {', '.join(HARDWARE)}")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--dtype", default="float16", choices=sorted(DTYPE_BYTES), help="the weights' dtype")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *sorted(DTYPE_BYTES)],
                        help="the KV cache's dtype (auto: the weights')")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dataset", default="sharegpt", choices=sorted(DATASETS), help="request lengths")


def cost_model(args: argparse.Namespace) -> CostModel:
    dtype = DTYPE_BYTES[args.dtype]
    kv_dtype = dtype if args.kv_cache_dtype == "auto" else DTYPE_BYTES[args.kv_cache_dtype]
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    return CostModel(hardware(args.hardware), model_spec(args.model), args.tensor_parallel_size, dtype, kv_dtype,
                     args.gpu_memory_utilization)


def plan_lines(cost: CostModel, args: argparse.Namespace) -> list[str]:
    model, tp, capacity = cost.model, cost.tensor_parallel_size, cost.capacity
    lengths = DATASETS[args.dataset]
    whole = lengths.prompt_mean + lengths.output_mean
    return [
        f"{model.name} on {tp} x {cost.hardware.name}, {args.dtype} weights, KV cache in {cost.kv_dtype_bytes}-byte "
        "values",
        f"weights: {model.num_params / 1e9:.2f}B parameters x {cost.dtype_bytes} bytes / {tp} = "
        f"{cost.weight_bytes / 2**30:.2f} GiB per device",
        f"KV per token: 2 x {model.num_layers} layers x {model.num_kv_heads} KV heads x {model.head_dim} dims x "
        f"{cost.kv_dtype_bytes} bytes / {tp} = {cost.kv_bytes_per_token / 1024:.0f} KiB per device",
        *capacity.lines(),
        f"sequences at {args.dataset}'s lengths ({lengths.prompt_mean:.0f} + {lengths.output_mean:.0f} tokens on "
        f"average): {capacity.num_tokens / whole:.0f} at their full length, "
        f"{capacity.num_tokens / (lengths.prompt_mean + lengths.output_mean / 2):.0f} half-way through their outputs",
    ]


def main(args: argparse.Namespace) -> None:
    cost = cost_model(args)
    for line in plan_lines(cost, args):
        print(line)
    if cost.capacity.num_tokens < cost.model.max_model_len:
        print(f"the KV cache holds fewer tokens than one request of max_model_len ({cost.model.max_model_len}): "
              "add devices (--tensor-parallel-size) or serve shorter requests")
